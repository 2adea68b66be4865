"""A request's own stop token ends the reply without its text (as vLLM, and as end-of-sequence tokens, whose text
is special and skipped, always did); it is still counted, with its logprob."""

from __future__ import annotations

import types
from collections.abc import AsyncIterator, Sequence
from typing import Any
from unittest.mock import MagicMock

from splitspec.decoding.loop import Emitted
from splitspec.decoding.sampling import SamplingParams
from splitspec.serve.engine import Generation
from splitspec.serve.pool import Lease

LETTERS = "abcdefghijklmnopqrstuvwxyz"
PERIOD = 26  # an ordinary token: "."


def decode(ids: Sequence[int]) -> str:
    return "".join("." if i == PERIOD else LETTERS[i] for i in ids)


class ScriptedClient:
    """Emits ``out`` whatever it is asked (the edge client's stream_tokens, as a Generation drives it)."""

    def __init__(self, out: list[int]) -> None:
        self.out = out
        self.steps: list[Any] = []
        self.recoveries = 0
        self.runtime = types.SimpleNamespace(generator=lambda params: (None, 0))

    async def _tokens(self, n: int) -> AsyncIterator[Emitted]:
        for token in self.out[:n]:
            yield Emitted(token, logprob=-0.5)

    def stream_tokens(self, ids: list[int], n: int, params: SamplingParams, **kw: Any) -> AsyncIterator[Emitted]:
        return self._tokens(n)


class OnePool:
    def __init__(self, client: ScriptedClient) -> None:
        self.client = client
        self.active = 0
        self.cache: list[Any] = []
        self.released: list[bool] = []

    async def acquire(self, prompt: list[int], reuse: bool = True) -> Lease:
        return Lease(self.client, 0)  # type: ignore[arg-type]

    def release(self, lease: Lease, healthy: bool) -> None:
        self.released.append(healthy)


async def test_a_stop_token_ends_the_reply_without_its_text() -> None:
    pool = OnePool(ScriptedClient([0, 1, PERIOD, 2, 3]))  # "ab.cd"
    state = types.SimpleNamespace(
        decode=decode, pool=pool, metrics=MagicMock(), config=types.SimpleNamespace(speculate="off")
    )

    async def connected() -> bool:
        return False

    generation = Generation(state, [5, 6], 10, SamplingParams(), [], frozenset({PERIOD}), connected)  # type: ignore[arg-type]
    await generation.start()
    pieces = [piece async for piece in generation.pieces()]
    assert "".join(piece.text for piece in pieces) == "ab"  # was "ab."
    assert [e.token for piece in pieces for e in piece.tokens] == [0, 1, PERIOD]  # the stop token's logprob rides
    assert (generation.outcome.completion_tokens, generation.outcome.finish_reason) == (3, "stop")
    assert pool.released == [True]
