"""Fixtures for the WAN emulator tests: a loopback echo server and timing helpers."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except OSError:
        pass
    finally:
        writer.close()


@pytest.fixture
async def echo_port() -> AsyncIterator[int]:
    """Port of an echo server on 127.0.0.1 (it half-closes after the client does)."""
    server = await asyncio.start_server(_echo, "127.0.0.1", 0)
    port = int(server.sockets[0].getsockname()[1])
    try:
        yield port
    finally:
        server.close()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(server.wait_closed(), 2.0)


async def _ping_ms(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> list[float]:
    """Round-trip times, in ms, of ``n`` 8-byte messages over an echo connection."""
    out: list[float] = []
    for i in range(n):
        msg = i.to_bytes(8, "big")
        t0 = time.perf_counter()
        writer.write(msg)
        await writer.drain()
        got = await asyncio.wait_for(reader.readexactly(8), 5.0)
        out.append((time.perf_counter() - t0) * 1000.0)
        if got != msg:
            raise AssertionError(f"echo mismatch: {got!r} != {msg!r}")
    return out


Pinger = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[list[float]]]


@pytest.fixture
def ping() -> Pinger:
    """``await ping(reader, writer, n)``: RTTs in ms of ``n`` echoed 8-byte messages."""
    return _ping_ms
