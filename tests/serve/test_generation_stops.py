"""How a generation's tokens become pieces of text (one SSE chunk each). A request's own stop token ends the reply
without its text (as vLLM, and as end-of-sequence tokens, whose text is special and skipped, always did); it is still
counted, with its logprob. A speculative step's tokens go out as one piece."""

from __future__ import annotations

import types
from collections.abc import AsyncIterator, Sequence
from typing import Any
from unittest.mock import MagicMock

from splitspec.decoding.loop import Emitted
from splitspec.decoding.sampling import SamplingParams
from splitspec.serve.engine import Generation, Piece
from splitspec.serve.pool import Lease

LETTERS = "abcdefghijklmnopqrstuvwxyz"
PERIOD = 26  # an ordinary token: "."


def decode(ids: Sequence[int], skip_special: bool = True) -> str:  # ServeState.decode's signature; no specials here
    return "".join("." if i == PERIOD else LETTERS[i] for i in ids)


class ScriptedClient:
    """Emits ``out`` whatever it is asked (the edge client's stream_tokens, as a Generation drives it), in steps of
    ``steps`` tokens (one each by default): every token of a step but its last is marked ``more``."""

    def __init__(self, out: list[int], steps: Sequence[int] = ()) -> None:
        self.out = out
        self.more = [i < n - 1 for n in steps for i in range(n)] or [False] * len(out)
        self.steps: list[Any] = []
        self.recoveries = 0
        self.runtime = types.SimpleNamespace(generator=lambda params: (None, 0))

    async def _tokens(self, n: int) -> AsyncIterator[Emitted]:
        for token, more in zip(self.out[:n], self.more, strict=False):
            yield Emitted(token, logprob=-0.5, more=more)

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


async def run(
    pool: OnePool, max_tokens: int, stops: Sequence[str] = (), stop_ids: frozenset[int] = frozenset()
) -> tuple[Generation, list[Piece]]:
    """A generation of ``max_tokens`` on ``pool``'s client, run to its end: it and its pieces."""
    state = types.SimpleNamespace(
        decode=decode, pool=pool, metrics=MagicMock(), config=types.SimpleNamespace(speculate="off")
    )

    async def connected() -> bool:
        return False

    generation = Generation(state, [5, 6], max_tokens, SamplingParams(), list(stops), stop_ids, connected)  # type: ignore[arg-type]
    await generation.start()
    return generation, [piece async for piece in generation.pieces()]


async def test_a_stop_token_ends_the_reply_without_its_text() -> None:
    pool = OnePool(ScriptedClient([0, 1, PERIOD, 2, 3]))  # "ab.cd"
    generation, pieces = await run(pool, 10, stop_ids=frozenset({PERIOD}))
    assert "".join(piece.text for piece in pieces) == "ab"  # was "ab."
    assert [e.token for piece in pieces for e in piece.tokens] == [0, 1, PERIOD]  # the stop token's logprob rides
    assert (generation.outcome.completion_tokens, generation.outcome.finish_reason) == (3, "stop")
    assert pool.released == [True]


async def test_a_steps_tokens_go_out_as_one_piece() -> None:
    pool = OnePool(ScriptedClient(list(range(9)), steps=[1, 3, 1, 4]))  # "a", "bcd", "e", "fghi"
    generation, pieces = await run(pool, 20)
    assert [piece.text for piece in pieces] == ["a", "bcd", "e", "fghi"]
    assert [[e.token for e in piece.tokens] for piece in pieces] == [[0], [1, 2, 3], [4], [5, 6, 7, 8]]
    assert generation.outcome.completion_tokens == 9


async def test_a_step_cut_by_the_limit_or_a_stop_ends_its_piece_there() -> None:
    _, pieces = await run(OnePool(ScriptedClient(list(range(9)), steps=[1, 3, 5])), 6)  # the limit inside a step
    assert [piece.text for piece in pieces] == ["a", "bcd", "ef"]
    pool = OnePool(ScriptedClient([0, 1, 2, PERIOD, 3, 4], steps=[1, 5]))
    generation, pieces = await run(pool, 20, stop_ids=frozenset({PERIOD}))
    assert [piece.text for piece in pieces] == ["a", "bc"]  # the stop token ends the step's piece, without its text
    assert [e.token for e in pieces[-1].tokens] == [1, 2, PERIOD]
    assert (generation.outcome.completion_tokens, generation.outcome.finish_reason) == (4, "stop")
    generation, pieces = await run(OnePool(ScriptedClient(list(range(8)), steps=[2, 6])), 20, stops=["de"])
    assert [piece.text for piece in pieces] == ["a", "bc"]  # a stop string inside a step (its scanner holds "b")
    assert generation.outcome.finish_reason == "stop"
