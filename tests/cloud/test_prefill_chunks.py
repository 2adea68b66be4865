"""A big prefill never runs two chunks back to back while decode steps wait, and its chunks are
sized from measured costs so an iteration stays near a decode batch's time (#15)."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from splitspec.cloud.batcher import StepBatcher
from splitspec.cloud.metrics import TrunkMetrics
from splitspec.cloud.sessions import SessionStore
from splitspec.models.checkpoint import Checkpoint
from splitspec.models.kv_cache import KVCache
from splitspec.models.loading import load_trunk
from splitspec.models.prefill_chunks import DECODE_LIVE_S, ChunkSizer
from splitspec.models.split import SplitPlan
from splitspec.models.stack import LayerStack


def test_chunk_size_follows_the_decode_batch_time() -> None:
    sizer = ChunkSizer(max_tokens=256, min_tokens=16)
    assert sizer.next_chunk(now=0.0) == 256  # nobody decoding: the whole maximum
    sizer.observe_decode(ms=20.0, now=10.0)
    assert sizer.next_chunk(now=10.1) == 16  # decoding, a chunk's cost still unknown: the minimum
    sizer.observe_chunk(tokens=16, ms=8.0)  # 0.5 ms per token
    assert sizer.next_chunk(now=10.1) == 40  # 20 ms of decode batch / 0.5 ms per token
    sizer.observe_chunk(tokens=40, ms=200.0)  # chunks got dear: the running mean shrinks the next one
    assert sizer.next_chunk(now=10.2) == 16
    assert sizer.next_chunk(now=10.0 + DECODE_LIVE_S + 0.1) == 256  # decode traffic stopped
    with pytest.raises(ValueError, match="at least 1 token"):
        ChunkSizer(max_tokens=0)


class _Recorder(TrunkMetrics):
    """Metrics that also keep each forward's (steps, tokens) in order."""

    def __init__(self) -> None:
        super().__init__(SessionStore(8, 300.0))
        self.forwards: list[tuple[int, int]] = []

    def observe_batch(self, steps: int, tokens: int, compute_ms: float) -> None:
        super().observe_batch(steps, tokens, compute_ms)
        self.forwards.append((steps, tokens))


