"""Sessions: one KV cache per edge generation, owned by the connection that opened it.

The store bounds what sessions may hold in three ways: a session count (all connections, per
connection, per remote address), an idle TTL, and a KV memory budget in bytes. Before a step
grows a cache, :meth:`SessionStore.reserve` accounts the bytes the cache will hold after it, and holds them
until the step ends (:meth:`SessionStore.release`), so that steps queued or computing together cannot each
count on the same free bytes; when the budget would overflow it evicts idle sessions, least recently used
first (their edges replay their history on a fresh session, as after a TTL expiry), and when nothing is
evictable it refuses the step with :class:`~splitspec.exceptions.CapacityExceeded` and a retry-after hint.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from splitspec.exceptions import CapacityExceeded, SessionQuotaExceeded, TooManySessions, UnknownSession
from splitspec.models.kv_cache import KV_BLOCK_TOKENS, KVCache, KVLedger

log = logging.getLogger(__name__)

MIN_RETRY_AFTER_S = 0.05  # shortest retry-after hint sent with a capacity refusal, seconds


@dataclass
class Session:
    session_id: str
    owner: int  # id of the connection that opened it
    address: str = "?"  # the owner's remote IP address
    cache: KVCache = field(default_factory=KVCache)
    last_used: float = field(default_factory=time.monotonic)  # monotonic seconds
    busy: bool = False  # a step is queued or computing; never swept or evicted meanwhile
    opened_at: float = field(default_factory=time.monotonic)  # monotonic seconds
    steps: int = 0  # steps served
    tokens: int = 0  # query tokens served
    bytes_in: int = 0  # request frame bytes of its steps
    bytes_out: int = 0  # reply frame bytes of its steps
    compute_ms: float = 0.0  # trunk compute of its steps, milliseconds
    reserved_bytes: int = 0  # while a step is in flight: its cache's size once the step ran, bytes (see reserve)
    step: asyncio.Future[Any] | None = None  # the compute of its step in flight (closing the session cancels it)


@dataclass(frozen=True)
class KVBudget:
    """The trunk's KV memory budget: ``budget_bytes`` in all, ``bytes_per_token`` per cache entry
    (2 x trunk layers x kv heads x head dim x dtype bytes); sessions idle for ``evict_idle_s`` or
    longer may be evicted to make room. Caches grow in blocks of ``block_tokens`` entries."""

    budget_bytes: int
    bytes_per_token: int
    evict_idle_s: float = 1.0
    block_tokens: int = KV_BLOCK_TOKENS

    def bytes_at(self, capacity_tokens: int) -> int:
        return capacity_tokens * self.bytes_per_token


class SessionStore:
    """All live sessions of a server: count limits, idle expiry and the KV budget."""

    def __init__(
        self,
        max_sessions: int,
        ttl_s: float,
        max_per_owner: int | None = None,
        max_per_address: int | None = None,
        budget: KVBudget | None = None,
        new_cache: Callable[[], KVCache] | None = None,
    ) -> None:
        """``new_cache`` makes each session's cache (None: growable in the budget's blocks; static buffers
        with ``--compile``)."""
        self.max_sessions = max_sessions
        self.new_cache = new_cache
        self.max_per_owner = max_sessions if max_per_owner is None else max_per_owner
        self.max_per_address = max_sessions if max_per_address is None else max_per_address
        self.ttl_s = ttl_s
        self.budget = budget
        self.evictions = 0  # sessions evicted to make room, since start
        self._sessions: dict[str, Session] = {}
        self._ledger = KVLedger()  # the live caches' bytes, kept as they grow: read in O(1) on every step
        self._reserved: dict[str, Session] = {}  # sessions whose step in flight holds a reservation

    def __len__(self) -> int:
        return len(self._sessions)

    def busy(self) -> int:
        """Sessions with a step queued or computing right now."""
        return sum(s.busy for s in self._sessions.values())

    def kv_bytes(self) -> int:
        """KV memory the live sessions hold (their caches' capacity), bytes."""
        return self._ledger.nbytes

    def open(self, owner: int, address: str = "?") -> Session:
        if len(self._sessions) >= self.max_sessions:
            raise TooManySessions(f"the server already holds its maximum of {self.max_sessions} sessions")
        if sum(s.owner == owner for s in self._sessions.values()) >= self.max_per_owner:
            raise SessionQuotaExceeded(f"this connection already holds its maximum of {self.max_per_owner} sessions")
        if sum(s.address == address for s in self._sessions.values()) >= self.max_per_address:
            raise SessionQuotaExceeded(f"your address already holds its maximum of {self.max_per_address} sessions")
        if self.new_cache is not None:
            cache = self.new_cache()
        else:
            cache = KVCache(self.budget.block_tokens if self.budget is not None else KV_BLOCK_TOKENS)
        cache.attach(self._ledger)
        session = Session(session_id=secrets.token_hex(8), owner=owner, address=address, cache=cache)
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

    def account_bytes(self, session_id: str, owner: int, bytes_in: int, bytes_out: int) -> None:
        """Add one step's frame sizes to the session's totals (if it is still live and ``owner``'s)."""
        session = self._sessions.get(session_id)
        if session is not None and session.owner == owner:
            session.bytes_in += bytes_in
            session.bytes_out += bytes_out

    def reserve(self, session: Session, entries: int, now: float | None = None) -> None:
        """Make room for ``session``'s cache to hold ``entries`` entries, evicting idle sessions LRU first.

        Raises :class:`CapacityExceeded` (nothing changed) when the budget cannot take it: with a
        retry-after hint when other sessions will become evictable, without one when the session
        alone would exceed the whole budget.
        """
        budget = self.budget
        if budget is None:
            return
        now = time.monotonic() if now is None else now
        needed = budget.bytes_at(session.cache.capacity_after(entries))
        if needed > budget.budget_bytes:
            raise CapacityExceeded(
                f"a cache of {entries} entries needs {needed / 2**20:.1f} MiB, more than the whole KV budget "
                f"of {budget.budget_bytes / 2**20:.1f} MiB"
            )
        if needed <= session.cache.nbytes:  # the step fits in the buffers the cache holds: nothing to add
            return
        # the other sessions' bytes, and what their steps in flight reserved and have not grown into yet
        held = self._ledger.nbytes - session.cache.nbytes + self._unmaterialised(session)
        if held + needed <= budget.budget_bytes:  # the common case
            self._hold(session, needed)
            return
        others = [s for s in self._sessions.values() if s is not session]
        idle = sorted(
            (s for s in others if not s.busy and s.cache.nbytes and now - s.last_used >= budget.evict_idle_s),
            key=lambda s: s.last_used,
        )
        victims: list[Session] = []
        for candidate in idle:
            if held + needed <= budget.budget_bytes:
                break
            victims.append(candidate)
            held -= candidate.cache.nbytes
        if held + needed > budget.budget_bytes:
            # when a session not evictable now may become so: an idle one once it has idled long enough, a busy one
            # at the earliest that long after this moment (its step ends later); those evictable now did not suffice
            waits = [
                budget.evict_idle_s if s.busy else s.last_used + budget.evict_idle_s - now
                for s in others
                if s.cache.nbytes and (s.busy or now - s.last_used < budget.evict_idle_s)
            ]
            raise CapacityExceeded(
                f"the KV budget of {budget.budget_bytes / 2**20:.1f} MiB is full and no session is idle enough "
                "to evict",
                retry_after_s=max(MIN_RETRY_AFTER_S, min(waits, default=MIN_RETRY_AFTER_S)),
            )
        for victim in victims:
            self.evictions += 1
            self.close(victim.session_id, "evicted: the KV budget is full")
        self._hold(session, needed)

    def _unmaterialised(self, session: Session) -> int:
        """Bytes the other sessions' steps in flight reserved that their caches do not hold yet."""
        return sum(max(0, s.reserved_bytes - s.cache.nbytes) for s in self._reserved.values() if s is not session)

    def _hold(self, session: Session, needed: int) -> None:
        session.reserved_bytes = needed
        self._reserved[session.session_id] = session

    def release(self, session: Session) -> None:
        """``session``'s step in flight ended (it ran, failed or was cancelled): its reservation goes."""
        session.reserved_bytes = 0
        self._reserved.pop(session.session_id, None)

    def close(self, session_id: str, reason: str) -> None:
        """Close a session; a step of it in flight is cancelled (nobody waits for its reply: its chunks stop)."""
        session = self._sessions.pop(session_id, None)
        self._reserved.pop(session_id, None)
        if session is not None:
            if session.step is not None:
                session.step.cancel()
            session.cache.detach()
            log.info(
                "session %s closed (%s, %d live) %s",
                session_id,
                reason,
                len(self._sessions),
                json.dumps(
                    {
                        "session": session_id,
                        "reason": reason,
                        "address": session.address,
                        "seconds": round(time.monotonic() - session.opened_at, 3),
                        "steps": session.steps,
                        "tokens": session.tokens,
                        "cache_entries": len(session.cache),
                        "kv_bytes": session.cache.nbytes,
                        "bytes_in": session.bytes_in,
                        "bytes_out": session.bytes_out,
                        "compute_ms": round(session.compute_ms, 3),
                        "live": len(self._sessions),
                    }
                ),
            )

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
