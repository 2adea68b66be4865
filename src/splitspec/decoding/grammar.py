"""Grammars on the edge's logits: JSON schemas and Lark grammars through llguidance.

:class:`GrammarCompiler` turns a JSON schema (OpenAI's ``response_format``) or a Lark grammar (a
forced tool call) into llguidance's grammar text, refusing what llguidance cannot compile with
:class:`~splitspec.exceptions.InvalidGrammar`; it wraps the tokenizer for llguidance once per set
of stop tokens (that takes ~1 s), so every request after the first only compiles its grammar.
:class:`GrammarProcessor` is a :class:`~splitspec.decoding.processors.LogitsProcessor` over one
``LLMatcher``: per-position token bitmasks, ``validate_tokens`` for drafts and ``rollback``.
JSON Schema is never compiled here by hand.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.hf
import numpy as np
import torch
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from splitspec.exceptions import ConfigError, InvalidGrammar

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # a TypedDict of the stubs only

log = logging.getLogger(__name__)

# JSON as json.dumps writes it: fixed separators, no free whitespace (a model can otherwise pad
# a document with whitespace until max_tokens). A schema's own "x-guidance" may override it.
JSON_LAYOUT: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


WRAPPED_TOKENIZERS = 4  # llguidance tokenizers kept, one per set of stop tokens


class GrammarCompiler:
    """Compiles grammars for one tokenizer and a model vocabulary of ``vocab_size`` logits."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> None:
        if not isinstance(tokenizer, PreTrainedTokenizerFast):
            raise ConfigError(f"grammars need a fast tokenizer; {type(tokenizer).__name__} is not one")
        self.tokenizer = tokenizer
        self.vocab_size = max(vocab_size, len(tokenizer))
        self.logits_size = vocab_size  # columns of the logits the processors mask
        self._wrapped: OrderedDict[frozenset[int], llguidance.LLTokenizer] = OrderedDict()
        self._lock = threading.Lock()  # the cache is filled from a worker thread (:meth:`prepare`)

    def lltokenizer(self, stop_ids: Collection[int]) -> llguidance.LLTokenizer:
        """The tokenizer as llguidance sees it, ending a grammar with any of ``stop_ids``.

        Kept for the last few sets of stop tokens (a server sees two or three: chat, completions,
        ``ignore_eos``); a request's own ``stop_token_ids`` cannot grow the cache without bound.
        Wrapping takes time in proportion to the vocabulary (about 45 ms for 8k tokens, a second for
        128k): a server calls :meth:`prepare` off its event loop first.
        """
        key = frozenset(stop_ids)
        with self._lock:
            if key in self._wrapped:
                self._wrapped.move_to_end(key)
                return self._wrapped[key]
        eos = sorted(key) or [int(self.tokenizer.eos_token_id or 0)]
        try:
            wrapped = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size, eos_token=eos)
        except ValueError as exc:  # e.g. "can't determine decoder type"
            raise ConfigError(f"llguidance cannot read this tokenizer for grammars: {exc}") from None
        with self._lock:
            wrapped = self._wrapped.setdefault(key, wrapped)  # a thread that wrapped it meanwhile wins
            self._wrapped.move_to_end(key)
            while len(self._wrapped) > WRAPPED_TOKENIZERS:
                self._wrapped.popitem(last=False)
        return wrapped

    async def prepare(self, stop_ids: Collection[int]) -> None:
        """Wrap the tokenizer for ``stop_ids`` on a worker thread, so that :meth:`processor` finds it ready
        and an event loop serving other streams is not held up while it is built."""
        await asyncio.to_thread(self.lltokenizer, stop_ids)

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes of one token (part of a UTF-8 character for some byte-level tokens)."""
        return bytes(self.lltokenizer(()).decode_bytes([token_id]))

    def json_schema(self, schema: Mapping[str, Any], what: str = "the JSON schema") -> str:
        """llguidance's grammar for documents valid under ``schema``; InvalidGrammar naming ``what``."""
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_LAYOUT)
        except (ValueError, TypeError) as exc:
            raise InvalidGrammar(f"{what} is not a JSON schema: {exc}") from None
        return self._checked(grammar, what)

    def lark(self, text: str, what: str = "the grammar") -> str:
        """llguidance's grammar for a Lark grammar (``%json {...}`` embeds a JSON schema)."""
        return self._checked(llguidance.LLMatcher.grammar_from_lark(text), what)

    def literal(self, text: str) -> str:
        """``text`` as a Lark terminal: a special or added token by id when it is one, else a string."""
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == 1 and ids[0] in self.tokenizer.added_tokens_decoder:
            return f"<[{ids[0]}]>"
        return json.dumps(text)

    def processor(self, grammar: str, stop_ids: Collection[int]) -> GrammarProcessor:
        return GrammarProcessor(self.lltokenizer(stop_ids), grammar, self.logits_size)

    def _checked(self, grammar: str, what: str) -> str:
        error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, None)
        if error:
            raise InvalidGrammar(f"{what} is invalid: {messages[0] if messages else 'refused by llguidance'}")
        for warning in messages:
            log.debug("grammar warning for %s: %s", what, warning)
        return grammar


class GrammarProcessor:
    """Masks every token the grammar forbids; ends (``finished``) when the grammar is complete."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, grammar: str, vocab_size: int) -> None:
        self._matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if self._matcher.is_error():
            raise InvalidGrammar(f"the grammar is invalid: {self._matcher.get_error()}")
        self.vocab_size = vocab_size  # logits columns; ids the tokenizer lacks are always masked

    def allowed(self) -> torch.Tensor:
        """(V,) bool: the tokens the grammar allows next."""
        bits = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        mask = np.unpackbits(bits, bitorder="little")[: self.vocab_size]  # (V,)
        return torch.from_numpy(mask.astype(np.bool_))

    def process(self, logits: torch.Tensor, tokens: Sequence[int], draft: Sequence[int]) -> torch.Tensor:
        q = logits.shape[0]
        if self.validate_draft(draft[: q - 1]) < q - 1:
            raise ValueError("the draft holds a token the grammar forbids: cut it with validate_draft first")
        consumed = 0
        try:
            for i in range(q):  # row i follows draft[:i]
                if i > 0:
                    self._matcher.consume_token(int(draft[i - 1]))
                    consumed += 1
                allowed = self.allowed()
                if not allowed.any():  # e.g. a tokenizer with no token for a character the grammar needs
                    raise InvalidGrammar(f"no token of this tokenizer can continue the grammar here ({self.error})")
                logits[i].masked_fill_(~allowed.to(logits.device), -float("inf"))  # (V,)
        finally:
            if consumed:
                self._matcher.rollback(consumed)
        return logits

    def validate_draft(self, draft: Sequence[int]) -> int:
        if not draft:
            return 0
        return int(self._matcher.validate_tokens([int(t) for t in draft]))

    def accept(self, tokens: Sequence[int]) -> None:
        if not self._matcher.consume_tokens([int(t) for t in tokens]):
            raise ValueError(f"tokens {list(tokens)} break the grammar: {self._matcher.get_error()}")

    def rollback(self, n: int) -> None:
        if n and not self._matcher.rollback(n):
            raise ValueError(f"cannot roll the grammar back by {n} tokens: {self._matcher.get_error()}")

    @property
    def error(self) -> str:
        return str(self._matcher.get_error()) or "no error"

    @property
    def finished(self) -> bool:
        """The grammar is complete: nothing but a stop token may follow."""
        return bool(self._matcher.is_stopped())
