"""A concurrent connection with a frame in flight is not idle (``ConnectionLimits.idle_timeout_s``).

The trunk passes its session time-to-live as the idle timeout. The timer used to count only frames
received, so a step computing (or queued) longer than that had its connection closed (1008) mid-step
and was cancelled; it now runs from the last reply sent once no frame is in flight.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from splitspec.transport.server import ConnectionLimits, FrameServer

IDLE_S = 0.4


class _SlowPeer:
    """Past its handshake from the start; answers each frame after ``compute_s``, concurrently."""

    concurrent = True
    ready = True

    def __init__(self, compute_s: float) -> None:
        self.compute_s = compute_s

    async def handle(self, data: bytes) -> tuple[bytes, bool]:
        await asyncio.sleep(self.compute_s)  # a step computing, or waiting for its batch
        return b"reply to " + data, False

    async def closed(self) -> None:
        pass


async def _server(compute_s: float) -> FrameServer:
    server = FrameServer(
        lambda remote: _SlowPeer(compute_s), "127.0.0.1", 0, 1 << 20, limits=ConnectionLimits(idle_timeout_s=IDLE_S)
    )
    await server.start()
    return server


async def test_a_frame_served_longer_than_the_idle_timeout_gets_its_reply() -> None:
    server = await _server(compute_s=3 * IDLE_S)
    try:
        async with connect(f"ws://127.0.0.1:{server.port}") as ws:
            await ws.send(b"step")
            # was: the connection closed (1008, "idle within the deadline") before the reply
            assert await asyncio.wait_for(ws.recv(), 5.0) == b"reply to step"
    finally:
        await server.stop()


async def test_the_idle_timer_runs_from_the_last_reply() -> None:
    """Once nothing is in flight, a silent connection is still closed: an idle timeout after the last reply."""
    server = await _server(compute_s=2 * IDLE_S)
    try:
        async with connect(f"ws://127.0.0.1:{server.port}") as ws:
            await ws.send(b"one")
            await asyncio.sleep(IDLE_S / 2)
            await ws.send(b"two")  # two in flight; the first reply does not start the timer, the last does
            assert await asyncio.wait_for(ws.recv(), 5.0) == b"reply to one"
            assert await asyncio.wait_for(ws.recv(), 5.0) == b"reply to two"
            replied = time.monotonic()
            with pytest.raises(ConnectionClosed) as closed:
                await asyncio.wait_for(ws.recv(), 5.0)
            waited = time.monotonic() - replied
            assert closed.value.rcvd is not None
            assert closed.value.rcvd.reason == "idle within the deadline"
            assert IDLE_S * 0.8 <= waited < IDLE_S + 1.0
    finally:
        await server.stop()
