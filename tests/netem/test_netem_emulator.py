"""The WAN emulator over real loopback sockets: delay, ordering under jitter, bandwidth,
concurrency, shutdown. Timing checks use minima over several round trips and generous upper
bounds so a loaded 2-core machine does not make them flaky."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import socketserver
import struct
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

from splitspec.netem.emulator import ThreadedWanEmulator, WanEmulator
from splitspec.netem.schedule import NetemConfig

if TYPE_CHECKING:
    from tests.netem.conftest import Pinger


async def _connect(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 5.0)


async def _close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(OSError, TimeoutError):
        await asyncio.wait_for(writer.wait_closed(), 2.0)


@pytest.mark.parametrize("rtt_ms", [10.0, 40.0])
async def test_adds_configured_rtt(echo_port: int, ping: Pinger, rtt_ms: float) -> None:
    r, w = await _connect(echo_port)
    direct = min(await ping(r, w, 10))
    await _close(w)
    async with WanEmulator(NetemConfig(upstream_port=echo_port, rtt_ms=rtt_ms)) as emu:
        assert emu.port > 0
        r, w = await _connect(emu.port)
        samples = await ping(r, w, 10)
        await _close(w)
    added = min(samples) - direct
    assert rtt_ms - 2.0 <= added <= rtt_ms + 25.0, (added, samples)


async def test_zero_rtt_is_nearly_transparent(echo_port: int, ping: Pinger) -> None:
    async with WanEmulator(NetemConfig(upstream_port=echo_port)) as emu:
        r, w = await _connect(emu.port)
        samples = await ping(r, w, 10)
        await _close(w)
    assert min(samples) < 10.0


@pytest.mark.parametrize("distribution", ["uniform", "normal"])
async def test_byte_order_preserved_under_heavy_jitter(echo_port: int, distribution: str) -> None:
    cfg = NetemConfig(
        upstream_port=echo_port,
        rtt_ms=4.0,
        jitter_ms=20.0,
        jitter_distribution=distribution,  # type: ignore[arg-type]
        seed=5,
    )
    sent = bytearray()
    async with WanEmulator(cfg) as emu:
        r, w = await _connect(emu.port)
        for i in range(150):
            chunk = i.to_bytes(4, "big") * (1 + i % 7)  # numbered chunks of varying length
            sent += chunk
            w.write(chunk)
            await w.drain()
            await asyncio.sleep(0.002)  # separate bursts on the proxy, each with its own jitter
        w.write_eof()
        received = await asyncio.wait_for(r.read(), 10.0)  # until the echoed EOF comes back
        await _close(w)
    assert received == bytes(sent)


async def _sink(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Read an 8-byte length, then that many bytes, then answer b'ok'."""
    try:
        n = int.from_bytes(await reader.readexactly(8), "big")
        await reader.readexactly(n)
        writer.write(b"ok")
        await writer.drain()
    except (OSError, asyncio.IncompleteReadError):
        pass
    finally:
        writer.close()


async def _timed_upload(port: int, payload: bytes) -> float:
    r, w = await _connect(port)
    t0 = time.perf_counter()
    w.write(len(payload).to_bytes(8, "big") + payload)
    await w.drain()
    reply = await asyncio.wait_for(r.readexactly(2), 20.0)
    elapsed = time.perf_counter() - t0
    await _close(w)
    if reply != b"ok":
        raise AssertionError(reply)
    return elapsed


async def test_bandwidth_shaping() -> None:
    server = await asyncio.start_server(_sink, "127.0.0.1", 0)
    port = int(server.sockets[0].getsockname()[1])
    payload = os.urandom(2_000_000)  # 16 Mbit: 0.32 s at 50 Mbit/s
    try:
        async with WanEmulator(NetemConfig(upstream_port=port)) as emu:
            unshaped = await _timed_upload(emu.port, payload)
        async with WanEmulator(NetemConfig(upstream_port=port, bandwidth_bps=50e6)) as emu:
            shaped = await _timed_upload(emu.port, payload)
            assert emu.stats().bytes_upstream == len(payload) + 8
    finally:
        server.close()
    assert shaped >= 0.30, shaped
    assert shaped - unshaped >= 0.25, (shaped, unshaped)
    assert shaped <= 1.5, shaped  # a bits/bytes slip would give ≥ 2.5 s


async def test_backlog_is_bounded_under_rate_limit() -> None:
    """A fast sender behind a slow link is pushed back by TCP, not buffered without limit."""
    server = await asyncio.start_server(_sink, "127.0.0.1", 0)
    port = int(server.sockets[0].getsockname()[1])
    payload = os.urandom(1_000_000)  # 0.1 s at 80 Mbit/s
    cfg = NetemConfig(upstream_port=port, bandwidth_bps=80e6, chunk_bytes=16 * 1024, max_queue_bytes=64 * 1024)
    try:
        async with WanEmulator(cfg) as emu:
            elapsed = await _timed_upload(emu.port, payload)
            stats = emu.stats()
    finally:
        server.close()
    assert stats.bytes_upstream == len(payload) + 8
    assert 0 < stats.queue_peak_bytes <= cfg.max_queue_bytes + cfg.chunk_bytes
    assert 0.09 <= elapsed <= 1.5, elapsed


