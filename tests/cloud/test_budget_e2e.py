"""The trunk's KV budget and session caps on a real server over loopback (#15 item 2)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from splitspec.cloud.config import CloudConfig
from splitspec.cloud.server import TrunkServer
from splitspec.edge import EdgeConfig, SplitClient
from splitspec.exceptions import PositionOutOfRange, SessionQuotaExceeded, UnknownSession
from splitspec.protocol.messages import CloseSession, OpenSession, SessionClosed, SessionOpened, Step, StepResult
from tests.conftest import local_greedy
from tests.e2e.test_bad_input import raw_channel
from tests.e2e.test_split_generate import PROMPT

OTHER_PROMPT = [4, 8, 15, 16, 23, 42, 7]
BLOCK = 64  # KV block, entries: every cache of this test holds exactly one
SLAB_KIB = BLOCK * 2 * 2 * 2 * 16 * 4 / 1024  # one block x 2 layers x 2 kv heads x 16 x fp32


async def test_eviction_and_capacity_backoff_keep_every_output_identical(
    make_checkpoint: Callable[..., Path],
) -> None:
    """Budget for 1.5 sessions: B waits out `capacity` while A is active, then evicts it; A replays,
    waits for B to go idle and evicts it in turn; both outputs equal transformers' own."""
    model = make_checkpoint("llama")
    budget_mb = 1.5 * SLAB_KIB / 1024
    config = CloudConfig(model_dir=model, port=0, kv_budget_mb=budget_mb, evict_idle_s=0.3, kv_block_tokens=BLOCK)
    async with TrunkServer(config) as server:
        session_bytes = server.budget.bytes_at(BLOCK)
        assert session_bytes == SLAB_KIB * 1024
        edge = EdgeConfig(allow_stock_edge_weights=True, model_dir=model, cloud_url=server.url)
        async with SplitClient(edge) as a, SplitClient(edge) as b:
            stream = a.stream(PROMPT, 10)
            first = [await anext(stream) for _ in range(3)]
            assert server.sessions.kv_bytes() == session_bytes  # the accounted size is the real one (B holds none)
            b_result = await b.generate(OTHER_PROMPT, 6)  # refused while A is fresh, then evicts A
            a_rest = [token async for token in stream]  # A replays; B must go idle before it is evicted
            assert server.sessions.evictions == 2
    assert b.capacity_waits >= 1
    assert a.capacity_waits >= 1
    assert (a.recoveries, b.recoveries) == (1, 0)
    assert b_result.token_ids == local_greedy(model, OTHER_PROMPT, 6)
    assert first + a_rest == local_greedy(model, PROMPT, 10)


async def test_a_wide_step_beyond_the_models_positions_is_refused(make_checkpoint: Callable[..., Path]) -> None:
    model = make_checkpoint("llama", max_positions=64)
    async with TrunkServer(CloudConfig(model_dir=model, port=0)) as server:
        async with SplitClient(EdgeConfig(allow_stock_edge_weights=True, model_dir=model, cloud_url=server.url)) as e:
            channel, sid = await raw_channel(server, e.hello)
        q = 40  # every token a child of the committed prefix: positions stay at the cache length

        def wide(seq: int, length: int) -> Step:
            at = torch.full((q,), length, dtype=torch.int32)
            return Step(sid, seq, torch.randn(1, q, 64), at, torch.full((q,), -1, dtype=torch.int32))

        reply, _ = await channel.request(wide(1, 0), 5)
        assert isinstance(reply, StepResult)
        with pytest.raises(PositionOutOfRange, match="beyond the model's 64 positions"):
            await channel.request(wide(2, q), 5)  # 80 entries: positions 40 are fine, the cache is not
        await channel.close()


async def test_a_connection_over_its_session_cap_is_refused_while_others_are_served(
    make_checkpoint: Callable[..., Path],
) -> None:
    model = make_checkpoint("llama")
    async with TrunkServer(CloudConfig(model_dir=model, port=0, max_sessions_per_address=6)) as server:
        edge = EdgeConfig(allow_stock_edge_weights=True, model_dir=model, cloud_url=server.url)
        async with SplitClient(edge) as other:
            greedy = await anext(other.stream(PROMPT, 1))
            hog, _ = await raw_channel(server, other.hello)  # one session
            for request_id in range(2, 5):
                opened, _ = await hog.request(OpenSession(request_id=request_id), 5)
                assert isinstance(opened, SessionOpened)
            with pytest.raises(SessionQuotaExceeded, match="connection"):  # the default cap: 4
                await hog.request(OpenSession(request_id=9), 5)
            second, _ = await raw_channel(server, other.hello)  # the address's sixth session
            with pytest.raises(SessionQuotaExceeded, match="address"):
                await second.request(OpenSession(request_id=9), 5)
            result = await other.generate(PROMPT, 4)  # the well-behaved connection is served throughout
            await asyncio.gather(hog.close(), second.close())
    assert result.token_ids[0] == greedy
    assert result.token_ids == local_greedy(model, PROMPT, 4)


async def test_closing_a_session_stops_its_step_in_flight(make_checkpoint: Callable[..., Path]) -> None:
    """The edge closes a session it gave up (a step that timed out, a failed tail) while the trunk may still be
    prefilling it: the step's remaining chunks are not computed, its reservation is released, and its reply is
    a typed unknown_session refusal (which the edge drops as late)."""
    model = make_checkpoint("llama")
    async with TrunkServer(CloudConfig(model_dir=model, port=0, prefill_chunk_tokens=16)) as server:
        batcher = server.batcher
        assert batcher is not None
        run_rows = batcher.run_rows
        forwards: list[int] = []

        def counted(rows: list[Any]) -> list[torch.Tensor]:
            forwards.append(len(rows))
            return run_rows(rows)

        batcher.run_rows = counted  # type: ignore[method-assign]
        async with SplitClient(EdgeConfig(allow_stock_edge_weights=True, model_dir=model, cloud_url=server.url)) as e:
            channel, sid = await raw_channel(server, e.hello)
        channel.multiplex()
        q = 512  # 32 chunks of 16
        prefill = Step(sid, 1, torch.randn(1, q, 64), torch.arange(q, dtype=torch.int32), torch.arange(-1, q - 1).int())
        step = asyncio.ensure_future(channel.request(prefill, 30))
        while not forwards:
            await asyncio.sleep(0.001)
        closed, _ = await channel.request(CloseSession(sid), 5)
        ran = len(forwards)
        with pytest.raises(UnknownSession, match="closed while its step ran"):
            await step
        await channel.close()
        assert not batcher._pending
    assert isinstance(closed, SessionClosed)
    assert len(forwards) <= ran + 1 < 32  # all 32 chunks ran before
    assert not server.sessions._reserved
