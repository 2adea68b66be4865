"""Issue #12 items 2-4: what a connection may cost before and after its handshake.

Before the handshake only a Hello-sized frame is read, the handshake has a deadline, and the
server bounds connections in their handshake and per address; past it, idle connections close.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed
from websockets.frames import CloseCode

from splitspec.cloud.config import CloudConfig
from splitspec.cloud.server import TrunkServer
from splitspec.edge import EdgeConfig, SplitClient
from splitspec.exceptions import TransportError
from splitspec.protocol.messages import Error, decode_message
from tests.conftest import local_greedy
from tests.e2e.test_split_generate import PROMPT


async def _raw(server: TrunkServer) -> ClientConnection:
    return await connect(server.url, max_size=None, compression=None, ping_interval=None)


async def _closed_within(ws: ClientConnection, seconds: float) -> int | None:
    """Wait for the server to close ``ws``; return its close code (fails after ``seconds``)."""

    async def drain() -> None:
        while True:
            await ws.recv()

    with pytest.raises(ConnectionClosed):
        await asyncio.wait_for(drain(), seconds)
    return ws.close_code


async def _eventually(condition: Callable[[], bool], seconds: float = 5) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    return condition()


def _edge(model: Path, server: TrunkServer) -> EdgeConfig:
    return EdgeConfig(allow_stock_edge_weights=True, model_dir=model, cloud_url=server.url)


async def test_nothing_bigger_than_a_hello_is_read_before_the_handshake(make_checkpoint: Callable[..., Path]) -> None:
    model = make_checkpoint("llama")
    async with TrunkServer(CloudConfig(model_dir=model, port=0)) as server:
        ws = await _raw(server)
        await ws.send(b"\0" * (1 << 20))  # 1 MiB before any Hello: refused by the WebSocket layer
        assert await _closed_within(ws, 5) == CloseCode.MESSAGE_TOO_BIG
        async with SplitClient(_edge(model, server)) as client:  # past the handshake, big prefills pass
            prompt = (PROMPT * 200)[:1500]  # 1500 x 64 float32 = 384 KiB in one step
            client.reset()
            logits = await client.forward(prompt)
    assert logits.shape[0] == 1500


async def test_a_connection_that_never_handshakes_is_closed_at_the_deadline(
    make_checkpoint: Callable[..., Path],
) -> None:
    model = make_checkpoint("llama")
    async with TrunkServer(CloudConfig(model_dir=model, port=0, handshake_timeout_s=0.5)) as server:
        ws = await _raw(server)
        t0 = time.monotonic()
        assert await _closed_within(ws, 5) == CloseCode.POLICY_VIOLATION
        assert time.monotonic() - t0 < 3
        assert await _eventually(lambda: server._frames.unauthenticated == server._frames.connections == 0)


async def test_idle_connections_close_after_the_ttl_and_the_edge_recovers(
    make_checkpoint: Callable[..., Path],
) -> None:
    model = make_checkpoint("llama")
    async with TrunkServer(CloudConfig(model_dir=model, port=0, session_ttl_s=0.5, sweep_interval_s=0.1)) as server:
        async with SplitClient(_edge(model, server)) as client:
            first = await client.generate(PROMPT, 3)
            assert await _eventually(lambda: server._frames.connections == 0)  # the idle connection closed
            again = await client.generate(PROMPT, 3)  # reconnects and replays
    assert first.token_ids == again.token_ids == local_greedy(model, PROMPT, 3)
    assert again.recoveries >= 1


async def test_connections_in_their_handshake_are_bounded(make_checkpoint: Callable[..., Path]) -> None:
    model = make_checkpoint("llama")
    async with TrunkServer(CloudConfig(model_dir=model, port=0, max_unauthenticated=2)) as server:
        idle = [await _raw(server), await _raw(server)]
        extra = await _raw(server)
        assert await _closed_within(extra, 5) == CloseCode.TRY_AGAIN_LATER
        for ws in idle:
            await ws.close()
        async with SplitClient(_edge(model, server)) as client:  # slots freed: a client gets in
            result = await client.generate(PROMPT, 3)
    assert result.token_ids == local_greedy(model, PROMPT, 3)


async def test_connections_per_address_are_bounded(make_checkpoint: Callable[..., Path]) -> None:
    model = make_checkpoint("llama")
    async with TrunkServer(CloudConfig(model_dir=model, port=0, max_connections_per_address=2)) as server:
        async with SplitClient(_edge(model, server)), SplitClient(_edge(model, server)):
            with pytest.raises(TransportError):
                async with SplitClient(_edge(model, server)):
                    pass
        async with SplitClient(_edge(model, server)) as client:
            result = await client.generate(PROMPT, 3)
    assert result.token_ids == local_greedy(model, PROMPT, 3)


async def test_an_unauthenticated_server_warns_at_start(
    make_checkpoint: Callable[..., Path], caplog: pytest.LogCaptureFixture
) -> None:
    model = make_checkpoint("llama")
    with caplog.at_level(logging.WARNING):
        async with TrunkServer(CloudConfig(model_dir=model, port=0)):
            pass
        async with TrunkServer(CloudConfig(model_dir=model, port=0, auth_token="s")):
            pass
    warnings = [r.getMessage() for r in caplog.records if "NO authentication" in r.getMessage()]
    assert len(warnings) == 1
    assert "anyone" in warnings[0]


async def test_malformed_json_before_login_gets_a_typed_error_and_a_close(
    make_checkpoint: Callable[..., Path], caplog: pytest.LogCaptureFixture
) -> None:
    """Item 5: a 5,000-deep JSON header before the handshake was a server_error with a traceback,
    and the connection stayed open."""
    import struct

    from splitspec.protocol.frames import MAGIC, PROTOCOL_VERSION

    model = make_checkpoint("llama")
    header = b"[" * 5000 + b"]" * 5000
    frame = struct.pack(">4sHI", MAGIC, PROTOCOL_VERSION, len(header)) + header
    async with TrunkServer(CloudConfig(model_dir=model, port=0)) as server:
        ws = await _raw(server)
        with caplog.at_level(logging.INFO):
            await ws.send(frame)
            raw = await ws.recv()
            assert isinstance(raw, bytes)
            reply = decode_message(raw)
            assert await _closed_within(ws, 5) == CloseCode.POLICY_VIOLATION
    assert isinstance(reply, Error)
    assert (reply.code, reply.fatal) == ("malformed_frame", True)
    assert not [r for r in caplog.records if r.exc_info]  # no traceback logged


async def test_refusals_are_logged_at_a_bounded_rate(
    make_checkpoint: Callable[..., Path], caplog: pytest.LogCaptureFixture
) -> None:
    """Item 5: one connection's 200 bad frames cost a handful of log lines, not 200."""
    from splitspec.protocol.messages import Error as ErrorReply
    from tests.e2e.test_bad_input import raw_channel, step_frame

    model = make_checkpoint("llama")
    async with TrunkServer(CloudConfig(model_dir=model, port=0)) as server:
        async with SplitClient(_edge(model, server)) as client:
            channel, _ = await raw_channel(server, client.hello)
            with caplog.at_level(logging.INFO, logger="splitspec.cloud.server"):
                for _ in range(200):
                    await channel.send_raw(step_frame("no-such-session"))
                    assert isinstance(decode_message(await channel.recv_raw(5)), ErrorReply)
            await channel.close()
    refusals = [r for r in caplog.records if "refused" in r.getMessage()]
    assert 1 <= len(refusals) <= 20, len(refusals)
