"""A conversation as the model's publisher formats it: the tokenizer's own chat template.

Used by ``splitspec chat``, the Python API and the OpenAI-compatible server alike. The whole
conversation is rendered with ``tokenizer.apply_chat_template`` every turn (so a BOS token, if the
template has one, appears once, at the start) and compared with the tokens the caches already
hold: only the part after their common prefix crosses the link (:func:`plan_turn`).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from splitspec.prefix import common_prefix

Message = Mapping[str, Any]  # {"role": "system" | "user" | "assistant" | "tool", "content": text, ...}


def has_chat_template(tokenizer: PreTrainedTokenizerBase) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def render(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Message],
    add_generation_prompt: bool = True,
    tools: Sequence[Mapping[str, Any]] | None = None,
    continue_final_message: bool = False,
    template_kwargs: Mapping[str, Any] | None = None,
) -> list[int]:
    """Token ids of ``messages`` under the tokenizer's chat template (with the assistant's cue).

    ``tools``: OpenAI tool definitions, for templates that describe them to the model.
    ``continue_final_message``: the last message is left open (no end of turn), for the model to go on with.
    ``template_kwargs``: more variables for the template (Qwen3's ``enable_thinking``); none of
    :func:`reserved_template_kwargs`.
    """
    ids = tokenizer.apply_chat_template(
        [dict(m) for m in messages],
        tools=[dict(t) for t in tools] if tools else None,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        tokenize=True,
        return_dict=False,
        **dict(template_kwargs or {}),
    )
    out = [t for t in ids if isinstance(t, int)] if isinstance(ids, list) else []
    if len(out) != len(ids):
        raise TypeError(f"{type(tokenizer).__name__}.apply_chat_template did not return token ids")
    return out


def reserved_template_kwargs(tokenizer: PreTrainedTokenizerBase) -> frozenset[str]:
    """Names a template variable of :func:`render` may not have: ``apply_chat_template``'s own parameters
    (``tokenize``, ``add_generation_prompt``, ...) and the ``messages`` it sets."""
    params = inspect.signature(tokenizer.apply_chat_template).parameters.values()
    named = {p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    return frozenset(named | {"messages"})


def end_of_turn_ids(tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """The special token(s) the template closes an assistant turn with (e.g. <|im_end|>, <|eot_id|>).

    Found by rendering a one-exchange conversation and reading the first special token after the
    assistant's content; empty when the template closes turns with plain text.
    """
    user = [{"role": "user", "content": "hi"}]
    cue = render(tokenizer, user)
    full = render(tokenizer, [*user, {"role": "assistant", "content": "ok"}], add_generation_prompt=False)
    if full[: len(cue)] != cue:
        return frozenset()
    special = set(tokenizer.all_special_ids)
    reply = tokenizer.encode("ok", add_special_tokens=False)
    after = full[len(cue) + len(reply) :]
    return frozenset(t for t in after[:1] if t in special)


@dataclass(frozen=True)
class TurnPlan:
    """How to bring caches holding ``cached`` tokens to a rendered conversation."""

    keep: int  # cached tokens to keep (the rest are truncated)
    send: list[int]  # tokens to run after them (never empty)


def plan_turn(cached: Sequence[int], rendered: Sequence[int]) -> TurnPlan:
    """Keep the longest common prefix of what the caches hold and the new rendering; send the rest."""
    if not rendered:
        raise ValueError("the rendered conversation is empty")
    keep = min(common_prefix(cached, rendered), len(rendered) - 1)  # always send at least one token
    return TurnPlan(keep=keep, send=list(rendered[keep:]))