class _ChunkFlags(StepBatcher):
    """A batcher that notes, forward by forward, whether it ran a chunk of a big step (a last chunk
    of one token looks like a decode step in the metrics)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.chunk_flags: list[bool] = []

    def _forward(self, group: list[Any], chunk: int | None) -> None:
        super()._forward(group, chunk)
        self.chunk_flags.append(chunk is not None)


async def _decode_step(batcher: StepBatcher, cache: KVCache) -> float:
    """One decode step of a random hidden state on ``cache`` through ``batcher`` -> its queue wait, ms."""
    at = torch.tensor([len(cache)], dtype=torch.int32)
    _, _, queue_ms = await batcher.submit(torch.randn(1, 1, 64), at, torch.tensor([-1], dtype=torch.int32), cache)
    return queue_ms


@pytest.fixture(scope="module")
def trunk(make_checkpoint: Callable[..., Path]) -> LayerStack:
    ckpt = Checkpoint(make_checkpoint("llama"))
    return load_trunk(ckpt, SplitPlan(ckpt.config.num_hidden_layers, 2, 2), torch.float32)


@pytest.mark.parametrize("threaded", [True, False])  # forwards on a worker thread, or on the event loop
async def test_decode_steps_run_between_every_two_prefill_chunks(trunk: LayerStack, threaded: bool) -> None:
    metrics = _Recorder()
    batcher = _ChunkFlags(trunk, metrics, prefill_chunk_tokens=24, threaded=threaded)
    batcher.start()
    prefill_done = asyncio.Event()

    async def decode(cache: KVCache) -> None:
        while not prefill_done.is_set():
            at = torch.tensor([len(cache)], dtype=torch.int32)
            await batcher.submit(torch.randn(1, 1, 64), at, torch.tensor([-1], dtype=torch.int32), cache)

    decoders = [asyncio.create_task(decode(KVCache())) for _ in range(3)]
    await asyncio.sleep(0.05)  # the decode sessions are in their loop
    prompt = 100
    chain = torch.arange(-1, prompt - 1, dtype=torch.int32)
    positions = torch.arange(prompt, dtype=torch.int32)
    out, _, _ = await batcher.submit(torch.randn(1, prompt, 64), positions, chain, KVCache())
    prefill_done.set()
    await asyncio.gather(*decoders)
    await batcher.stop()
    assert out.shape == (1, prompt, 64)
    assert len(batcher.chunk_flags) == len(metrics.forwards)
    chunks = [i for i, is_chunk in enumerate(batcher.chunk_flags) if is_chunk]
    assert sum(metrics.forwards[i][1] for i in chunks) == prompt
    assert len(chunks) >= prompt // 24 + 1  # cut into chunks of at most --prefill-chunk
    assert all(metrics.forwards[i][1] <= 24 for i in chunks)
    for a, b in itertools.pairwise(chunks):
        assert (3, 3) in metrics.forwards[a + 1 : b], f"chunks {a} and {b} ran with no decode batch between them"


@pytest.mark.parametrize("gather", [0.0, 50.0])
async def test_a_free_worker_gathers_the_active_sessions_steps(trunk: LayerStack, gather: float) -> None:
    metrics = _Recorder()
    batcher = StepBatcher(trunk, metrics, gather=gather)
    batcher.start()
    caches = [KVCache(), KVCache()]

    async def step(cache: KVCache) -> float:
        return await _decode_step(batcher, cache)

    await asyncio.gather(*(step(c) for c in caches))  # both sessions active, a decode batch's time measured
    assert batcher.chunks.decode_ms is not None
    window_ms = gather * batcher.chunks.decode_ms
    metrics.forwards.clear()
    first = asyncio.create_task(step(caches[0]))
    await asyncio.sleep(0.005)  # the second session's step comes 5 ms later
    await asyncio.gather(first, step(caches[1]))
    lone = KVCache()  # a third session, alone among the active ones once the others fall silent
    batcher._delivered.clear()  # (as if a second had passed since the others' last steps)
    await step(lone)
    lone_wait = await step(lone)
    await batcher.stop()
    if gather:
        assert window_ms > 5
        assert metrics.forwards[:1] == [(2, 2)]  # the first waited for the second: one batch of both
    else:
        assert metrics.forwards[:2] == [(1, 1), (1, 1)]  # started at once: a batch each
    assert lone_wait < 5  # a lone session never waits for anyone
    with pytest.raises(ValueError, match="non-negative fraction"):
        StepBatcher(trunk, metrics, gather=-1)


@pytest.mark.parametrize("away_s", [0.02, 1.5])
async def test_a_free_worker_waits_only_for_sessions_due_within_its_window(trunk: LayerStack, away_s: float) -> None:
    """Each session's next step is due one away time (delivery -> its next step, as last measured) after its
    last delivery. A session due within the window is waited for; one not due until after it is not."""
    metrics = _Recorder()
    batcher = StepBatcher(trunk, metrics, gather=1.0)
    batcher.start()
    caches = [KVCache(), KVCache()]

    async def step(cache: KVCache) -> float:
        return await _decode_step(batcher, cache)

    async def away_then_step(cache: KVCache) -> float:
        await asyncio.sleep(away_s)
        return await step(cache)

    await asyncio.gather(*(step(c) for c in caches))  # a decode batch's time measured
    assert batcher.chunks.decode_ms is not None
    # a 500 ms window: a wait for it stands out of a step slowed by a busy machine (CI runs tests side by side)
    batcher.gather = 0.5 / (batcher.chunks.decode_ms / 1e3)
    await asyncio.gather(step(caches[0]), away_then_step(caches[1]))  # the second's away time measured
    # the window set again from the mean those steps left: a slow step on a busy machine would otherwise have
    # stretched it past the 1.5 s away time (the first session then waited, rightly, for the second)
    batcher.gather = 0.5 / (batcher.chunks.decode_ms / 1e3)
    metrics.forwards.clear()
    first, second = await asyncio.gather(step(caches[0]), away_then_step(caches[1]))
    await batcher.stop()
    if away_s < 0.5:  # due within the window: one batch of both, the first waited about the away time
        assert metrics.forwards[:1] == [(2, 2)]
        assert first >= 10
    else:  # due only after the window: not waited for
        assert metrics.forwards[:2] == [(1, 1), (1, 1)]
        assert first < 250
    assert second < 250


async def test_a_prefill_with_nobody_else_active_runs_whole_chunks_without_waiting(trunk: LayerStack) -> None:
    """Decode traffic just ended (within DECODE_LIVE_S), but its sessions are gone: a new prefill runs in
    chunks of the maximum, not the small ones that bound a decode step's wait, and waits for nobody."""
    metrics = _Recorder()
    batcher = _ChunkFlags(trunk, metrics, prefill_chunk_tokens=64, gather=1000.0)  # a window longer than the test
    batcher.start()
    decoder = KVCache()
    for _ in range(3):  # a decode batch's time is measured, and decode traffic counts as live for a second
        await _decode_step(batcher, decoder)
    batcher._delivered.clear()  # the decoding session closed (its cache freed)
    metrics.forwards.clear()
    batcher.chunk_flags.clear()
    prompt = 150
    chain = torch.arange(-1, prompt - 1, dtype=torch.int32)
    async with asyncio.timeout(5):  # a 1,000-decode-batch gathering window per chunk would not fit
        out, _, _ = await batcher.submit(torch.randn(1, prompt, 64), torch.arange(prompt, dtype=torch.int32), chain,
                                         KVCache())  # fmt: skip
    await batcher.stop()
    assert out.shape == (1, prompt, 64)
    assert batcher.chunk_flags == [True, True, True]
    assert [tokens for _, tokens in metrics.forwards] == [64, 64, 22]  # the maximum, with decoding over


