"""Closing a trunk link ends the connections still being opened, against a scripted trunk.

A connection is opened in a shielded task that every session waiting for room shares. ``TrunkLink.close``
used to close only the connections already open: one still in its handshake (its opener gone, say the
HTTP request went away) finished afterwards and joined the closed link, a live socket and reader task
nobody would close.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed

from splitspec.edge.config import EdgeConfig
from splitspec.edge.link import TrunkLink
from splitspec.exceptions import TransportError
from splitspec.protocol.messages import Hello, OpenSession, SessionOpened, Welcome, decode_message, encode_message
from splitspec.protocol.trunk_fingerprint import TrunkFingerprint

FINGERPRINT = TrunkFingerprint(2, 4, "float32", "0" * 32)
HANDSHAKE_S = 0.5  # the scripted trunk's Welcome comes this late


class _SlowTrunk:
    """Answers a Hello after HANDSHAKE_S and every OpenSession at once; counts its open connections."""

    def __init__(self) -> None:
        self.open_connections = 0

    async def handler(self, ws: ServerConnection) -> None:
        self.open_connections += 1
        try:
            async for raw in ws:
                message = decode_message(raw if isinstance(raw, bytes) else raw.encode())
                if isinstance(message, Hello):
                    await asyncio.sleep(HANDSHAKE_S)
                    await ws.send(encode_message(Welcome("t", 1 << 20, 64, 60.0, FINGERPRINT, "float32")))
                elif isinstance(message, OpenSession):
                    await ws.send(encode_message(SessionOpened(message.request_id, "s1")))
        except ConnectionClosed:
            pass
        finally:
            self.open_connections -= 1


@pytest.fixture
async def trunk() -> AsyncIterator[tuple[_SlowTrunk, TrunkLink]]:
    scripted = _SlowTrunk()
    async with serve(scripted.handler, "127.0.0.1", 0) as server:
        port = next(iter(server.sockets)).getsockname()[1]
        config = EdgeConfig(model_dir=Path("/nonexistent"), cloud_url=f"ws://127.0.0.1:{port}")
        link = TrunkLink(config, Hello("f", 2, 4, "float32", 8), FINGERPRINT, "test")
        yield scripted, link
        await link.close()


async def _no_connections(scripted: _SlowTrunk) -> int:
    for _ in range(100):  # the trunk sees a closed connection a moment later
        if scripted.open_connections == 0:
            break
        await asyncio.sleep(0.02)
    return scripted.open_connections


async def test_a_connection_still_in_its_handshake_does_not_outlive_the_link(
    trunk: tuple[_SlowTrunk, TrunkLink],
) -> None:
    scripted, link = trunk
    opener = asyncio.ensure_future(link.open_session())
    await asyncio.sleep(0.1)  # its connection is in its handshake
    opener.cancel()  # its caller went away; the shielded connection goes on
    with pytest.raises(asyncio.CancelledError):
        await opener
    await link.close()
    await asyncio.sleep(HANDSHAKE_S + 0.3)  # past the moment the handshake would have completed
    assert link.connections == []  # was: one live connection, joined after the close
    assert await _no_connections(scripted) == 0


async def test_an_open_waiting_for_a_connection_fails_when_the_link_closes(
    trunk: tuple[_SlowTrunk, TrunkLink],
) -> None:
    scripted, link = trunk
    opener = asyncio.ensure_future(link.open_session())
    await asyncio.sleep(0.1)
    await link.close()
    with pytest.raises(TransportError, match="link to the trunk was closed"):
        await opener
    assert link.connections == []
    assert await _no_connections(scripted) == 0
    conn, session_id = await link.open_session()  # a closed link connects afresh when asked again
    assert (conn.alive, session_id) == (True, "s1")
