"""Logprobs in OpenAI's two response shapes, from what the edge computes per token.

The edge engine gives, for each token, ``(token_id, logprob, [(alt_id, alt_logprob), ...])``: the
log-softmax of the model's own logits (before temperature, top-k or top-p, as vLLM documents it),
the alternatives best first; ``logprob`` is ``None`` for a prompt's first token, which nothing
predicts. :func:`chat_logprobs` makes chat's ``choices[].logprobs`` (``content[]`` with ``token``,
``logprob``, ``bytes``, ``top_logprobs``); :func:`completion_logprobs` the legacy completions one
(``tokens``, ``token_logprobs``, ``top_logprobs`` as dicts that include the chosen token,
``text_offset``). ``token_bytes`` is the tokenizer's exact bytes of one token, so a token holding
part of a UTF-8 character keeps its bytes (its text is then ``bytes:\\xNN...``, as OpenAI shows it).
:class:`TokenBytes` gives those bytes for a server's tokenizer.
"""

from __future__ import annotations

import codecs
import copy
import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

import llguidance.hf
from transformers import PreTrainedTokenizerFast

from splitspec.decoding.loop import Emitted

log = logging.getLogger(__name__)

TokenLogprob = tuple[int, float | None, Sequence[tuple[int, float]]]
FLOOR = -9999.0  # what -inf becomes: JSON has no infinities (vLLM's value)


class TokenBytes:
    """One token's exact bytes, for the ``bytes`` and ``token`` of a logprob entry.

    Through llguidance's view of the tokenizer when it has one (byte-level BPE, SentencePiece with
    byte fallback: a token holding half a UTF-8 character gives that half); for a tokenizer
    llguidance cannot read (no byte-level decoder), the token decoded alone, as vLLM does, in UTF-8.
    """

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self._ll: llguidance.LLTokenizer | None = None
        self._known: dict[int, bytes] = {}
        # the tokens a response's text leaves out (it is decoded with skip_special_tokens)
        self.special_ids = frozenset(int(i) for i in getattr(tokenizer, "all_special_ids", ()))
        if not isinstance(tokenizer, PreTrainedTokenizerFast):
            log.info(
                "logprob token bytes: each token decoded alone (%s is not a fast tokenizer)", type(tokenizer).__name__
            )
            return
        try:
            self._ll = llguidance.hf.from_tokenizer(tokenizer, n_vocab=max(vocab_size, len(tokenizer)))
        except ValueError as exc:  # llguidance names a decoder it cannot read
            log.info("logprob token bytes: each token decoded alone (llguidance cannot read the tokenizer: %s)", exc)

    def showing_special(self) -> TokenBytes:
        """The same bytes, for a text that shows special tokens (no token is left out of its offsets)."""
        shown = copy.copy(self)
        shown.special_ids = frozenset()
        return shown

    def __call__(self, token_id: int) -> bytes:
        data = self._known.get(token_id)
        if data is None:
            if self._ll is not None:
                data = bytes(self._ll.decode_bytes([token_id]))
            else:
                data = str(self._tokenizer.decode([token_id], skip_special_tokens=False)).encode("utf-8")
            self._known[token_id] = data
        return data


def triples(entries: Sequence[Emitted]) -> list[TokenLogprob]:
    """The edge's :class:`Emitted` tokens as (token_id, logprob, alternatives)."""
    return [(e.token, e.logprob, e.top) for e in entries]


class TextOffsets:
    """Where each token of one choice starts in its text, in characters, as its tokens come (across a stream's
    chunks). A token that ends inside a UTF-8 character adds nothing until a later one completes it, and a
    special token, which the text leaves out, adds nothing: each offset is the length of the text before it."""

    def __init__(self, token_bytes: Callable[[int], bytes]) -> None:
        self._token_bytes = token_bytes
        self._special_ids = token_bytes.special_ids if isinstance(token_bytes, TokenBytes) else frozenset()
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")  # as the text shows bad bytes
        self.at = 0  # characters of text so far

    def next(self, token_id: int) -> int:
        """The offset of ``token_id``, the choice's next token."""
        start = self.at
        if token_id not in self._special_ids:
            self.at += len(self._decoder.decode(self._token_bytes(token_id)))
        return start


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else FLOOR


def token_text(data: bytes) -> str:
    """A token's text, or ``bytes:\\xNN...`` when its bytes are not whole UTF-8."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data)


def prompt_logprobs_json(
    prompt: Sequence[Emitted], top: int, token_bytes: Callable[[int], bytes]
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs``: None for the prompt's first token (nothing predicts it), then for each later one a
    map from token id (as a string) to its ``logprob``, ``rank`` and ``decoded_token``: the prompt's own token first,
    then the ``top`` likeliest there (ranks 1 to ``top``)."""

    def one(token_id: int, logprob: float, rank: int | None) -> dict[str, Any]:
        return {"logprob": _finite(logprob), "rank": rank, "decoded_token": token_text(token_bytes(token_id))}

    out: list[dict[str, dict[str, Any]] | None] = [None] if prompt else []
    for entry in prompt[1:]:
        logprob = entry.logprob if entry.logprob is not None else -math.inf
        row = {str(entry.token): one(entry.token, logprob, entry.rank)}
        for rank, (token_id, alternative) in enumerate(entry.top[:top], start=1):
            row.setdefault(str(token_id), one(token_id, alternative, rank))
        out.append(row)
    return out


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
    entries: Sequence[TokenLogprob], token_bytes: Callable[[int], bytes], offsets_of: TextOffsets | None = None
) -> dict[str, Any]:
    """The legacy completions ``logprobs`` object; ``offsets_of``: the choice's text offsets so far (a stream's
    earlier chunks), else they start at 0."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top: list[dict[str, float] | None] = []
    offsets: list[int] = []
    at = TextOffsets(token_bytes) if offsets_of is None else offsets_of
    for token_id, logprob, alternatives in entries:
        text = token_text(token_bytes(token_id))
        tokens.append(text)
        offsets.append(at.next(token_id))
        if logprob is None:
            token_logprobs.append(None)
            top.append(None)
            continue
        token_logprobs.append(_finite(logprob))
        best = {token_text(token_bytes(a)): _finite(lp) for a, lp in alternatives}
        best.setdefault(text, _finite(logprob))  # the chosen token is always in the dict
        top.append(best)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}
