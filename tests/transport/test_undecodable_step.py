"""A step the server cannot decode is refused naming the step, so the refusal reaches it.

A multiplexed channel matches a step's reply by session id and seq. The refusal of a frame the server
could not decode (here: above its message cap) used to name nothing: the edge handed it to every
OpenSession in flight (or dropped it) and the step waited out its whole timeout. The server now echoes
the ids the frame's header names (:func:`splitspec.protocol.replies.refusal`, through
:class:`~splitspec.transport.peer.MessagePeer`).
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from splitspec.exceptions import MessageTooLarge, UnexpectedMessage
from splitspec.protocol.messages import (
    Error,
    Hello,
    Message,
    OpenSession,
    SessionOpened,
    Step,
    decode_message,
    encode_message,
)
from splitspec.protocol.state import HandshakeGate
from splitspec.transport.client import Channel
from splitspec.transport.peer import MessagePeer
from splitspec.transport.server import FrameServer

CAP = 64 * 1024  # the server's message cap, bytes


class _Peer(MessagePeer[Message]):
    """Past its handshake from the start; opens a session slowly, serves nothing else."""

    concurrent = True

    def __init__(self, remote: str) -> None:
        gate = HandshakeGate(Hello.TYPE, None)
        gate.open()
        super().__init__(gate, 0, remote)

    def decode(self, data: bytes) -> Message:
        return decode_message(data, max_bytes=CAP)

    def encode(self, message: Message | Error) -> bytes:
        return encode_message(message)

    async def dispatch(self, message: Message) -> Message:
        if isinstance(message, OpenSession):
            await asyncio.sleep(0.3)
            return SessionOpened(message.request_id, "s-new")
        raise UnexpectedMessage(f"not served here: {message.TYPE}")

    async def closed(self) -> None:
        pass


async def test_a_step_too_large_to_decode_gets_its_refusal_while_an_open_waits() -> None:
    server = FrameServer(_Peer, "127.0.0.1", 0, CAP)
    await server.start()
    channel = await Channel.connect(f"ws://127.0.0.1:{server.port}", max_message_bytes=4 * CAP, timeout_s=5.0)
    channel.multiplex()
    try:
        big = Step("s1", 3, torch.zeros(1, 40, 1024), torch.arange(40, dtype=torch.int32), torch.arange(-1, 39).int())
        opening = asyncio.ensure_future(channel.request(OpenSession(request_id=1), timeout_s=5.0))
        await asyncio.sleep(0.05)  # the open is in flight when the step's refusal arrives
        started = time.monotonic()
        with pytest.raises(MessageTooLarge):  # was: a TransportError after the whole timeout
            await channel.request(big, timeout_s=3.0)
        assert time.monotonic() - started < 2.0
        opened, _ = await opening  # was: the step's refusal, raised as MessageTooLarge
        assert opened == SessionOpened(1, "s-new")
    finally:
        await channel.close()
        await server.stop()
