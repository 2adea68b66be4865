"""Logprobs in OpenAI's two response shapes, from what the edge computes per token.

The edge engine gives, for each token, ``(token_id, logprob, [(alt_id, alt_logprob), ...])``: the
log-softmax of the model's own logits (before temperature, top-k or top-p, as vLLM documents it),
the alternatives best first; ``logprob`` is ``None`` for a prompt's first token, which nothing
predicts. :func:`chat_logprobs` makes chat's ``choices[].logprobs`` (``content[]`` with ``token``,
``logprob``, ``bytes``, ``top_logprobs``); :func:`completion_logprobs` the legacy completions one
(``tokens``, ``token_logprobs``, ``top_logprobs`` as dicts that include the chosen token,
``text_offset``). ``token_bytes`` is the tokenizer's exact bytes of one token, so a token holding
part of a UTF-8 character keeps its bytes (its text is then ``bytes:\\xNN...``, as OpenAI shows it).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

TokenLogprob = tuple[int, float | None, Sequence[tuple[int, float]]]
FLOOR = -9999.0  # what -inf becomes: JSON has no infinities (vLLM's value)


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else FLOOR


def token_text(data: bytes) -> str:
    """A token's text, or ``bytes:\\xNN...`` when its bytes are not whole UTF-8."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data)


def chat_logprobs(entries: Sequence[TokenLogprob], token_bytes: Callable[[int], bytes]) -> dict[str, Any]:
    """Chat's ``logprobs`` object for the generated tokens ``entries``."""

    def one(token_id: int, logprob: float) -> dict[str, Any]:
        data = token_bytes(token_id)
        return {"token": token_text(data), "logprob": _finite(logprob), "bytes": list(data)}

    content = []
    for token_id, logprob, alternatives in entries:
        if logprob is None:
            raise ValueError("every generated token has a logprob")
        entry = one(token_id, logprob)
        entry["top_logprobs"] = [one(a, lp) for a, lp in alternatives]
        content.append(entry)
    return {"content": content, "refusal": None}


def completion_logprobs(
    entries: Sequence[TokenLogprob], token_bytes: Callable[[int], bytes], text_offset: int = 0
) -> dict[str, Any]:
    """The legacy completions ``logprobs`` object; offsets count characters from ``text_offset``."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top: list[dict[str, float] | None] = []
    offsets: list[int] = []
    at = text_offset
    for token_id, logprob, alternatives in entries:
        text = token_text(token_bytes(token_id))
        tokens.append(text)
        offsets.append(at)
        at += len(token_bytes(token_id).decode("utf-8", errors="ignore"))
        if logprob is None:
            token_logprobs.append(None)
            top.append(None)
            continue
        token_logprobs.append(_finite(logprob))
        best = {token_text(token_bytes(a)): _finite(lp) for a, lp in alternatives}
        best.setdefault(text, _finite(logprob))  # the chosen token is always in the dict
        top.append(best)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}
