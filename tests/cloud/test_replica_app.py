"""The Ray Serve replica's ASGI app without Ray (#15 item 4): what each replica runs behind Ray's proxy,
served here by uvicorn on loopback, so CI covers it where Ray is not installed.

A split generation through it equals transformers' greedy output, the upgrade answer names the
replica, ``/health`` and ``/metrics`` answer; the plain server's connection limits hold through
the Starlette socket adapter (a frame above a Hello's size before the handshake closes the
connection with 1009, a silent connection is closed at its handshake deadline with 1008). The
replica kill through Ray's proxy is tests/cloud/test_ray_serve.py.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import uvicorn
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from splitspec.cloud.config import CloudConfig
from splitspec.cloud.ray_serve import REPLICA_HEADER, TrunkReplica, trunk_asgi_app
from splitspec.demo import free_port
from splitspec.edge import EdgeConfig, SplitClient
from tests.conftest import local_greedy

NAME = "replica-under-test"


@pytest.fixture
async def replica_url(make_checkpoint: Callable[..., Path]) -> AsyncIterator[tuple[Path, str]]:
    """A replica of the tiny Llama served by uvicorn; yields (checkpoint, URL)."""
    model = make_checkpoint("llama")
    replica = TrunkReplica(CloudConfig(model_dir=model, handshake_timeout_s=1.0, torch_threads=1), name=NAME)
    port = free_port()
    config = uvicorn.Config(trunk_asgi_app(lambda: replica), host="127.0.0.1", port=port, lifespan="off")
    server = uvicorn.Server(config)
    serving = asyncio.create_task(server.serve())
    while not server.started:
        assert not serving.done(), "uvicorn did not start"
        await asyncio.sleep(0.02)
    try:
        yield model, f"ws://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await serving
        await replica.stop()


async def test_a_generation_through_the_replica_app(replica_url: tuple[Path, str]) -> None:
    model, url = replica_url
    prompt = [5, 9, 17, 3, 44, 2, 8, 5, 9, 17]
    edge = EdgeConfig(allow_stock_edge_weights=True, model_dir=model, cloud_url=url)
    async with SplitClient(edge) as client:
        assert client.server_headers[REPLICA_HEADER] == NAME
        result = await client.generate(prompt, 12, speculate="ngram")
    assert result.token_ids == local_greedy(model, prompt, 12)
    http = url.replace("ws://", "http://")
    health = await asyncio.to_thread(urllib.request.urlopen, f"{http}/health")
    assert health.headers[REPLICA_HEADER] == NAME
    assert json.loads(health.read())["status"] == "ok"
    metrics = await asyncio.to_thread(urllib.request.urlopen, f"{http}/metrics")
    steps = [line for line in metrics.read().decode().splitlines() if line.startswith("splitspec_trunk_steps_total")]
    assert sum(float(line.split()[-1]) for line in steps) >= 2  # the prefill and the decode steps were counted
    assert all(f'replica="{NAME}"' in line for line in steps)  # a scrape through the proxy says which replica


async def test_the_plain_servers_connection_limits_hold(replica_url: tuple[Path, str]) -> None:
    _, url = replica_url
    async with connect(url, max_size=None) as ws:  # a frame far above a Hello's size, before any handshake
        await ws.send(bytes(200_000))
        with pytest.raises(ConnectionClosed) as closed:
            await ws.recv()
    assert closed.value.rcvd is not None
    assert closed.value.rcvd.code == 1009
    async with connect(url) as ws:  # silent: closed at the handshake deadline (1 s)
        with pytest.raises(ConnectionClosed) as closed:
            await asyncio.wait_for(ws.recv(), 10)
    assert closed.value.rcvd is not None
    assert closed.value.rcvd.code == 1008
