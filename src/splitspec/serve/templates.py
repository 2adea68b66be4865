"""Chat templates: OpenAI messages -> the prompt text the model was trained on.

Rendered by the tokenizer's own Jinja template (``tokenizer.apply_chat_template``), or by a
template given on the command line for a checkpoint that ships none.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from splitspec.exceptions import ConfigError


def render_chat(tokenizer: Any, messages: Sequence[dict[str, str]], template: str | None = None) -> str:
    """The prompt text for ``messages`` ({"role", "content"} dicts), ending where the reply starts."""
    if template is None and not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            "this model's tokenizer has no chat template: use /v1/completions, or start the server "
            "with --chat-template FILE"
        )
    text = tokenizer.apply_chat_template(
        list(messages), chat_template=template, tokenize=False, add_generation_prompt=True
    )
    return str(text)