async def test_many_concurrent_connections(echo_port: int, ping: Pinger) -> None:
    n_conn, n_ping, rtt_ms = 20, 5, 30.0

    async def client(emu_port: int) -> list[float]:
        r, w = await _connect(emu_port)
        try:
            return await ping(r, w, n_ping)
        finally:
            await _close(w)

    async with WanEmulator(NetemConfig(upstream_port=echo_port, rtt_ms=rtt_ms)) as emu:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(client(emu.port) for _ in range(n_conn)))
        elapsed = time.perf_counter() - t0
        stats = emu.stats()
    assert stats.connections_total == n_conn
    assert all(min(samples) >= rtt_ms - 2.0 for samples in results)
    # Serially this would take n_conn * n_ping * rtt = 3 s; concurrently ~0.15 s.
    assert elapsed < 1.5, elapsed


async def test_clean_shutdown_closes_both_sides(ping: Pinger, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    upstream_open: set[asyncio.StreamWriter] = set()

    async def tracked_echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream_open.add(writer)
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except OSError:
            pass
        finally:
            upstream_open.discard(writer)
            writer.close()

    server = await asyncio.start_server(tracked_echo, "127.0.0.1", 0)
    port = int(server.sockets[0].getsockname()[1])
    try:
        emu = await WanEmulator(NetemConfig(upstream_port=port, rtt_ms=10.0)).start()
        emu_port = emu.port
        clients = [await _connect(emu_port) for _ in range(5)]
        for r, w in clients:
            await ping(r, w, 1)
        assert emu.stats().connections_active == 5
        assert len(upstream_open) == 5
        await asyncio.wait_for(emu.aclose(), 5.0)
        assert emu.stats().connections_active == 0
        for r, w in clients:  # every client sees EOF or a reset promptly
            with contextlib.suppress(ConnectionError):
                assert await asyncio.wait_for(r.read(), 2.0) == b""
            await _close(w)
        deadline = time.monotonic() + 2.0
        while upstream_open and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert not upstream_open  # upstream sockets were closed too
        with pytest.raises(ConnectionRefusedError):
            await _connect(emu_port)
        await asyncio.sleep(0.05)  # let late callbacks (asyncio's own error reports) run
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert not errors
    finally:
        server.close()


async def test_unreachable_upstream_closes_client() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]
    async with WanEmulator(NetemConfig(upstream_port=dead_port)) as emu:
        r, w = await _connect(emu.port)
        with contextlib.suppress(ConnectionError):
            assert await asyncio.wait_for(r.read(), 5.0) == b""
        await _close(w)
        assert emu.stats().connections_failed == 1


class _EchoHandler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        while data := self.request.recv(65536):
            self.request.sendall(data)


@pytest.fixture
def sync_echo_port() -> Iterator[int]:
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _EchoHandler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()


def _sync_ping_ms(port: int, n: int) -> list[float]:
    out = []
    with socket.create_connection(("127.0.0.1", port), timeout=5.0) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for i in range(n):
            msg = i.to_bytes(4, "big")
            t0 = time.perf_counter()
            sock.sendall(msg)
            got = b""
            while len(got) < 4:
                part = sock.recv(4 - len(got))
                if not part:
                    raise ConnectionError("closed")
                got += part
            out.append((time.perf_counter() - t0) * 1000.0)
            if got != msg:
                raise AssertionError(got)
    return out


def test_threaded_emulator_for_sync_callers(sync_echo_port: int) -> None:
    direct = min(_sync_ping_ms(sync_echo_port, 5))
    with ThreadedWanEmulator(NetemConfig(upstream_port=sync_echo_port, rtt_ms=20.0)) as emu:
        samples = _sync_ping_ms(emu.port, 5)
        assert emu.stats().connections_total == 1
    added = min(samples) - direct
    assert 18.0 <= added <= 45.0, samples
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", emu.port), timeout=1.0).close()


async def test_a_reset_follows_the_bytes_sent_before_it() -> None:
    """An upstream that answers, then resets (closing with unread input): the answer still crosses the link, and
    the reset after it, one delay later. The emulator used to tear both sides down at once, dropping the answer."""

    async def answer_then_reset(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await r.readexactly(10)  # 90 bytes stay unread: closing resets the connection
        w.write(b"error: bye")
        await w.drain()
        sock = w.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # reset on close
        w.transport.abort()

    server = await asyncio.start_server(answer_then_reset, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with WanEmulator(NetemConfig(upstream_port=port, rtt_ms=100.0)) as emu:
            r, w = await _connect(emu.port)
            t0 = time.perf_counter()
            w.write(bytes(100))
            await w.drain()
            got = b""
            with contextlib.suppress(ConnectionError):
                while chunk := await asyncio.wait_for(r.read(100), 5.0):
                    got += chunk
            elapsed_ms = (time.perf_counter() - t0) * 1000.0
            await _close(w)
    finally:
        server.close()
        await server.wait_closed()
    assert got == b"error: bye"
    assert elapsed_ms >= 90.0  # up and down: the answer and the reset each crossed the link
