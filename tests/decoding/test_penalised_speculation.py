"""Greedy speculative decoding under OpenAI's penalties emits what one-token greedy decoding emits, even where
a penalised token ties another one to the last bit."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from splitspec.decoding.adjusters import Penalties
from splitspec.decoding.controller import FixedPolicy
from splitspec.decoding.drafters import Draft
from splitspec.decoding.loop import decode
from splitspec.decoding.sampling import SamplingParams

FREQUENCY, PRESENCE = 0.3697, -0.5431  # the reviewer's settings
TIED, PENALISED = 1, 2  # the tie goes to the lower index (argmax's first maximum)
V = 4


def tie_logits() -> torch.Tensor:
    """(V,) logits where PENALISED, generated twice, ties TIED exactly in float32 (as one-token decoding computes
    it), while two subtractions (generated once, then drafted once) leave it an ulp above."""
    x = torch.tensor([1.3407868146896362])  # float32: the two orders of subtraction differ here
    twice = x - (torch.tensor([2.0]) * FREQUENCY + PRESENCE)  # the one-token expression, (1,)
    logits = torch.full((V,), -100.0)
    logits[PENALISED] = x[0]
    logits[TIED] = twice[0]
    return logits


class ConstantVerifier:
    """Every row scores the same logits, whatever the tokens (a tree verifier with nothing cached to check)."""

    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits

    def reset(self) -> None:
        return None

    def keep(self, indices: Sequence[int]) -> None:
        return None

    async def forward(
        self,
        tokens: Sequence[int],
        parents: Sequence[int] | None = None,
        logits_from: int = 0,
        *,
        sent: Callable[[], None] | None = None,
    ) -> torch.Tensor:
        if sent is not None:
            sent()
        return self.logits.repeat(len(tokens), 1)[logits_from:]  # (q - logits_from, V)


class Repeat:
    """Drafts the penalised token again."""

    name = "repeat"

    def propose(self, context: Sequence[int], budget: int) -> Draft:
        return Draft([PENALISED] * min(budget, 1), [-1][: min(budget, 1)])


async def _greedy(drafting: bool) -> list[int]:
    drafters = {"repeat": Repeat()} if drafting else {}
    policy = FixedPolicy("repeat", 1) if drafting else None
    stream = decode(
        ConstantVerifier(tie_logits()), [0], 4, SamplingParams(), torch.Generator(), drafters, policy,
        processors=[Penalties(PRESENCE, FREQUENCY)],
    )  # fmt: skip
    return [emitted.token async for emitted in stream]


async def test_greedy_speculation_under_penalties_emits_the_one_token_output_at_a_tie() -> None:
    one_token = await _greedy(drafting=False)
    assert one_token[:3] == [PENALISED, PENALISED, TIED]  # the premise: the third token is the tie, to TIED
    assert await _greedy(drafting=True) == one_token
