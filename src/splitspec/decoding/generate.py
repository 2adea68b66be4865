"""Sequential generation over a :class:`Verifier` (anything that turns tokens into next-token logits).

``decode_sequential`` is the baseline: one token per forward step, i.e. one round trip per token
when the verifier is the split client. It is the one decode loop (:mod:`splitspec.decoding.loop`)
without drafters. An optional
:class:`LogitsProcessor` (a grammar, ``logit_bias``, penalties) adjusts each position's logits
before the token is chosen.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Collection, Sequence
from typing import Protocol

import torch

from splitspec.decoding.loop import decode
from splitspec.decoding.processors import LogitsProcessor
from splitspec.decoding.sampling import SamplingParams


class Verifier(Protocol):
    """Runs query tokens through the model, appending them to its cache."""

    async def forward(
        self, tokens: Sequence[int], parents: Sequence[int] | None = None, logits_from: int = 0
    ) -> torch.Tensor:
        """tokens (q,) with parent indices (default: a chain) -> logits (q - logits_from, V): the rows of
        query tokens ``logits_from`` onwards (a prefill needs only its last)."""
        ...

    def reset(self) -> None:
        """Forget the whole sequence (empty caches)."""
        ...


async def decode_sequential(
    verifier: Verifier,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    params: SamplingParams,
    generator: torch.Generator,
    stop_token_ids: Collection[int] = (),
    fresh: bool = True,
    processor: LogitsProcessor | None = None,
) -> AsyncIterator[int]:
    """Prefill the prompt, then yield up to ``max_new_tokens`` tokens, one forward step each: the one
    decode loop (:func:`splitspec.decoding.loop.decode`) with no drafters.

    ``fresh=False`` continues the verifier's sequence: ``prompt_ids`` are appended to what its
    cache already holds (multi-turn chat). ``processor`` sees each position's logits (1, V) before
    the choice and every emitted token; decoding ends early once it is ``finished``.
    """
    history = None if fresh else ()  # the loop only needs to know not to reset; the drafters are off
    async for emitted in decode(_Chain(verifier), prompt_ids, max_new_tokens, params, generator,
                                stop_token_ids=stop_token_ids, history=history,
                                processors=() if processor is None else (processor,)):  # fmt: skip
        yield emitted.token


class _Chain:
    """A plain :class:`Verifier` as a tree verifier: without drafts, every step is one token and nothing is pruned."""

    def __init__(self, verifier: Verifier) -> None:
        self.verifier = verifier

    async def forward(
        self,
        tokens: Sequence[int],
        parents: Sequence[int] | None = None,
        logits_from: int = 0,
        *,
        sent: Callable[[], None] | None = None,
    ) -> torch.Tensor:
        if sent is not None:
            sent()  # a plain verifier says nothing of its round trip: at once
        return await self.verifier.forward(tokens, parents, logits_from)

    def keep(self, indices: Sequence[int]) -> None:
        raise RuntimeError("a sequential step keeps all of its one token")

    def reset(self) -> None:
        self.verifier.reset()
