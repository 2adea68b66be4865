"""A WAN emulator: an asyncio TCP proxy that adds delay, jitter and a rate limit.

The kernel's ``netem`` qdisc is not available on our machines, so WAN conditions are emulated in
user space by a proxy that sits between a client and its upstream server::

    client ──► [listen host:port] ── delay/jitter/rate ──► [upstream host:port]
    client ◄── delay/jitter/rate ── [WanEmulator] ◄─────── upstream

Each direction of each connection is an independent one-way link. The timing model is pure and
lives in :class:`~splitspec.netem.schedule.LinkSchedule` (no I/O, testable with plain numbers):

* **Rate.** A chunk of ``n`` bytes occupies the link for ``n * 8 / bandwidth_bps`` seconds,
  starting when it is read or when the previous chunk has finished transmitting, whichever is
  later (store-and-forward serialisation).
* **Delay.** After transmission the chunk propagates for ``rtt/2 + jitter`` seconds (clipped at
  zero), so with no rate limit a chunk read at time ``t`` is written at ``t + rtt/2 + jitter``.
* **Jitter per burst.** One jitter draw covers a burst: the chunks read back to back (each less
  than 1 ms after the previous one finished transmitting), as the 64 KiB reads of one message
  are. A message of any size is thus delayed by ``rtt/2`` plus one zero-mean draw; a draw per
  chunk would, with the ordering rule below, delay a many-chunk message by the largest of its
  chunks' draws.
* **No reordering.** Release times are forced to be non-decreasing (``max`` with the previous
  release), so jitter never reorders bytes: TCP is a byte stream and a real path that reorders
  segments still delivers them in order to the application. A consequence is that the negative
  jitter of a burst that closely follows another is partly masked, and mean added latency
  slightly exceeds ``rtt/2`` when messages follow each other within about twice the jitter.
* **Never early, slightly late.** A chunk is never written before its release time. asyncio on
  Linux sleeps with millisecond-granular epoll timeouts, so each direction wakes up to ~1 ms
  late: the measured added RTT exceeds the setting by about 0.5-1.5 ms on an idle machine
  (``benchmarks/results/netem_accuracy.md``). Measure RTT through the emulator (a ping) rather
  than trusting the setting when separating RTT from fixed overhead.

The I/O shell (:class:`WanEmulator`) reads chunks from one socket, stamps them with the schedule's
release time, queues them and writes each one at its release time. The per-direction queue is
bounded (``max_queue_bytes``); when it is full the proxy stops reading, so TCP flow control
pushes back on the sender just like a finite bottleneck buffer would.

Usage from async code::

    async with WanEmulator(NetemConfig(upstream_port=8765, rtt_ms=80.0)) as emu:
        reader, writer = await asyncio.open_connection(emu.host, emu.port)

and from synchronous code (tests, benchmarks, a CLI)::

    with ThreadedWanEmulator(NetemConfig(upstream_port=8765, rtt_ms=80.0)) as emu:
        connect_to(emu.host, emu.port)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import socket
import threading
from collections import deque
from dataclasses import dataclass
from types import TracebackType

from splitspec.exceptions import ConfigError
from splitspec.netem.schedule import LinkSchedule, NetemConfig

__all__ = ["EmulatorStats", "ThreadedWanEmulator", "WanEmulator"]

logger = logging.getLogger(__name__)

_EOF = b""


@dataclass(frozen=True)
class EmulatorStats:
    """Counters of a :class:`WanEmulator` since it started."""

    connections_total: int  # connections accepted, count
    connections_active: int  # connections currently proxied, count
    connections_failed: int  # connections whose upstream could not be reached, count
    bytes_upstream: int  # bytes forwarded client -> upstream, bytes
    bytes_downstream: int  # bytes forwarded upstream -> client, bytes
    queue_peak_bytes: int  # largest backlog held by one direction of one connection, bytes


class _LinkAborted(Exception):
    """One side of a proxied connection failed; the whole connection is torn down."""


class _Direction:
    """Moves bytes from ``src`` to ``dst`` through a :class:`LinkSchedule`."""

    def __init__(
        self,
        name: str,
        src: asyncio.StreamReader,
        dst: asyncio.StreamWriter,
        schedule: LinkSchedule,
        config: NetemConfig,
        on_bytes: _ByteCounter,
    ) -> None:
        self.name = name
        self._src = src
        self._dst = dst
        self._schedule = schedule
        self._chunk = config.chunk_bytes
        self._max_queued = config.max_queue_bytes
        # (release time, chunk): b"" forwards the sender's EOF, None its reset
        self._queue: deque[tuple[float, bytes | None]] = deque()
        self._queued = 0
        self._has_data = asyncio.Event()
        self._has_room = asyncio.Event()
        self._has_room.set()
        self._on_bytes = on_bytes

    async def ingress(self) -> None:
        """Read chunks, stamp them with their release time and queue them, until EOF."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                data = await self._src.read(self._chunk)
            except OSError as exc:
                # the sender reset the connection: what it sent before still crosses the link, and the reset
                # follows it after the same delay (a real link does not drop the bytes in flight ahead of it)
                logger.debug("netem %s: the sender reset the connection: %r", self.name, exc)
                self._queue.append((self._schedule.release_time(loop.time(), 0), None))
                self._has_data.set()
                return
            release = self._schedule.release_time(loop.time(), len(data))
            self._queue.append((release, data))
            self._queued += len(data)
            self._on_bytes.note_backlog(self._queued)
            self._has_data.set()
            if not data:
                return
            while self._queued >= self._max_queued:
                self._has_room.clear()
                await self._has_room.wait()

    async def egress(self) -> None:
        """Write each queued chunk at its release time; forward EOF as a half-close."""
        loop = asyncio.get_running_loop()
        while True:
            while not self._queue:
                self._has_data.clear()
                await self._has_data.wait()
            release, data = self._queue.popleft()
            wait = release - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            if data is None:
                _abort(self._dst)
                raise _LinkAborted(f"{self.name}: the sender reset the connection")
            try:
                if not data:
                    if self._dst.can_write_eof():
                        self._dst.write_eof()
                    return
                self._dst.write(data)
                await self._dst.drain()
            except OSError as exc:
                raise _LinkAborted(f"{self.name}: write failed: {exc!r}") from exc
            self._queued -= len(data)
            self._on_bytes(self.name, len(data))
            if self._queued < self._max_queued:
                self._has_room.set()


