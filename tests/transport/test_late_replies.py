"""Replies that arrive after their request gave up, on a multiplexed channel, against a scripted server.

A step's reply (or its refusal) names the step; an open's answer names the open. Once that request timed out or
was cancelled, its reply must reach no other request: a late step refusal used to be handed to every open in
flight as its refusal, and a late ``SessionOpened`` to whichever control request waited, while the session it
opened stayed on the trunk, uncounted by the edge, until its time-to-live.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any

import pytest
import torch
from websockets.asyncio.server import Server, ServerConnection, serve

from splitspec.exceptions import CapacityExceeded, SessionQuotaExceeded, TransportError, UnknownSession
from splitspec.protocol.messages import (
    CloseSession,
    Error,
    Message,
    OpenSession,
    SessionClosed,
    SessionOpened,
    Step,
    decode_message,
    encode_message,
)
from splitspec.transport.client import Channel

CAP = 1 << 20
Script = Callable[[ServerConnection, Message], Coroutine[Any, Any, None]]


class ScriptedTrunk:
    """A WebSocket server that answers each frame with ``script`` (a task per frame, as the trunk serves a
    connection's frames concurrently) and records every message it received."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.received: list[Message] = []
        self._tasks: set[asyncio.Task[None]] = set()

    async def handler(self, ws: ServerConnection) -> None:
        async for raw in ws:
            message = decode_message(raw if isinstance(raw, bytes) else raw.encode(), max_bytes=CAP)
            self.received.append(message)
            task = asyncio.create_task(self.script(ws, message))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)


async def _reply(ws: ServerConnection, message: Message, after_s: float = 0.0) -> None:
    await asyncio.sleep(after_s)
    await ws.send(encode_message(message))


Connect = Callable[[Script], Awaitable[tuple["ScriptedTrunk", Channel]]]


@pytest.fixture
async def connect() -> AsyncIterator[Connect]:
    """Start a scripted trunk on loopback and a multiplexed channel to it (closed after the test)."""
    opened: list[tuple[Channel, Server]] = []

    async def start(script: Script) -> tuple[ScriptedTrunk, Channel]:
        trunk = ScriptedTrunk(script)
        server = await serve(trunk.handler, "127.0.0.1", 0, compression=None)
        port = next(iter(server.sockets)).getsockname()[1]
        channel = await Channel.connect(f"ws://127.0.0.1:{port}", max_message_bytes=CAP, timeout_s=5.0)
        channel.multiplex()
        opened.append((channel, server))
        return trunk, channel

    yield start
    for channel, server in opened:
        await channel.close()
        server.close()


def _step(session_id: str, seq: int) -> Step:
    return Step(session_id, seq, torch.zeros(1, 1, 8), torch.zeros(1, dtype=torch.int32), torch.tensor([-1]).int())


async def test_a_late_step_refusal_is_not_an_open_sessions_refusal(connect: Connect) -> None:
    async def script(ws: ServerConnection, message: Message) -> None:
        if isinstance(message, Step):  # refused only after the edge stopped waiting for it
            await _reply(
                ws,
                Error(CapacityExceeded.code, "full", message.session_id, message.seq, retry_after_s=0.1),
                after_s=0.3,
            )
        elif isinstance(message, OpenSession):  # answered after the late refusal
            await _reply(ws, SessionOpened(message.request_id, "fresh"), after_s=0.5)

    _, channel = await connect(script)
    with pytest.raises(TransportError, match="no reply within"):
        await channel.request(_step("old", 7), timeout_s=0.1)
    opened, _ = await channel.request(OpenSession(request_id=1), timeout_s=5.0)
    assert opened == SessionOpened(1, "fresh")


