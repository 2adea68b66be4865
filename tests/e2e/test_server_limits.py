"""Server limits and liveness: max sessions, and compute that never blocks the event loop."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from splitspec.cloud.config import CloudConfig
from splitspec.cloud.server import TrunkServer
from splitspec.edge import EdgeConfig, SplitClient
from splitspec.exceptions import TooManySessions
from splitspec.protocol.messages import Step, StepResult
from tests.conftest import local_greedy
from tests.e2e.test_bad_input import raw_channel
from tests.e2e.test_split_generate import PROMPT


async def test_max_sessions_is_enforced_and_freed(make_checkpoint: Callable[..., Path]) -> None:
    model = make_checkpoint("llama")
    async with TrunkServer(CloudConfig(model_dir=model, port=0, max_sessions=2)) as server:
        config = EdgeConfig(allow_stock_edge_weights=True, model_dir=model, cloud_url=server.url)
        async with SplitClient(config), SplitClient(config):
            with pytest.raises(TooManySessions):
                async with SplitClient(config):
                    pass
            assert len(server.sessions) == 2
        async with SplitClient(config) as client:  # closing the others freed their slots
            result = await client.generate(PROMPT, 4)
    assert result.token_ids == local_greedy(model, PROMPT, 4)


async def test_heavy_step_does_not_block_other_sessions(make_checkpoint: Callable[..., Path]) -> None:
    """While one session's long prefill computes, another session's short steps complete."""
    model = make_checkpoint("llama", hidden=256, max_positions=8192)
    q = 4000
    async with TrunkServer(CloudConfig(model_dir=model, port=0, max_query_tokens=q)) as server:
        config = EdgeConfig(allow_stock_edge_weights=True, model_dir=model, cloud_url=server.url)
        async with SplitClient(config) as light:
            channel, sid = await raw_channel(server, light.hello, 16 << 20)  # heavy session: raw frames
            heavy_step = Step(
                sid,
                1,
                torch.randn(1, q, 256),
                torch.arange(q, dtype=torch.int32),
                torch.arange(-1, q - 1, dtype=torch.int32),
            )
            light.reset()
            await light.forward(PROMPT)
            heavy = asyncio.create_task(channel.request(heavy_step, 120))
            while not server.sessions.busy():  # wait until the heavy step is computing
                await asyncio.sleep(0.002)
            for token in (3, 4, 5):
                await light.forward([token])
            reply, _ = await heavy
            await channel.close()
    assert isinstance(reply, StepResult)
    assert reply.hidden.shape == (1, q, 256)
    light_trips = [s.network_ms + s.cloud_ms for s in light.steps[-3:]]
    # each light round trip was short next to the heavy compute: it never waited behind it
    assert max(light_trips) < reply.cloud_ms / 2, (light_trips, reply.cloud_ms)
