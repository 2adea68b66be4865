"""Server side: accept WebSocket connections and hand each binary frame to a per-connection peer."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import ssl
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.exceptions import ConnectionClosed

from splitspec.exceptions import ConfigError
from splitspec.transport.client import websocket_max_size

log = logging.getLogger(__name__)


class Peer(Protocol):
    """Per-connection logic. ``handle`` returns the reply frame and whether to close afterwards."""

    async def handle(self, data: bytes) -> tuple[bytes, bool]: ...

    async def closed(self) -> None: ...


class FrameServer:
    """A WebSocket server whose connections each get a :class:`Peer` from ``peer_factory``."""

    def __init__(
        self,
        peer_factory: Callable[[str], Peer],
        host: str,
        port: int,
        max_message_bytes: int,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self._factory = peer_factory
        self._ssl = ssl_context
        self._host = host
        self._port = port
        self._max = max_message_bytes
        self._server: Server | None = None

    async def start(self) -> None:
        self._server = await serve(
            self._serve_connection,
            self._host,
            self._port,
            max_size=websocket_max_size(self._max),
            compression=None,
            ping_interval=20,
            ping_timeout=60,
            ssl=self._ssl,
        )

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

    async def _serve_connection(self, ws: ServerConnection) -> None:
        remote = "{}:{}".format(*ws.remote_address[:2]) if ws.remote_address else "?"
        peer = self._factory(remote)
        try:
            async for data in ws:
                raw = data if isinstance(data, bytes) else data.encode()
                reply, close = await peer.handle(raw)
                await ws.send(reply)
                if close:
                    await ws.close(code=1008, reason="refused")
                    break
        except ConnectionClosed:
            pass
        finally:
            await peer.closed()


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
