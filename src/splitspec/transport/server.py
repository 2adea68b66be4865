"""Server side: accept WebSocket connections and hand each binary frame to a per-connection peer.

What a connection may cost before it proves who it is is bounded here, in the transport, for every
splitspec server (:class:`ConnectionLimits`): until its peer reports the handshake done, the
WebSocket layer refuses any frame above a Hello's size (so nothing bigger is ever buffered), the
connection must finish its handshake within a deadline, and only so many connections may be in
their handshake at once and open from one address. After the handshake the frame cap is raised to
the server's message cap, and a connection silent for longer than the idle timeout is closed (one
with a frame still being served is not idle, however long the frame takes).

A server may also answer plain HTTP GETs on chosen paths of its own port (``http_routes``: the
trunk's ``/metrics`` and ``/health``); every other request goes on to the WebSocket handshake.

The per-connection loop (:class:`ConnectionGuard`) sees a connection only through
:class:`FrameSocket`, so the same limits and the same loop serve connections accepted by another
WebSocket server (the trunk's Ray Serve deployment hands it Starlette's WebSockets).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import ssl
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.exceptions import ConnectionClosed
from websockets.frames import CloseCode
from websockets.http11 import Request, Response

from splitspec.exceptions import ConfigError, TransportError
from splitspec.protocol.frames import MAX_HEADER_BYTES, PREFIX_SIZE
from splitspec.transport import LOOPBACK_HOSTS
from splitspec.transport.client import websocket_max_size

log = logging.getLogger(__name__)


class Peer(Protocol):
    """Per-connection logic. ``handle`` returns the reply frame and whether to close afterwards;
    ``ready`` turns true once the peer has accepted the connection's handshake; ``concurrent``:
    past the handshake, frames may be handled concurrently (replies then go out as they are ready,
    and carry what the peer needs to match them, e.g. a session id and a sequence number)."""

    @property
    def ready(self) -> bool: ...

    @property
    def concurrent(self) -> bool: ...

    async def handle(self, data: bytes) -> tuple[bytes, bool]: ...

    async def closed(self) -> None: ...


class SocketClosed(Exception):
    """The connection is gone (the other side closed it, or it broke)."""


class FrameSocket(Protocol):
    """One accepted WebSocket connection, whichever library accepted it."""

    async def recv(self) -> bytes:
        """The next frame's payload (a text frame as its UTF-8 bytes); raise SocketClosed when gone."""
        ...

    async def send(self, data: bytes) -> None:
        """Send one binary frame; raise SocketClosed when gone."""
        ...

    async def close(self, code: int, reason: str) -> None: ...

    def limit_frames(self, max_bytes: int) -> None:
        """Refuse frames above ``max_bytes`` from now on (closing the connection with 1009)."""
        ...


@dataclass(frozen=True)
class ConnectionLimits:
    """What one connection may cost a server, before and after its handshake."""

    handshake_max_bytes: int = PREFIX_SIZE + MAX_HEADER_BYTES  # largest frame before the handshake, bytes
    handshake_timeout_s: float = 10.0  # seconds a new connection has to complete its handshake
    max_unauthenticated: int = 64  # connections still in their handshake, all addresses together
    max_per_address: int = 32  # open connections from one IP address
    # close a connection past its handshake silent this long (no frame received, none in flight); None = never
    idle_timeout_s: float | None = None
    max_in_flight: int = 16  # frames of one (concurrent) connection handled at once; more wait unread

    def __post_init__(self) -> None:
        if self.handshake_max_bytes < PREFIX_SIZE or self.handshake_timeout_s <= 0:
            raise ConfigError("the handshake frame cap and deadline must be positive")
        if self.max_unauthenticated < 1 or self.max_per_address < 1 or self.max_in_flight < 1:
            raise ConfigError("connection limits must be at least 1")
        if self.idle_timeout_s is not None and self.idle_timeout_s <= 0:
            raise ConfigError("the idle timeout must be positive (or None)")


HttpRoute = Callable[[], tuple[int, str, str]]  # answers a GET: (status, content type, body)


