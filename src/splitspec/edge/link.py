"""The edge's link to one trunk: a few WebSocket connections, each carrying many sessions at once.

A :class:`TrunkConnection` is one connection after its handshake, multiplexed
(:meth:`splitspec.transport.client.Channel.multiplex`): any number of its sessions' steps may be in
flight together, each reply matched to its step by session id and sequence number.

A :class:`TrunkLink` is the pool an engine uses: it opens a session on a live connection with room
(at most ``sessions_per_connection`` each, the trunk's per-connection quota) and opens another
connection when all are full. A connection emptied of its sessions stays open for
``idle_connection_s`` (the last one stays open), so the next burst of sequences finds it ready
instead of paying a handshake's round trips. A connection that breaks fails every exchange in
flight on it with :class:`~splitspec.exceptions.TransportError`; each affected sequence then
recovers on its own (a new session, on whatever connection has room), and sequences on other
connections see nothing.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable

from splitspec.edge.config import EdgeConfig
from splitspec.exceptions import (
    HandshakeMismatch,
    ProtocolError,
    SessionQuotaExceeded,
    TransportError,
    UnexpectedMessage,
)
from splitspec.protocol.messages import CloseSession, Hello, OpenSession, SessionOpened, Welcome
from splitspec.protocol.trunk_fingerprint import TrunkFingerprint, check_trunk
from splitspec.transport.client import Channel

log = logging.getLogger(__name__)


class TrunkConnection:
    """One multiplexed connection to the trunk past its handshake, and the sessions it holds."""

    def __init__(self, channel: Channel, welcome: Welcome, config: EdgeConfig, conn_id: int) -> None:
        self.channel = channel
        self.welcome = welcome
        self.config = config
        self.conn_id = conn_id
        self.sessions: set[str] = set()  # sessions this connection holds
        self.opening = 0  # sessions being opened on it now (they count against its room)
        self.full = False  # the trunk refused another session here (its per-connection quota)
        self.idle_timer: asyncio.TimerHandle | None = None  # closes it once it has been empty idle_connection_s
        self._request_ids = itertools.count(1)
        channel.multiplex()

    @property
    def alive(self) -> bool:
        return self.channel.alive

    @property
    def max_message_bytes(self) -> int:
        """The smaller of the two sides' frame caps, bytes."""
        return min(self.welcome.max_message_bytes, self.config.max_message_bytes)

    async def open_session(self) -> str:
        opened, _ = await self.channel.request(
            OpenSession(request_id=next(self._request_ids)), self.config.request_timeout_s
        )
        if not isinstance(opened, SessionOpened):
            raise UnexpectedMessage(f"expected SessionOpened, got {opened.TYPE!r}")
        self.sessions.add(opened.session_id)
        return opened.session_id

    async def close_session(self, session_id: str, timeout_s: float = 5.0) -> None:
        self.sessions.discard(session_id)
        self.full = False
        await self.channel.request(CloseSession(session_id), timeout_s)

    async def close(self) -> None:
        await self.channel.close()


