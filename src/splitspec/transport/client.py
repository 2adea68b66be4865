"""Client side: one WebSocket connection carrying splitspec frames.

A :class:`Channel` starts request by request: each request waits for the next frame. After
:meth:`Channel.multiplex` (the edge engine's trunk connections) many requests may be in flight at
once: a reader task takes every reply off the socket and hands it to the request it answers. A
step's reply names its session and sequence number; every other request (handshake, closing
sessions) goes one at a time and takes the reply that names no step, and names the request's
session or none; OpenSession requests go together, answered by their request id (a refusal of one,
which names nothing, goes to every open in flight). A reply that names a step, an open or a session
nobody waits for any more (it timed out or was cancelled) goes to no other request: a late step's
reply is dropped, as is a late answer to a close, and a session opened too late is closed at once,
so the trunk holds no session the edge does not know. A broken connection fails every request in
flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidMessage, InvalidURI
from websockets.frames import CloseCode
from websockets.protocol import State
from websockets.uri import parse_uri

from splitspec.exceptions import ConfigError, MessageTooLarge, ProtocolError, TransportError, error_from_code
from splitspec.protocol.messages import (
    CloseSession,
    Error,
    Message,
    OpenSession,
    SessionOpened,
    Step,
    StepResult,
    decode_message,
    encode_message,
)

log = logging.getLogger(__name__)

Request = TypeVar("Request")
ORPHAN_CLOSE_TIMEOUT_S = 5.0  # closing a session opened for a request that was gone, seconds
OPEN_KEY = "\x00open"  # the session id half of an OpenSession's key in flight (no real session id has a NUL)
Reply = TypeVar("Reply")


def websocket_max_size(max_message_bytes: int) -> int:
    """The WebSocket-level cap for a given protocol cap.

    Frames between the two caps are read and refused with a typed ``message_too_large`` reply
    while the connection stays up; only frames beyond this hard cap close the connection (1009).
    """
    return 2 * max_message_bytes + (1 << 20)


def connect_failure(exc: BaseException, tls: bool) -> str:
    """Why a connection attempt failed, in words (some of these exceptions carry no message at all)."""
    reason = str(exc) or type(exc).__name__
    if isinstance(exc, ssl.SSLCertVerificationError):  # a TLS server we were not told to trust: clear as it is
        return reason
    if tls and isinstance(exc, ssl.SSLError | ConnectionResetError | ConnectionAbortedError | EOFError):
        return f"the TLS handshake failed ({reason}): if the server has no TLS certificate, use ws:// instead of wss://"
    if not tls and isinstance(exc, InvalidMessage | ConnectionResetError):
        return f"no WebSocket handshake ({reason}): if the server serves TLS (--tls-cert), use wss:// instead of ws://"
    return reason


@dataclass(frozen=True)
class Exchange:
    """Costs of one request/reply on the edge side."""

    roundtrip_ms: float  # from the first byte sent to the reply received, milliseconds
    encode_ms: float  # serializing the request, milliseconds
    decode_ms: float  # parsing the reply, milliseconds
    bytes_up: int  # request frame size, bytes
    bytes_down: int  # reply frame size, bytes


class Channel:
    """A connection to a splitspec server. Errors the server reports are raised as their own type."""

    def __init__(self, ws: ClientConnection, max_message_bytes: int) -> None:
        self._ws = ws
        self.max_message_bytes = max_message_bytes
        self._reader: asyncio.Task[None] | None = None  # see multiplex
        self._waiting: dict[tuple[str, int] | None, asyncio.Future[_Arrival]] = {}  # None: the control request
        self._control = asyncio.Lock()  # requests that are not steps go one at a time
        self._control_session: str | None = None  # the session the control request in flight names, if any
        self._broken: TransportError | None = None  # why a multiplexed connection is gone, once it is
        self._orphan_closes: set[asyncio.Task[None]] = set()  # closing sessions opened for requests gone

    @classmethod
    async def connect(
        cls,
        url: str,
        *,
        max_message_bytes: int,
        timeout_s: float,
        ca_file: Path | None = None,
        idle_frame_limit: int | None = None,
    ) -> Channel:
        """Open a connection; ``wss://`` URLs use TLS, verified against ``ca_file`` or the system store.

        ``idle_frame_limit``: outside an exchange, refuse any frame above this many bytes from its
        length (for a peer that speaks only when asked: nothing bigger is ever buffered); by
        default the protocol cap applies at all times.
        """
        try:  # websockets' own parse: a scheme in any case, and a bad port or host raised as ours, not a ValueError
            secure = parse_uri(url).secure
        except InvalidURI as exc:
            raise ConfigError(f"invalid server URL {url!r}: {exc.msg}") from None
        except ValueError as exc:  # urllib's: a port out of range, an unclosed IPv6 bracket
            raise ConfigError(f"invalid server URL {url!r}: {exc}") from None
        context: ssl.SSLContext | None = None
        if secure:
            try:
                context = ssl.create_default_context(cafile=ca_file)
            except (OSError, ssl.SSLError) as exc:
                raise ConfigError(f"cannot load TLS CA file {ca_file}: {exc}") from None
        elif ca_file is not None:
            raise ConfigError(f"a CA file was given but {url} is not a wss:// URL")
        try:
            ws = await connect(
                url,
                ssl=context,
                max_size=websocket_max_size(max_message_bytes) if idle_frame_limit is None else idle_frame_limit,
                compression=None,  # tensors do not compress; deflate only costs time
                open_timeout=timeout_s,
                ping_interval=20,
                ping_timeout=60,
            )
        except (OSError, InvalidHandshake, InvalidURI, TimeoutError) as exc:  # ssl.SSLError is an OSError
            raise TransportError(f"cannot connect to {url}: {connect_failure(exc, tls=context is not None)}") from exc
        return cls(ws, max_message_bytes)

    @property
    def response_headers(self) -> dict[str, str]:
        """The headers of the server's answer to the WebSocket upgrade (e.g. which replica serves us)."""
        response = self._ws.response
        return {} if response is None else {name.lower(): value for name, value in response.headers.raw_items()}

    async def send_raw(self, data: bytes) -> None:
        try:
            await self._ws.send(data)
        except ConnectionClosed as exc:
            raise _closed_error(exc) from exc

    async def recv_raw(self, timeout_s: float | None) -> bytes:
        """The next frame; ``timeout_s`` None waits for ever (a reader that owns the socket)."""
        try:
            async with asyncio.timeout(timeout_s):  # no task per frame, unlike wait_for
                data = await self._ws.recv()
        except ConnectionClosed as exc:
            raise _closed_error(exc) from exc
        except TimeoutError as exc:
            raise TransportError(f"no reply within {timeout_s or 0.0:.1f} s") from exc
        return data if isinstance(data, bytes) else data.encode()

    async def request(self, message: Message, timeout_s: float) -> tuple[Message, Exchange]:
        """Send ``message``, wait for the reply; raise the typed error if the reply is an Error."""
        if self._reader is None:
            return await self.exchange(message, timeout_s, encode_message, decode_message)
        if isinstance(message, Step):
            return await self._multiplexed(message, (message.session_id, message.seq), timeout_s)
        if isinstance(message, OpenSession):  # its answer names its request id (a refusal names nothing)
            return await self._multiplexed(message, (OPEN_KEY, message.request_id), timeout_s)
        async with self._control:
            self._control_session = _names(message)
            try:
                return await self._multiplexed(message, None, timeout_s)
            finally:
                self._control_session = None

    @property
    def alive(self) -> bool:
        """False once a multiplexed connection broke (its reader saw the end)."""
        return self._broken is None

    @property
    def closed(self) -> bool:
        """Whether the WebSocket is closing or closed, multiplexed or not (say, the peer closed it as idle)."""
        return self._ws.state is not State.OPEN

    def multiplex(self) -> None:
        """Let requests be in flight together from now on (see the module docstring)."""
        if self._reader is None:
            self._reader = asyncio.get_running_loop().create_task(self._read_forever())

    async def _read_forever(self) -> None:
        cap = websocket_max_size(self.max_message_bytes)
        try:
            while True:
                raw = await self.recv_raw(None)
                at = time.perf_counter()
                reply = decode_message(raw, max_bytes=cap)
                arrival = _Arrival(reply, at, (time.perf_counter() - at) * 1e3, len(raw))
                key = _answers(reply)
                if key is None:
                    self._route_control(reply, arrival)
                    continue
                if key not in self._waiting:  # its request timed out or was cancelled
                    self._late(reply)
                    continue
                future = self._waiting.pop(key)
                if not future.done():
                    future.set_result(arrival)
        except (TransportError, ProtocolError) as exc:  # the socket broke, or a frame we refuse
            self._fail(exc if isinstance(exc, TransportError) else TransportError(f"bad frame from the server: {exc}"))
        except asyncio.CancelledError:
            self._fail(TransportError("connection closed"))
            raise

    def _route_control(self, reply: Message, arrival: _Arrival) -> None:
        """Deliver a reply that answers no step and no open by name: an open's refusal, or a control answer.

        An open's refusal names nothing (an OpenSession carries no session), while the one control request
        multiplexed, CloseSession, is answered and refused naming its session. So a refusal naming nothing goes to
        the opens in flight, whichever control request waits (which open it refuses cannot be told: each gets it and
        may try again); any other reply goes to the control request in flight if it names that request's session
        (or none), and is otherwise a late answer, nobody's: the answer to a close that timed out must not be taken
        for the answer to the next close.
        """
        named = _names(reply)
        opens = [k for k in self._waiting if k is not None and k[0] == OPEN_KEY]
        if isinstance(reply, Error) and named is None and opens:
            for open_key in opens:
                waiting = self._waiting.pop(open_key)
                if not waiting.done():
                    waiting.set_result(arrival)
            return
        future = self._waiting.get(None)
        if future is None or (named is not None and named != self._control_session):
            self._late(reply)  # nobody waits for it (its request timed out), or it answers another session
            return
        del self._waiting[None]
        if not future.done():
            future.set_result(arrival)

    def _late(self, reply: Message) -> None:
        """A reply to a step or an open that nobody waits for: dropped; a session it opened is closed."""
        if not isinstance(reply, SessionOpened):
            log.debug("dropped a late %s", reply.TYPE)
            return
        task = asyncio.get_running_loop().create_task(self._close_orphan(reply.session_id))
        self._orphan_closes.add(task)
        task.add_done_callback(self._orphan_closes.discard)

    async def _close_orphan(self, session_id: str) -> None:
        try:
            await self.request(CloseSession(session_id), ORPHAN_CLOSE_TIMEOUT_S)
        except (ProtocolError, TransportError) as exc:  # best effort: a broken connection lost it anyway
            log.debug("closing session %s, opened too late: %s", session_id, exc)

    def _fail(self, exc: TransportError) -> None:
        self._broken = exc
        waiting, self._waiting = self._waiting, {}
        for future in waiting.values():
            if not future.done():
                future.set_exception(TransportError(str(exc)))

    async def _multiplexed(
        self, message: Message, key: tuple[str, int] | None, timeout_s: float
    ) -> tuple[Message, Exchange]:
        if self._broken is not None:
            raise TransportError(str(self._broken))
        if key in self._waiting:
            raise RuntimeError(f"a request for {key} is already in flight")
        future: asyncio.Future[_Arrival] = asyncio.get_running_loop().create_future()
        self._waiting[key] = future
        t0 = time.perf_counter()
        try:
            data = encode_message(message)
            t1 = time.perf_counter()
            await self.send_raw(data)
            async with asyncio.timeout(timeout_s):
                arrival = await future
        except TimeoutError:
            raise TransportError(f"no reply within {timeout_s:.1f} s") from None
        finally:
            if self._waiting.get(key) is future:
                del self._waiting[key]
            if future.done() and not future.cancelled():
                # the reader may have failed it while the send was failing: the send's error is the one raised,
                # and this one is read here so that asyncio does not report it as never retrieved
                future.exception()
            else:
                future.cancel()
        reply = arrival.reply
        if isinstance(reply, Error):
            raise error_from_code(reply.code, reply.message, reply.retry_after_s)
        return reply, Exchange(
            roundtrip_ms=(arrival.at - t1) * 1e3,
            encode_ms=(t1 - t0) * 1e3,
            decode_ms=arrival.decode_ms,
            bytes_up=len(data),
            bytes_down=arrival.nbytes,
        )

    async def exchange(
        self,
        message: Request,
        timeout_s: float,
        encode: Callable[[Request], bytes],
        decode: Callable[..., Reply],
        *,
        reply_limit: int | None = None,
    ) -> tuple[Reply, Exchange]:
        """:meth:`request` for any message family: ``encode`` the request, ``decode(raw, max_bytes=)`` the reply.

        ``reply_limit``: the largest reply this request can legitimately get, bytes. The WebSocket
        layer refuses a bigger frame from its length field, before buffering it, and the
        connection is closed (raised as ``MessageTooLarge``).
        """
        t0 = time.perf_counter()
        data = encode(message)
        t1 = time.perf_counter()
        protocol = self._ws.protocol
        cap = websocket_max_size(self.max_message_bytes) if reply_limit is None else reply_limit
        before, protocol.max_message_size = protocol.max_message_size, cap
        try:
            await self.send_raw(data)
            raw = await self.recv_raw(timeout_s)
        finally:
            protocol.max_message_size = before
        t2 = time.perf_counter()
        reply = decode(raw, max_bytes=cap)
        t3 = time.perf_counter()
        if isinstance(reply, Error):
            raise error_from_code(reply.code, reply.message, reply.retry_after_s)
        return reply, Exchange(
            roundtrip_ms=(t2 - t1) * 1e3,
            encode_ms=(t1 - t0) * 1e3,
            decode_ms=(t3 - t2) * 1e3,
            bytes_up=len(data),
            bytes_down=len(raw),
        )

    async def close(self) -> None:
        for task in list(self._orphan_closes):
            task.cancel()
        await self._ws.close()
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader


@dataclass(frozen=True)
class _Arrival:
    """A reply the reader took off a multiplexed connection, with what reading it cost."""

    reply: Message
    at: float  # time.perf_counter() when its frame was received
    decode_ms: float  # parsing it, milliseconds
    nbytes: int  # its frame, bytes


def _answers(reply: Message) -> tuple[str, int] | None:
    """The step (session, seq) a reply answers; None for a reply to a control request."""
    if isinstance(reply, StepResult):
        return (reply.session_id, reply.seq)
    if isinstance(reply, SessionOpened):
        return (OPEN_KEY, reply.request_id)
    if isinstance(reply, Error) and reply.session_id is not None and reply.seq is not None:
        return (reply.session_id, reply.seq)
    return None


def _names(message: Message) -> str | None:
    """The session a control request or its reply names (a CloseSession, a SessionClosed, an Error), if any."""
    session_id = getattr(message, "session_id", None)
    return session_id if isinstance(session_id, str) else None


def _closed_error(exc: ConnectionClosed) -> Exception:
    if exc.rcvd is not None and exc.rcvd.code == CloseCode.MESSAGE_TOO_BIG:
        return MessageTooLarge(f"connection closed by the server: {exc.rcvd.reason or 'message too big'}")
    if exc.sent is not None and exc.sent.code == CloseCode.MESSAGE_TOO_BIG:
        return MessageTooLarge("the server's reply exceeded our size limit")
    return TransportError(f"connection lost: {exc}")