class FrameServer:
    """A WebSocket server whose connections each get a :class:`Peer` from ``peer_factory``."""

    def __init__(
        self,
        peer_factory: Callable[[str], Peer],
        host: str,
        port: int,
        max_message_bytes: int,
        ssl_context: ssl.SSLContext | None = None,
        limits: ConnectionLimits | None = None,
        http_routes: Mapping[str, HttpRoute] | None = None,
    ) -> None:
        self._factory = peer_factory
        self._routes = dict(http_routes or {})
        self._ssl = ssl_context
        self._host = host
        self._port = port
        self.limits = limits or ConnectionLimits()
        self.guard = ConnectionGuard(self.limits, max_message_bytes)
        self._server: Server | None = None

    @property
    def connections(self) -> int:
        """Open connections, all addresses."""
        return self.guard.connections

    @property
    def unauthenticated(self) -> int:
        """Connections still in their handshake."""
        return self.guard.unauthenticated

    async def start(self) -> None:
        try:
            self._server = await serve(
                self._serve_connection,
                self._host,
                self._port,
                max_size=self.limits.handshake_max_bytes,  # raised per connection after its handshake
                compression=None,
                ping_interval=20,
                ping_timeout=60,
                ssl=self._ssl,
                process_request=self._answer_http if self._routes else None,
            )
        except OSError as exc:  # address in use, no permission, unknown interface
            raise TransportError(f"cannot listen on {self._host}:{self._port}: {exc.strerror or exc}") from None

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("server not started")
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    def _answer_http(self, ws: ServerConnection, request: Request) -> Response | None:
        """A plain HTTP answer for a request to one of the routes; None lets the WebSocket handshake go on."""
        route = self._routes.get(request.path.split("?", 1)[0])
        if route is None:
            return None
        status, content_type, body = route()
        response = ws.respond(status, body)
        del response.headers["Content-Type"]
        response.headers["Content-Type"] = content_type
        return response

    async def _serve_connection(self, ws: ServerConnection) -> None:
        remote = "{}:{}".format(*ws.remote_address[:2]) if ws.remote_address else "?"
        address = str(ws.remote_address[0]) if ws.remote_address else "?"
        await self.guard.serve(_WebsocketsSocket(ws), self._factory, remote, address)


class _WebsocketsSocket:
    """A :class:`FrameSocket` over a connection accepted by the ``websockets`` library."""

    def __init__(self, ws: ServerConnection) -> None:
        self._ws = ws

    async def recv(self) -> bytes:
        try:
            data = await self._ws.recv()
        except ConnectionClosed as exc:
            raise SocketClosed(str(exc)) from exc
        return data if isinstance(data, bytes) else data.encode()

    async def send(self, data: bytes) -> None:
        try:
            await self._ws.send(data)
        except ConnectionClosed as exc:
            raise SocketClosed(str(exc)) from exc

    async def close(self, code: int, reason: str) -> None:
        await self._ws.close(code, reason)

    def limit_frames(self, max_bytes: int) -> None:
        self._ws.protocol.max_message_size = max_bytes


class ConnectionGuard:
    """Serves connections under :class:`ConnectionLimits`: one frame at a time, or, past the handshake
    of a peer that allows it (``Peer.concurrent``), up to ``max_in_flight`` frames at once.

    It counts, across the connections it serves, those open from each address and those still in
    their handshake; each connection gets its handshake deadline, its frame caps (a Hello's size
    before the handshake, then the server's message cap) and its idle timeout.
    """

    def __init__(self, limits: ConnectionLimits, max_message_bytes: int) -> None:
        self.limits = limits
        self._max = max_message_bytes
        self._per_address: Counter[str] = Counter()  # open connections by remote IP
        self.unauthenticated = 0  # connections still in their handshake

    @property
    def connections(self) -> int:
        """Open connections, all addresses."""
        return sum(self._per_address.values())

    async def serve(self, socket: FrameSocket, peer_factory: Callable[[str], Peer], remote: str, address: str) -> None:
        """Serve one accepted connection from ``remote`` (``address`` is its IP) until it closes."""
        limits = self.limits
        if self._per_address[address] >= limits.max_per_address:
            log.info("refused a connection from %s: %d already open", remote, self._per_address[address])
            await socket.close(CloseCode.TRY_AGAIN_LATER, "too many connections from your address")
            return
        if self.unauthenticated >= limits.max_unauthenticated:
            log.info("refused a connection from %s: %d handshakes in progress", remote, self.unauthenticated)
            await socket.close(CloseCode.TRY_AGAIN_LATER, "too many connections in their handshake")
            return
        self._per_address[address] += 1
        self.unauthenticated += 1
        authenticated = False
        socket.limit_frames(limits.handshake_max_bytes)  # raised once the handshake is done
        peer = peer_factory(remote)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limits.handshake_timeout_s
        in_flight: set[asyncio.Task[None]] = set()  # frames being handled concurrently
        slots = asyncio.Semaphore(limits.max_in_flight)  # a connection's frames in flight, at most
        idle_s = limits.idle_timeout_s
        active_at = loop.time()  # the connection's last frame received or reply sent
        waiting: asyncio.Timeout | None = None  # the deadline of the frame being waited for, while one is

        def finished(task: asyncio.Task[None]) -> None:
            """A concurrent frame's reply went out: once none is in flight, the idle time counts from now."""
            nonlocal active_at
            in_flight.discard(task)
            active_at = loop.time()
            if not in_flight and idle_s is not None and waiting is not None and not waiting.expired():
                waiting.reschedule(active_at + idle_s)

        try:
            while True:
                if not authenticated and peer.ready:
                    authenticated = True
                    self.unauthenticated -= 1
                    socket.limit_frames(websocket_max_size(self._max))
                when: float | None = deadline
                if authenticated:
                    # a connection with a frame in flight (a step computing, or queued) is not idle, however long
                    # the frame takes: its idle deadline is set when the last reply goes out (``finished``)
                    when = None if idle_s is None or in_flight else active_at + idle_s
                try:
                    async with asyncio.timeout_at(when) as waiting:  # no task per frame, unlike wait_for
                        data = await socket.recv()
                except TimeoutError:
                    why = "idle" if authenticated else "no handshake"
                    limit = idle_s if authenticated else limits.handshake_timeout_s
                    log.info("closing connection %s: %s within %.1f s", remote, why, limit or 0.0)
                    await socket.close(CloseCode.POLICY_VIOLATION, f"{why} within the deadline")
                    break
                finally:
                    waiting = None
                active_at = loop.time()
                if authenticated and peer.concurrent:
                    await slots.acquire()  # backpressure: the next frame stays unread while all slots are taken
                    task = loop.create_task(_handle_one(peer, socket, data, slots))
                    in_flight.add(task)
                    task.add_done_callback(finished)
                    continue
                reply, close = await peer.handle(data)
                await socket.send(reply)
                active_at = loop.time()
                if close:
                    await socket.close(CloseCode.POLICY_VIOLATION, "refused")
                    break
        except SocketClosed:
            pass
        finally:
            for task in in_flight:  # the connection is gone: nobody can receive their replies
                task.cancel()
            if in_flight:
                await asyncio.gather(*in_flight, return_exceptions=True)
            if not authenticated:
                self.unauthenticated -= 1
            self._per_address[address] -= 1
            if not self._per_address[address]:
                del self._per_address[address]
            await peer.closed()