class TrunkLink:
    """The pool of connections an engine's sequences share to one trunk."""

    def __init__(
        self,
        config: EdgeConfig,
        hello: Hello,
        expected: TrunkFingerprint,
        source: str,
        follow_dtype: Callable[[str], Hello] | None = None,
    ) -> None:
        """``follow_dtype`` gets each Welcome's dtype and returns the Hello for the next connections
        (:meth:`splitspec.edge.runtime.EdgeRuntime.follow_trunk_dtype`)."""
        self.config = config
        self.hello = hello
        self._follow_dtype = follow_dtype
        self.expected = expected  # the trunk fingerprint every connection's Welcome must carry
        self.source = source  # where ``expected`` comes from, for the refusal's message
        self.connections: list[TrunkConnection] = []
        self._connecting: dict[asyncio.Task[TrunkConnection], int] = {}  # connections being opened -> sessions waiting
        self._ids = itertools.count()
        self._closing: set[asyncio.Task[None]] = set()  # idle connections and abandoned sessions being closed
        self._dialing: set[asyncio.Task[TrunkConnection]] = set()  # every connect() running, waited for or not

    async def connect(self) -> TrunkConnection:
        """A new connection past its handshake (the trunk fingerprint checked)."""
        cfg = self.config
        channel = await Channel.connect(
            cfg.cloud_url,
            max_message_bytes=cfg.max_message_bytes,
            timeout_s=cfg.connect_timeout_s,
            ca_file=cfg.tls_ca_file,
        )
        try:
            welcome, _ = await channel.request(self.hello, cfg.request_timeout_s)
            if not isinstance(welcome, Welcome):
                raise UnexpectedMessage(f"expected a Welcome, got {welcome.TYPE!r}")
            check_trunk(self.expected, welcome.trunk, self.source)
            if welcome.wire_codec != self.hello.wire_codec:
                raise HandshakeMismatch(
                    f"wire codec: edge sends {self.hello.wire_codec!r}, trunk answered {welcome.wire_codec!r}"
                )
            if self._follow_dtype is not None:
                self.hello = self._follow_dtype(welcome.dtype)
        except BaseException:
            await channel.close()
            raise
        conn = TrunkConnection(channel, welcome, cfg, next(self._ids))
        self.connections.append(conn)
        log.debug("connection %d to %s open", conn.conn_id, cfg.cloud_url)
        return conn

    def _with_room(self) -> TrunkConnection | None:
        self.connections = [c for c in self.connections if c.alive or c.sessions]
        cap = self.config.sessions_per_connection
        room = [c for c in self.connections if c.alive and not c.full and len(c.sessions) + c.opening < cap]
        return min(room, key=lambda c: len(c.sessions) + c.opening, default=None)

    async def _connection_with_room(self) -> TrunkConnection:
        """A connection with room for one more session, which is reserved on it (``opening``).

        A burst of new sequences shares the connections being opened: each one that is still
        connecting takes ``sessions_per_connection`` of them, so a burst of 16 opens 4 connections
        at once instead of one after another (each handshake costs round trips).
        """
        while True:
            conn = self._with_room()
            if conn is not None:
                return self._reserve(conn)
            waiting = [
                t
                for t in self._connecting
                if not t.done() and self._connecting[t] < self.config.sessions_per_connection
            ]
            if waiting:
                task = waiting[0]
                self._connecting[task] += 1
            else:
                task = asyncio.get_running_loop().create_task(self.connect())
                self._connecting[task] = 1
                self._dialing.add(task)  # until it ends: close() must end it even once nobody waits for it
                task.add_done_callback(self._dialing.discard)
            try:
                conn = await asyncio.shield(task)
            except asyncio.CancelledError:
                self._connecting.pop(task, None)
                current = asyncio.current_task()
                if task.cancelled() and (current is None or not current.cancelling()):
                    # close() ended the connection being opened: this request failed, nobody cancelled it
                    raise TransportError("the link to the trunk was closed") from None
                raise
            except BaseException:
                self._connecting.pop(task, None)
                raise
            self._connecting.pop(task, None)
            if conn.alive and not conn.full and len(conn.sessions) + conn.opening < self.config.sessions_per_connection:
                return self._reserve(conn)

    @staticmethod
    def _reserve(conn: TrunkConnection) -> TrunkConnection:
        """One session's room on ``conn``, which is no longer idle."""
        conn.opening += 1
        if conn.idle_timer is not None:
            conn.idle_timer.cancel()
            conn.idle_timer = None
        return conn

    async def open_session(self) -> tuple[TrunkConnection, str]:
        """A new session, on a connection with room (a new connection when none has)."""
        while True:
            conn = await self._connection_with_room()
            try:
                return conn, await conn.open_session()
            except SessionQuotaExceeded:
                if not conn.sessions:
                    raise  # even an empty connection may not open one: the trunk's address quota
                conn.full = True  # the trunk's quota is below ours: use another connection
            finally:
                conn.opening -= 1

    async def close_session(self, conn: TrunkConnection, session_id: str) -> None:
        """Close a session (best effort: a lost connection has lost it already), and the connection once idle."""
        if conn.alive:
            try:
                await conn.close_session(session_id)
            except (ProtocolError, TransportError) as exc:
                log.debug("closing session %s: %s", session_id, exc)
        conn.sessions.discard(session_id)
        if conn.sessions or conn.opening:
            return
        if not conn.alive or (len(self.connections) > 1 and self.config.idle_connection_s == 0):
            await self._drop(conn)
        elif len(self.connections) > 1 and conn.idle_timer is None:
            conn.idle_timer = asyncio.get_running_loop().call_later(
                self.config.idle_connection_s, self._drop_if_idle, conn
            )

    def _drop_if_idle(self, conn: TrunkConnection) -> None:
        """The idle timer: close ``conn`` if it is still empty and not the last connection."""
        conn.idle_timer = None
        if conn.sessions or conn.opening or conn not in self.connections or len(self.connections) < 2:
            return
        # out of the list now, not when the close task runs: timers firing in the same tick would each
        # still count the others and close the last connection too
        self.connections.remove(conn)
        task = asyncio.get_running_loop().create_task(self._drop(conn))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def abandon(self, conn: TrunkConnection, session_id: str, wait_s: float = 0.0) -> None:
        """A session the edge gives up (its cache no longer matches the edge's, or the trunk lost it): closed on
        the trunk in the background while the connection lives, so its KV memory is freed now rather than at its
        time-to-live (a session the trunk lost answers the close with an error, logged); forgotten otherwise.

        ``wait_s`` > 0: wait up to that long for the trunk's answer to the close (the close goes on in the
        background past it). A recovery waits, so that the session it opens next is not refused by the trunk's
        session limits while the trunk still counts the one given up."""
        if not conn.alive:
            conn.sessions.discard(session_id)
            if not conn.sessions:
                await self._drop(conn)
            return
        task = asyncio.get_running_loop().create_task(self.close_session(conn, session_id))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)
        if wait_s > 0:
            await asyncio.wait({task}, timeout=wait_s)  # neither a timeout nor our cancellation cancels the close

    async def _drop(self, conn: TrunkConnection) -> None:
        if conn.idle_timer is not None:
            conn.idle_timer.cancel()
            conn.idle_timer = None
        if conn in self.connections:
            self.connections.remove(conn)
        await conn.close()

    async def close(self) -> None:
        """Close every connection, those still being opened included (an open waiting for one fails with
        :class:`~splitspec.exceptions.TransportError`): a connection finishing its handshake after this would
        join a closed link, its socket and reader never closed. A later open connects afresh."""
        while self._dialing:
            dialing = list(self._dialing)
            for task in dialing:
                task.cancel()
            await asyncio.gather(*dialing, return_exceptions=True)
        for conn in list(self.connections):
            await self._drop(conn)
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)