class _CacheLog(StepBatcher):
    """A batcher that notes which caches each forward ran rows for."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.forwards: list[set[int]] = []

    def run_rows(self, rows: list[Any]) -> list[torch.Tensor]:
        self.forwards.append({id(row.cache) for row in rows})
        return super().run_rows(rows)


@pytest.mark.parametrize("threaded", [True, False])
async def test_a_cancelled_prefill_takes_no_more_chunks(trunk: LayerStack, threaded: bool) -> None:
    """A client that goes away during a long prefill (its step's submit cancelled) frees the worker at once: the
    step's remaining chunks are not computed, and it takes no place in a batch."""
    batcher = _CacheLog(trunk, _Recorder(), prefill_chunk_tokens=16, threaded=threaded)
    batcher.start()
    prompt, gone = 400, KVCache()
    hidden, positions = torch.randn(1, prompt, 64), torch.arange(prompt, dtype=torch.int32)
    prefill = asyncio.create_task(batcher.submit(hidden, positions, torch.arange(-1, prompt - 1).int(), gone))
    while not batcher.forwards:
        await asyncio.sleep(0.001)
    prefill.cancel()
    ran_before = len(batcher.forwards)  # chunks computed or under way when the client went away
    with pytest.raises(asyncio.CancelledError):
        await prefill
    async with asyncio.timeout(10):
        while batcher._pending:  # the step leaves the queue (it used to stay until all its chunks had run)
            await asyncio.sleep(0.001)
    await _decode_step(batcher, KVCache())  # the worker carries on with the others
    await batcher.stop()
    ran = sum(id(gone) in caches for caches in batcher.forwards)
    assert ran <= ran_before + 1 < 25  # at most one more (planned before the cancellation was seen), of 25 chunks
