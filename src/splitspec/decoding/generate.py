"""The generation loop over a :class:`Verifier` (anything that turns tokens into next-token logits).

``decode_sequential`` is the baseline: one token per forward step, i.e. one round trip per token
when the verifier is the split client.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Collection, Sequence
from typing import Protocol

import torch

from splitspec.decoding.sampling import SamplingParams, choose_token


class Verifier(Protocol):
    """Runs query tokens through the model, appending them to its cache."""

    async def forward(self, tokens: Sequence[int], parents: Sequence[int] | None = None) -> torch.Tensor:
        """tokens (q,) with parent indices (default: a chain) -> logits (q, V)."""
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
) -> AsyncIterator[int]:
    """Prefill the prompt, then yield up to ``max_new_tokens`` tokens, one forward step each.

    ``fresh=False`` continues the verifier's sequence: ``prompt_ids`` are appended to what its
    cache already holds (multi-turn chat).
    """
    if not prompt_ids:
        raise ValueError("the prompt must hold at least one token")
    if fresh:
        verifier.reset()
    logits = await verifier.forward(prompt_ids)  # prefill: (len(prompt), V)
    for produced in range(1, max_new_tokens + 1):
        token = choose_token(logits[-1], params, generator)
        yield token
        if token in stop_token_ids or produced == max_new_tokens:
            return
        logits = await verifier.forward([token])  # decode_one_token: (1, V)
