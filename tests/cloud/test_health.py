"""The trunk's /health and the Ray replica's health check once compute has died."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path

import pytest

from splitspec.cloud.config import CloudConfig
from splitspec.cloud.ray_serve import TrunkReplica


async def test_health_fails_once_the_batching_loop_has_stopped(make_checkpoint: Callable[..., Path]) -> None:
    """/health used to answer 200 after the batching loop died, while every step failed "the batcher is not
    running"; the Ray replica had no check_health, so Serve kept routing to it."""
    replica = TrunkReplica(CloudConfig(model_dir=make_checkpoint("llama"), torch_threads=1), name="r")
    server = replica.server
    assert server.metrics.health()[0] == 200  # not started yet (a replica before its first connection)
    replica.check_health()
    replica._start_compute()
    try:
        assert server.metrics.health()[0] == 200
        replica.check_health()
        assert server.batcher is not None
        task = server.batcher._task
        assert task is not None
        task.cancel()  # the loop ends as a crash would end it: the batcher still counts as started
        with pytest.raises(asyncio.CancelledError):
            await task
        status, content_type, body = server.metrics.health()
        assert status == 503
        assert content_type == "application/json"
        assert json.loads(body)["status"] == "failing"
        assert "batching loop" in json.loads(body)["error"]
        with pytest.raises(RuntimeError, match="batching loop stopped"):
            replica.check_health()
    finally:
        await replica.stop()
    assert server.metrics.health()[0] == 200  # stopped on purpose: not a failure


async def test_health_fails_once_the_ttl_sweep_has_stopped(make_checkpoint: Callable[..., Path]) -> None:
    replica = TrunkReplica(CloudConfig(model_dir=make_checkpoint("llama"), torch_threads=1, batching=False), name="r")
    replica._start_compute()
    try:
        sweeper = replica.server._sweeper
        assert sweeper is not None
        sweeper.cancel()
        with pytest.raises(asyncio.CancelledError):
            await sweeper
        assert replica.server.metrics.health()[0] == 503
        with pytest.raises(RuntimeError, match="sweep"):
            replica.check_health()
    finally:
        await replica.stop()
