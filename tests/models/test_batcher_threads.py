"""Where a batcher's forwards run: on its worker thread, or on the event loop (``threaded=False``, a CPU's default:
see :func:`splitspec.devices.compute_on_threads`). Either way each step gets what it computes alone."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from splitspec.cloud.batcher import StepBatcher
from splitspec.cloud.metrics import TrunkMetrics
from splitspec.cloud.sessions import SessionStore
from splitspec.models.batched import BatchRow
from splitspec.models.checkpoint import Checkpoint
from splitspec.models.kv_cache import KVCache
from splitspec.models.loading import load_trunk
from splitspec.models.split import SplitPlan
from splitspec.models.stack import LayerStack


class _Where(StepBatcher):
    """A batcher that notes the thread each forward ran on."""

    def __init__(self, stack: LayerStack, threaded: bool) -> None:
        super().__init__(stack, TrunkMetrics(SessionStore(8, 300.0)), threaded=threaded)
        self.threads: list[int] = []

    def run_rows(self, rows: list[BatchRow]) -> list[torch.Tensor]:
        self.threads.append(threading.get_ident())
        return super().run_rows(rows)


@pytest.fixture(scope="module")
def trunk(make_checkpoint: Callable[..., Path]) -> LayerStack:
    ckpt = Checkpoint(make_checkpoint("llama"))
    return load_trunk(ckpt, SplitPlan(ckpt.config.num_hidden_layers, 2, 2), torch.float32)


@pytest.mark.parametrize("threaded", [True, False])
async def test_the_forwards_run_on_the_worker_thread_or_the_event_loop(trunk: LayerStack, threaded: bool) -> None:
    batcher = _Where(trunk, threaded)
    batcher.start()
    torch.manual_seed(0)
    prompts = [torch.randn(1, n, 64) for n in (5, 3, 7)]
    steps = [torch.randn(1, 2, 64) for _ in prompts]
    caches = [KVCache() for _ in prompts]

    async def session(prompt: torch.Tensor, step: torch.Tensor, cache: KVCache) -> torch.Tensor:
        await batcher.submit(prompt, _positions(0, prompt.shape[1]), _chain(prompt.shape[1]), cache)
        out, _, _ = await batcher.submit(step, _positions(prompt.shape[1], 2), _chain(2), cache)
        return out

    try:
        outs = await asyncio.gather(*(session(p, s, c) for p, s, c in zip(prompts, steps, caches, strict=True)))
    finally:
        await batcher.stop()
    loop_thread = threading.get_ident()
    assert batcher.threads
    assert all((thread != loop_thread) == threaded for thread in batcher.threads)
    with torch.inference_mode():
        for prompt, step, out in zip(prompts, steps, outs, strict=True):  # each session's step run alone
            alone = KVCache()
            trunk(prompt, _positions(0, prompt.shape[1]), _chain(prompt.shape[1]), alone)
            expected = trunk(step, _positions(prompt.shape[1], 2), _chain(2), alone)
            torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("threaded", [True, False])
async def test_a_step_submitted_to_a_batcher_not_running_is_refused_at_once(trunk: LayerStack, threaded: bool) -> None:
    batcher = _Where(trunk, threaded)
    step = (torch.randn(1, 1, 64), _positions(0, 1), _chain(1), KVCache())
    with pytest.raises(RuntimeError, match="not running"):  # never started
        await asyncio.wait_for(batcher.submit(*step), 1)
    batcher.start()
    await batcher.stop()
    with pytest.raises(RuntimeError, match="not running"):  # stopped: refused, not left to wait forever
        await asyncio.wait_for(batcher.submit(*step), 1)
    assert not batcher.threads


def _positions(start: int, count: int) -> torch.Tensor:
    return torch.arange(start, start + count, dtype=torch.int32)


def _chain(count: int) -> torch.Tensor:
    return torch.arange(-1, count - 1, dtype=torch.int32)