async def _handle_one(peer: Peer, socket: FrameSocket, data: bytes, slots: asyncio.Semaphore) -> None:
    """Handle one frame of a concurrent connection and send its reply (whenever it is ready)."""
    try:
        reply, close = await peer.handle(data)
        await socket.send(reply)
        if close:
            await socket.close(CloseCode.POLICY_VIOLATION, "refused")
    except SocketClosed:
        pass  # the connection loop sees it too, and cleans up
    finally:
        slots.release()


class LogBudget:
    """A per-connection log throttle (token bucket): ``burst`` lines at once, then ``per_s`` a second.

    One connection sending thousands of bad frames a second must not fill the server's log.
    """

    def __init__(self, burst: int = 10, per_s: float = 1.0) -> None:
        self.burst = burst
        self.per_s = per_s
        self._tokens = float(burst)
        self._last = time.monotonic()
        self.suppressed = 0  # lines skipped since the last one logged

    def take(self) -> bool:
        """Whether to log this line; when not, it is counted in :attr:`suppressed`."""
        now = time.monotonic()
        self._tokens = min(float(self.burst), self._tokens + (now - self._last) * self.per_s)
        self._last = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        self.suppressed += 1
        return False

    def skipped(self) -> int:
        """Lines skipped since the last call (to report alongside the next line logged)."""
        count, self.suppressed = self.suppressed, 0
        return count


def warn_if_unencrypted(host: str, tls: bool, auth_token: str | None) -> None:
    """Say at start-up that a trunk front reachable beyond this machine serves hidden states (and takes its shared
    secret) in the clear."""
    if tls or host in LOOPBACK_HOSTS:
        return
    secret = "the shared secret and all hidden states" if auth_token is not None else "all hidden states"
    log.warning("%s travel unencrypted: serve TLS (--tls-cert/--tls-key)", secret)


def warn_if_open(auth_token: str | None, url: str, name: str) -> None:
    """Say loudly, at start-up, that a server without a shared secret serves anyone who reaches it."""
    if auth_token is None:
        log.warning(
            "%s on %s requires NO authentication: anyone who can reach this address can use it "
            "(give it a shared secret with --token-file)",
            name,
            url,
        )


def server_tls(cert_file: Path, key_file: Path) -> ssl.SSLContext:
    """A TLS context serving ``cert_file`` (PEM chain) with ``key_file``; clear errors for bad files."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert_file, key_file)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"cannot load TLS certificate {cert_file} / key {key_file}: {exc}") from None
    return context


async def run_until_signalled(server: contextlib.AbstractAsyncContextManager[object], name: str) -> None:
    """Serve inside ``server``'s context until SIGINT or SIGTERM, then leave it cleanly."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()
    log.info("%s stopped", name)
