"""The generation loop over a :class:`Verifier` (anything that turns tokens into next-token logits).

``decode_sequential`` is the baseline: one token per forward step, i.e. one round trip per token
when the verifier is the split client. An optional :class:`LogitsProcessor` (a grammar,
``logit_bias``, penalties) adjusts each position's logits before the token is chosen.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Collection, Sequence
from typing import Protocol

import torch

from splitspec.decoding.processors import LogitsProcessor
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
    processor: LogitsProcessor | None = None,
) -> AsyncIterator[int]:
    """Prefill the prompt, then yield up to ``max_new_tokens`` tokens, one forward step each.

    ``fresh=False`` continues the verifier's sequence: ``prompt_ids`` are appended to what its
    cache already holds (multi-turn chat). ``processor`` sees each position's logits (1, V) before
    the choice and every emitted token; decoding ends early once it is ``finished``.
    """
    if not prompt_ids:
        raise ValueError("the prompt must hold at least one token")
    if fresh:
        verifier.reset()
    logits = await verifier.forward(prompt_ids)  # prefill: (len(prompt), V)
    sequence = list(prompt_ids)
    for produced in range(1, max_new_tokens + 1):
        row = logits[-1]  # (V,)
        if processor is not None:
            row = processor.process(row.float().clone().unsqueeze(0), sequence, ())[0]  # (1, V) -> (V,)
        token = choose_token(row, params, generator)
        if processor is not None:
            processor.accept([token])
        sequence.append(token)
        yield token
        if token in stop_token_ids or produced == max_new_tokens:
            return
        if processor is not None and processor.finished:
            return
        logits = await verifier.forward([token])  # decode_one_token: (1, V)
