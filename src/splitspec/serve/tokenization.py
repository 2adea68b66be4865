"""vLLM's tokenizer endpoints: ``/tokenize``, ``/detokenize`` and ``/tokenizer_info``.

Clients such as lm-evaluation-harness probe them to count and build prompts with the server's
own tokenizer. Shapes as vLLM's: ``{"count", "max_model_len", "tokens", "token_strs"}``,
``{"prompt"}``, and ``{"tokenizer_class", ...the tokenizer's config}``.
"""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedTokenizerBase

from splitspec.chat_template import render
from splitspec.serve.errors import invalid
from splitspec.serve.schemas import TokenizeRequest


def tokenize(
    tokenizer: PreTrainedTokenizerBase,
    max_model_len: int,
    body: TokenizeRequest,
    messages: list[dict[str, Any]] | None,
    tools: list[dict[str, Any]],
    template_kwargs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    if messages is not None:
        try:
            ids = render(tokenizer, messages, body.add_generation_prompt, tools or None, body.continue_final_message,
                         template_kwargs)  # fmt: skip
        except Exception as exc:  # the template's own Jinja raise_exception
            raise invalid(f"the chat template refused these messages: {exc}", "messages") from None
    else:
        ids = list(tokenizer.encode(body.prompt or "", add_special_tokens=body.add_special_tokens))
    strs = tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs}


def detokenize(tokenizer: PreTrainedTokenizerBase, vocab_size: int, tokens: list[int]) -> dict[str, Any]:
    bad = [t for t in tokens if not 0 <= t < vocab_size]
    if bad:
        raise invalid(f"token ids {bad[:5]} are outside the vocabulary (0..{vocab_size - 1})", "tokens")
    return {"prompt": tokenizer.decode(tokens)}


def tokenizer_info(tokenizer: PreTrainedTokenizerBase, max_model_len: int) -> dict[str, Any]:
    """The tokenizer's class and its JSON-safe config (special tokens, template, lengths)."""
    info: dict[str, Any] = {"tokenizer_class": type(tokenizer).__name__}
    for key, value in tokenizer.init_kwargs.items():
        if isinstance(value, str | int | float | bool) or value is None:
            info[key] = value
    info.update(
        {
            "model_max_length": max_model_len,
            "vocab_size": len(tokenizer),
            "chat_template": getattr(tokenizer, "chat_template", None),
            "bos_token": tokenizer.bos_token,
            "eos_token": tokenizer.eos_token,
            "pad_token": tokenizer.pad_token,
            "unk_token": tokenizer.unk_token,
        }
    )
    return info