async def test_a_session_opened_too_late_is_closed_and_answers_no_other_request(
    connect: Connect,
) -> None:
    async def script(ws: ServerConnection, message: Message) -> None:
        if isinstance(message, OpenSession):
            await _reply(ws, SessionOpened(message.request_id, f"s{message.request_id}"), after_s=0.3)
        elif isinstance(message, CloseSession):
            await _reply(ws, SessionClosed(message.session_id), after_s=0.4 if message.session_id == "other" else 0)

    trunk, channel = await connect(script)
    with pytest.raises(TransportError, match="no reply within"):
        await channel.request(OpenSession(request_id=1), timeout_s=0.1)
    # a control request in flight when the late SessionOpened arrives takes its own answer, not that one
    closed, _ = await channel.request(CloseSession("other"), timeout_s=5.0)
    assert closed == SessionClosed("other")
    for _ in range(200):
        if CloseSession("s1") in trunk.received:
            break
        await asyncio.sleep(0.01)
    assert CloseSession("s1") in trunk.received  # the session nobody waited for is closed on the trunk


async def test_an_open_refused_while_a_close_waits_gets_its_refusal(connect: Connect) -> None:
    """An open's refusal names nothing; a CloseSession in flight beside it must not take it (the open then waited
    its whole timeout, and the close's own answer was dropped as nobody's)."""

    async def script(ws: ServerConnection, message: Message) -> None:
        if isinstance(message, OpenSession):
            await _reply(ws, Error(SessionQuotaExceeded.code, "quota"), after_s=0.2)
        elif isinstance(message, CloseSession):
            await _reply(ws, SessionClosed(message.session_id), after_s=0.4)

    _, channel = await connect(script)
    opening = asyncio.ensure_future(channel.request(OpenSession(request_id=1), timeout_s=2.0))
    await asyncio.sleep(0.05)
    closing = asyncio.ensure_future(channel.request(CloseSession("s-a"), timeout_s=2.0))
    with pytest.raises(SessionQuotaExceeded):
        await opening
    closed, _ = await closing
    assert closed == SessionClosed("s-a")


async def test_a_late_close_refusal_is_not_an_open_sessions_refusal(connect: Connect) -> None:
    async def script(ws: ServerConnection, message: Message) -> None:
        if isinstance(message, CloseSession):  # refused, naming its session, after the edge stopped waiting
            await _reply(ws, Error(UnknownSession.code, "gone", message.session_id), after_s=0.3)
        elif isinstance(message, OpenSession):  # answered after the late refusal
            await _reply(ws, SessionOpened(message.request_id, "fresh"), after_s=0.5)

    _, channel = await connect(script)
    with pytest.raises(TransportError, match="no reply within"):
        await channel.request(CloseSession("s-a"), timeout_s=0.1)
    opened, _ = await channel.request(OpenSession(request_id=1), timeout_s=5.0)
    assert opened == SessionOpened(1, "fresh")


async def test_a_late_close_answer_is_not_the_next_closes_answer(connect: Connect) -> None:
    """A close that timed out is answered (SessionClosed naming its session) while the next close waits: that
    answer is the first close's, late; the second close takes its own (here, a refusal naming its session)."""

    async def script(ws: ServerConnection, message: Message) -> None:
        if isinstance(message, CloseSession) and message.session_id == "a":
            await _reply(ws, SessionClosed("a"), after_s=0.3)
        elif isinstance(message, CloseSession):
            await _reply(ws, Error(UnknownSession.code, "no such session", message.session_id), after_s=0.6)

    _, channel = await connect(script)
    with pytest.raises(TransportError, match="no reply within"):
        await channel.request(CloseSession("a"), timeout_s=0.1)
    with pytest.raises(UnknownSession, match="no such session"):  # was: SessionClosed("a") returned to this close
        await channel.request(CloseSession("b"), timeout_s=3.0)


async def test_a_late_close_refusal_is_not_the_next_closes_answer(connect: Connect) -> None:
    """The same with the late answer a refusal naming the first close's session and no step (no seq)."""

    async def script(ws: ServerConnection, message: Message) -> None:
        if isinstance(message, CloseSession) and message.session_id == "a":
            await _reply(ws, Error(UnknownSession.code, "gone", "a"), after_s=0.3)
        elif isinstance(message, CloseSession):
            await _reply(ws, SessionClosed(message.session_id), after_s=0.6)

    _, channel = await connect(script)
    with pytest.raises(TransportError, match="no reply within"):
        await channel.request(CloseSession("a"), timeout_s=0.1)
    closed, _ = await channel.request(CloseSession("b"), timeout_s=3.0)  # was: UnknownSession("gone") raised here
    assert closed == SessionClosed("b")
