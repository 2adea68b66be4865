"""Sessions: one KV cache per edge generation, owned by the connection that opened it."""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import dataclass, field

from splitspec.exceptions import SessionQuotaExceeded, TooManySessions, UnknownSession
from splitspec.models.kv_cache import KVCache

log = logging.getLogger(__name__)


@dataclass
class Session:
    session_id: str
    owner: int  # id of the connection that opened it
    cache: KVCache = field(default_factory=KVCache)
    last_used: float = field(default_factory=time.monotonic)  # monotonic seconds
    busy: bool = False  # a step is computing; never swept meanwhile


class SessionStore:
    """All live sessions of a server, with a max-sessions limit, a per-owner quota and idle expiry."""

    def __init__(self, max_sessions: int, ttl_s: float, max_per_owner: int | None = None) -> None:
        self.max_sessions = max_sessions
        self.max_per_owner = max_sessions if max_per_owner is None else max_per_owner
        self.ttl_s = ttl_s
        self._sessions: dict[str, Session] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    def busy(self) -> int:
        """Sessions with a step computing right now."""
        return sum(s.busy for s in self._sessions.values())

    def open(self, owner: int) -> Session:
        if len(self._sessions) >= self.max_sessions:
            raise TooManySessions(f"the server already holds its maximum of {self.max_sessions} sessions")
        if sum(s.owner == owner for s in self._sessions.values()) >= self.max_per_owner:
            raise SessionQuotaExceeded(f"this connection already holds its maximum of {self.max_per_owner} sessions")
        session = Session(session_id=secrets.token_hex(8), owner=owner)
        self._sessions[session.session_id] = session
        log.info("session %s opened (%d live)", session.session_id, len(self._sessions))
        return session

    def get(self, session_id: str, owner: int) -> Session:
        """The session, if it exists and belongs to ``owner``; foreign sessions look unknown."""
        session = self._sessions.get(session_id)
        if session is None or session.owner != owner:
            raise UnknownSession(f"no session {session_id!r} on this connection (expired, closed or never opened)")
        session.last_used = time.monotonic()
        return session

    def close(self, session_id: str, reason: str) -> None:
        if self._sessions.pop(session_id, None) is not None:
            log.info("session %s closed (%s, %d live)", session_id, reason, len(self._sessions))

    def close_owned_by(self, owner: int) -> None:
        for sid in [s.session_id for s in self._sessions.values() if s.owner == owner]:
            self.close(sid, "connection closed")

    def sweep(self, now: float | None = None) -> int:
        """Drop sessions idle for longer than the TTL; return how many."""
        now = time.monotonic() if now is None else now
        stale = [s.session_id for s in self._sessions.values() if not s.busy and now - s.last_used > self.ttl_s]
        for sid in stale:
            self.close(sid, f"idle > {self.ttl_s:g} s")
        return len(stale)
