"""Logits processors: what may change a sequence's logits before a token is chosen from them.

A processor (a grammar, a forced tool call, a logit bias) belongs to one sequence. The decode loop
(:mod:`splitspec.decoding.loop`) calls it on every block of rows it chooses tokens from: the
prefill's last row, and a verification step's rows, which follow the accepted sequence and then
each drafted token of one chain in turn (a draft tree comes one root-to-leaf chain at a time). It is
asked before a draft is sent how much of a chain it allows, told which tokens were emitted, and may
be asked to forget the last n.

A grammar (:class:`splitspec.decoding.grammar.GrammarProcessor`), ``logit_bias``, ``min_tokens``,
``bad_words`` and the penalties (:mod:`splitspec.decoding.adjusters`) are processors;
:class:`ProcessorChain` runs several as one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch


class LogitsProcessor(Protocol):
    def process(self, logits: torch.Tensor, tokens: Sequence[int], draft: Sequence[int]) -> torch.Tensor:
        """logits (q, V) float32 for a chain of q positions: row 0 follows ``tokens`` (the sequence so far,
        accepted), row i follows tokens + draft[:i]. Return the logits with forbidden tokens set to -inf
        (may be in place)."""
        ...

    def validate_draft(self, draft: Sequence[int]) -> int:
        """How many leading tokens of ``draft`` the processor allows after the accepted sequence."""
        ...

    def accept(self, tokens: Sequence[int]) -> None:
        """These tokens were emitted: advance the state."""
        ...

    def rollback(self, n: int) -> None:
        """Forget the last n accepted tokens."""
        ...

    @property
    def finished(self) -> bool:
        """Nothing more may be generated (a grammar reached its end)."""
        ...


class ProcessorChain:
    """Several processors applied in order, as one (each sees the previous one's output)."""

    def __init__(self, processors: Sequence[LogitsProcessor]) -> None:
        self.processors = list(processors)

    def process(self, logits: torch.Tensor, tokens: Sequence[int], draft: Sequence[int]) -> torch.Tensor:
        for p in self.processors:
            logits = p.process(logits, tokens, draft)
        return logits

    def validate_draft(self, draft: Sequence[int]) -> int:
        return min((p.validate_draft(draft) for p in self.processors), default=len(draft))

    def accept(self, tokens: Sequence[int]) -> None:
        for p in self.processors:
            p.accept(tokens)

    def rollback(self, n: int) -> None:
        for p in self.processors:
            p.rollback(n)

    @property
    def finished(self) -> bool:
        return any(p.finished for p in self.processors)
