"""An emptied trunk connection lingers for the next burst, then closes; the last one stays."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from splitspec.cloud.config import CloudConfig
from splitspec.cloud.server import TrunkServer
from splitspec.edge import EdgeConfig, SplitClient
from splitspec.edge.engine import EdgeEngine
from splitspec.edge.runtime import EdgeRuntime
from splitspec.exceptions import ConfigError


@contextlib.asynccontextmanager
async def _engine(model: Path, idle_connection_s: float) -> AsyncIterator[tuple[EdgeEngine, EdgeConfig]]:
    """An engine whose connections carry one session each, on a trunk server of its own."""
    async with TrunkServer(CloudConfig(model_dir=model, port=0)) as server:
        config = EdgeConfig(allow_stock_edge_weights=True, model_dir=model, cloud_url=server.url,
                            sessions_per_connection=1, idle_connection_s=idle_connection_s)  # fmt: skip
        engine = EdgeEngine(EdgeRuntime(config))
        try:
            yield engine, config
        finally:
            await engine.close()


async def _burst(engine: EdgeEngine, config: EdgeConfig, n: int) -> list[SplitClient]:
    clients = [SplitClient(config, engine=engine) for _ in range(n)]
    await asyncio.gather(*(c.connect() for c in clients))
    for client in clients:
        await client.generate([5, 6, 7], 2, speculate="off")
    return clients


async def test_an_emptied_connection_lingers_then_closes(make_checkpoint: Callable[..., Path]) -> None:
    """One session per connection: a burst of 3 opens 3 connections. Closed, they stay open for the
    linger (the next burst of 3 reuses them: no new handshake), then all but the last close."""
    async with _engine(make_checkpoint("llama"), idle_connection_s=0.5) as (engine, config):
        for client in await _burst(engine, config, 3):
            await client.close()
        first = {c.conn_id for c in engine.link.connections}
        assert len(first) == 3  # closed sessions, connections kept for the linger
        for client in await _burst(engine, config, 3):
            await client.close()
        assert {c.conn_id for c in engine.link.connections} == first  # the second burst opened none
        await asyncio.sleep(1.0)
        assert len(engine.link.connections) == 1  # past the linger: the last one stays


async def test_no_linger_closes_an_emptied_connection_at_once(make_checkpoint: Callable[..., Path]) -> None:
    async with _engine(make_checkpoint("llama"), idle_connection_s=0.0) as (engine, config):
        for client in await _burst(engine, config, 2):
            await client.close()
        assert len(engine.link.connections) == 1


def test_a_negative_linger_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="idle connection"):
        EdgeConfig(model_dir=tmp_path, cloud_url="ws://127.0.0.1:9", idle_connection_s=-1)