class _ByteCounter:
    def __init__(self) -> None:
        self.upstream = 0
        self.downstream = 0
        self.queue_peak = 0

    def note_backlog(self, nbytes: int) -> None:
        self.queue_peak = max(self.queue_peak, nbytes)

    def __call__(self, direction: str, nbytes: int) -> None:
        if direction == "up":
            self.upstream += nbytes
        else:
            self.downstream += nbytes


def _set_nodelay(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _abort(writer: asyncio.StreamWriter) -> None:
    transport = writer.transport
    if not transport.is_closing():
        transport.abort()


class WanEmulator:
    """An asyncio TCP proxy emulating a WAN link. Use ``async with`` or ``start``/``aclose``."""

    def __init__(self, config: NetemConfig) -> None:
        self.config = config
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self._bytes = _ByteCounter()
        self._connections_total = 0
        self._connections_failed = 0
        self._closing = False
        self._host = config.listen_host
        self._port = config.listen_port

    @property
    def host(self) -> str:
        """Address the proxy listens on."""
        return self._host

    @property
    def port(self) -> int:
        """Port the proxy listens on (the real one, also when the config asked for 0)."""
        if self._server is None:
            raise RuntimeError("WanEmulator is not started")
        return self._port

    def stats(self) -> EmulatorStats:
        """A snapshot of the connection and byte counters."""
        return EmulatorStats(
            connections_total=self._connections_total,
            connections_active=len(self._handlers),
            connections_failed=self._connections_failed,
            bytes_upstream=self._bytes.upstream,
            bytes_downstream=self._bytes.downstream,
            queue_peak_bytes=self._bytes.queue_peak,
        )

    async def start(self) -> WanEmulator:
        """Bind the listening socket and start accepting connections."""
        if self._server is not None:
            raise RuntimeError("WanEmulator already started")
        try:
            self._server = await asyncio.start_server(self._on_client, self.config.listen_host, self.config.listen_port)
        except OSError as exc:
            where = f"{self.config.listen_host}:{self.config.listen_port}"
            raise ConfigError(f"netem cannot listen on {where}: {exc.strerror or exc}") from None
        sockname = self._server.sockets[0].getsockname()
        self._host, self._port = str(sockname[0]), int(sockname[1])
        logger.info(
            "netem listening on %s:%d -> %s:%d (rtt %.1f ms, jitter %.1f ms %s, bandwidth %s)",
            self._host,
            self._port,
            self.config.upstream_host,
            self.config.upstream_port,
            self.config.rtt_ms,
            self.config.jitter_ms,
            self.config.jitter_distribution,
            "unlimited" if self.config.bandwidth_bps is None else f"{self.config.bandwidth_bps:.0f} bit/s",
        )
        return self

    async def aclose(self) -> None:
        """Stop listening and close every proxied connection (both sockets of each)."""
        if self._closing:
            return
        self._closing = True
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            _abort(writer)
        handlers = list(self._handlers)
        for task in handlers:
            task.cancel()
        if handlers:
            await asyncio.gather(*handlers, return_exceptions=True)
        if self._server is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), timeout=5.0)
        logger.info("netem on %s:%d closed (%s)", self._host, self._port, self.stats())

    async def serve_forever(self) -> None:
        """Run until cancelled (for the CLI)."""
        if self._server is None:
            await self.start()
        try:
            await asyncio.Event().wait()
        finally:
            await self.aclose()

    async def __aenter__(self) -> WanEmulator:
        return await self.start()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def _on_client(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        # A plain callback: the connection runs in a task we own, so that aclose() may cancel it
        # (cancelling the task asyncio.start_server itself creates makes 3.11 log a spurious error).
        if self._closing:
            _abort(client_w)
            return
        conn_id = self._connections_total
        self._connections_total += 1
        self._writers.add(client_w)
        task = asyncio.get_running_loop().create_task(
            self._serve_connection(conn_id, client_r, client_w), name=f"netem-conn-{conn_id}"
        )
        self._handlers.add(task)
        task.add_done_callback(self._handlers.discard)

    async def _serve_connection(
        self, conn_id: int, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter
    ) -> None:
        peer = client_w.get_extra_info("peername")
        try:
            await self._proxy(conn_id, peer, client_r, client_w)
        except asyncio.CancelledError:
            logger.debug("netem connection %d from %s cancelled", conn_id, peer)
            raise
        except Exception:  # a bug in the proxy must not kill the server; log it with its traceback
            logger.exception("netem connection %d from %s failed", conn_id, peer)
        finally:
            _abort(client_w)
            self._writers.discard(client_w)

    async def _proxy(
        self,
        conn_id: int,
        peer: object,
        client_r: asyncio.StreamReader,
        client_w: asyncio.StreamWriter,
    ) -> None:
        cfg = self.config
        _set_nodelay(client_w)
        try:
            up_r, up_w = await asyncio.wait_for(
                asyncio.open_connection(cfg.upstream_host, cfg.upstream_port, limit=cfg.chunk_bytes * 2),
                timeout=cfg.connect_timeout_s,
            )
        except (OSError, TimeoutError) as exc:
            self._connections_failed += 1
            logger.warning(
                "netem connection %d from %s: cannot reach upstream %s:%d: %r",
                conn_id,
                peer,
                cfg.upstream_host,
                cfg.upstream_port,
                exc,
            )
            return
        self._writers.add(up_w)
        _set_nodelay(up_w)
        logger.debug("netem connection %d from %s open", conn_id, peer)
        up = _Direction(
            "up",
            client_r,
            up_w,
            LinkSchedule.from_config(cfg, random.Random(f"{cfg.seed}/{conn_id}/up")),
            cfg,
            self._bytes,
        )
        down = _Direction(
            "down",
            up_r,
            client_w,
            LinkSchedule.from_config(cfg, random.Random(f"{cfg.seed}/{conn_id}/down")),
            cfg,
            self._bytes,
        )
        tasks = [asyncio.create_task(coro) for coro in (up.ingress(), up.egress(), down.ingress(), down.egress())]
        try:
            done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                failure = task.exception()
                if isinstance(failure, _LinkAborted):
                    logger.debug("netem connection %d aborted: %s", conn_id, failure)
                elif failure is not None:
                    raise failure
            if not pending:
                # Both directions forwarded their EOF: flush and close gracefully.
                for writer in (up_w, client_w):
                    writer.close()
                for writer in (up_w, client_w):
                    with contextlib.suppress(OSError, TimeoutError):
                        await asyncio.wait_for(writer.wait_closed(), timeout=1.0)
                logger.debug("netem connection %d closed", conn_id)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            _abort(up_w)
            self._writers.discard(up_w)


class ThreadedWanEmulator:
    """A :class:`WanEmulator` running on its own event loop in a daemon thread.

    For synchronous callers: ``with ThreadedWanEmulator(cfg) as emu: ... emu.port ...``.
    """

    def __init__(self, config: NetemConfig) -> None:
        self.config = config
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._emulator: WanEmulator | None = None
        self._error: BaseException | None = None

    @property
    def host(self) -> str:
        return self._started().host

    @property
    def port(self) -> int:
        return self._started().port

    def stats(self) -> EmulatorStats:
        return self._started().stats()

    def _started(self) -> WanEmulator:
        if self._emulator is None:
            raise RuntimeError("ThreadedWanEmulator is not started")
        return self._emulator

    def start(self, timeout_s: float = 10.0) -> ThreadedWanEmulator:
        """Start the thread and return once the proxy is listening."""
        if self._thread is not None:
            raise RuntimeError("ThreadedWanEmulator already started")
        self._thread = threading.Thread(target=self._run, name="splitspec-netem", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise TimeoutError("netem thread did not start in time")
        if self._error is not None:
            raise RuntimeError("netem failed to start") from self._error
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        """Close all connections and join the thread."""
        if self._thread is None:
            return
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # loop already finished
                loop.call_soon_threadsafe(stop.set)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.warning("netem thread did not stop within %.1f s", timeout_s)

    def __enter__(self) -> ThreadedWanEmulator:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except Exception as exc:  # handed to the thread that called start()
            logger.debug("netem thread failed: %r", exc)
            self._error = exc
            self._ready.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        emulator = WanEmulator(self.config)
        await emulator.start()
        self._emulator = emulator
        self._ready.set()
        try:
            await self._stop.wait()
        finally:
            await emulator.aclose()
