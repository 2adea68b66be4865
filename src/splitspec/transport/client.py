"""Client side: one WebSocket connection carrying splitspec frames, request by request."""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidMessage, InvalidURI
from websockets.frames import CloseCode

from splitspec.exceptions import ConfigError, MessageTooLarge, TransportError, error_from_code
from splitspec.protocol.messages import Error, Message, decode_message, encode_message

Request = TypeVar("Request")
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
        context: ssl.SSLContext | None = None
        if url.startswith("wss://"):
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

    async def recv_raw(self, timeout_s: float) -> bytes:
        try:
            async with asyncio.timeout(timeout_s):  # no task per frame, unlike wait_for
                data = await self._ws.recv()
        except ConnectionClosed as exc:
            raise _closed_error(exc) from exc
        except TimeoutError as exc:
            raise TransportError(f"no reply within {timeout_s:.1f} s") from exc
        return data if isinstance(data, bytes) else data.encode()

    async def request(self, message: Message, timeout_s: float) -> tuple[Message, Exchange]:
        """Send ``message``, wait for the reply; raise the typed error if the reply is an Error."""
        return await self.exchange(message, timeout_s, encode_message, decode_message)

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
        await self._ws.close()


def _closed_error(exc: ConnectionClosed) -> Exception:
    if exc.rcvd is not None and exc.rcvd.code == CloseCode.MESSAGE_TOO_BIG:
        return MessageTooLarge(f"connection closed by the server: {exc.rcvd.reason or 'message too big'}")
    if exc.sent is not None and exc.sent.code == CloseCode.MESSAGE_TOO_BIG:
        return MessageTooLarge("the server's reply exceeded our size limit")
    return TransportError(f"connection lost: {exc}")
