"""One connection's request loop on a server, shared by the trunk server and the SpecFed worker.

Each received frame goes through the connection's :class:`~splitspec.protocol.state.HandshakeGate`,
is decoded, dispatched and its reply encoded. A failure becomes a typed ``Error`` reply by the one
refusal policy of :mod:`splitspec.protocol.replies`: a peer's fault is refused (and the connection
closed when it is fatal), a failure of ours is reported as ``server_error`` and the connection
stays up. Subclasses give the message family (decode / encode) and what each message does.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import ClassVar, Generic, TypeVar

from splitspec.exceptions import ProtocolError
from splitspec.protocol.messages import Error
from splitspec.protocol.replies import internal_error, refusal
from splitspec.protocol.state import HandshakeGate
from splitspec.transport.server import LogBudget

M = TypeVar("M")  # the message family a server speaks


class MessagePeer(ABC, Generic[M]):
    """A :class:`~splitspec.transport.server.Peer` for one message family, with the shared refusal policy."""

    label: ClassVar[str] = "connection"  # names the connection in logs
    concurrent: ClassVar[bool] = False  # past the handshake, frames may be served concurrently (see Peer)

    def __init__(self, gate: HandshakeGate, conn_id: int, remote: str) -> None:
        self.gate = gate
        self.conn_id = conn_id
        self.remote = remote
        self._log = logging.getLogger(type(self).__module__)
        self.log_budget = LogBudget()  # one connection's refusals cost a bounded number of log lines

    @property
    def ready(self) -> bool:
        """The connection has completed its handshake."""
        return self.gate.ready

    @abstractmethod
    def decode(self, data: bytes) -> M:
        """Parse one frame of the family; raise a ProtocolError for anything malformed."""

    @abstractmethod
    def encode(self, message: M | Error) -> bytes:
        """Serialize a reply (or a refusal)."""

    async def encode_reply(self, reply: M) -> bytes:
        """:meth:`encode` for a served reply; a subclass may move a big one off the event loop."""
        return self.encode(reply)

    @abstractmethod
    async def dispatch(self, message: M) -> M:
        """Serve one decoded message; return the reply."""

    @abstractmethod
    async def closed(self) -> None:
        """The connection is gone: release what it held."""

    def served(self, request: M | None, reply: M | Error, bytes_in: int, bytes_out: int) -> None:
        """Called after each reply is encoded (``request`` None: it could not be decoded); for accounting."""

    async def handle(self, data: bytes) -> tuple[bytes, bool]:
        """The reply frame to ``data`` and whether to close the connection after sending it."""
        message: M | None = None
        reply: M | Error
        try:
            self.gate.admit(data)  # before the handshake, nothing but a hello is decoded
            message = self.decode(data)
            reply = await self.dispatch(message)
            encoded = await self.encode_reply(reply)
            self.served(message, reply, len(data), len(encoded))
            return encoded, False
        except ProtocolError as exc:
            error = refusal(exc, message, ready=self.gate.ready, frame=data)
            if self.log_budget.take():
                self._log.info(
                    "%s %d (%s): refused %s: %s (%d more refusals not logged)",
                    *(self.label, self.conn_id, self.remote, exc.code, error.message, self.log_budget.skipped()),
                )
            encoded = self.encode(error)
            self.served(message, error, len(data), len(encoded))
            return encoded, error.fatal
        except Exception as exc:  # a bug of ours: report it, keep serving (closing before the handshake)
            if self.log_budget.take():
                skipped = self.log_budget.skipped()
                self._log.exception("%s %d: request failed (%d more not logged)", self.label, self.conn_id, skipped)
            error = internal_error(exc, message, ready=self.gate.ready, frame=data)
            encoded = self.encode(error)
            self.served(message, error, len(data), len(encoded))
            return encoded, error.fatal
