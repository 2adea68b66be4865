"""A sampled draft (one carrying q) under logits processors, while the target samples, is refused: cutting it
at a token a processor forbids is not lossless. Deterministic drafts go on as before."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from splitspec.decoding.adjusters import LogitBias
from splitspec.decoding.controller import FixedPolicy
from splitspec.decoding.drafters import Draft
from splitspec.decoding.loop import decode
from splitspec.decoding.sampling import SamplingParams
from tests.decoding.test_penalised_speculation import ConstantVerifier

V = 4


class OneToken:
    """Drafts token 1, sampled (``sampled``: with its q, uniform) or deterministic."""

    name = "one"

    def __init__(self, sampled: bool) -> None:
        self.sampled = sampled

    def propose(self, context: Sequence[int], budget: int) -> Draft:
        return Draft([1], [-1], torch.full((1, V), 1.0 / V) if self.sampled else None)


async def _decode(sampled: bool, temperature: float) -> list[int]:
    stream = decode(
        ConstantVerifier(torch.zeros(V)), [0], 6, SamplingParams(temperature=temperature),
        torch.Generator().manual_seed(0), {"one": OneToken(sampled)}, FixedPolicy("one", 2),
        processors=[LogitBias({3: -100.0}, V)],
    )  # fmt: skip
    return [emitted.token async for emitted in stream]


async def test_a_sampled_draft_under_processors_is_refused_when_the_target_samples() -> None:
    with pytest.raises(ValueError, match="drafted by sampling"):
        await _decode(sampled=True, temperature=1.0)


@pytest.mark.parametrize(("sampled", "temperature"), [(False, 1.0), (True, 0.0)])
async def test_deterministic_drafts_or_a_greedy_target_decode_under_processors(
    sampled: bool, temperature: float
) -> None:
    assert len(await _decode(sampled, temperature)) == 6


async def test_a_call_for_no_tokens_is_refused() -> None:
    """The prefill's token comes whatever is asked: a caller wanting none drops it, decode does not pretend."""
    stream = decode(ConstantVerifier(torch.zeros(V)), [0], 0, SamplingParams(), torch.Generator())
    with pytest.raises(ValueError, match="max_new_tokens must be at least 1"):
        await anext(stream)
