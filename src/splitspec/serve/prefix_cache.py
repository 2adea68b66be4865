"""Idle sessions kept for reuse, in an LRU keyed by the token sequence their caches hold.

A chat client resends the whole conversation every turn. The session whose cached tokens share
the longest common prefix with the new prompt is taken and truncated to that prefix (the edge
caches now, the cloud's on the next step), so only the new suffix crosses the WAN; an edited
conversation keeps what still matches. Bounded by count and by edge KV memory; what falls out
is returned to the caller, which closes its cloud session.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from splitspec.chat_template import plan_turn


class Reusable(Protocol):
    """What the cache needs of a session (:class:`~splitspec.edge.SplitClient` has it)."""

    @property
    def history(self) -> tuple[int, ...]: ...

    @property
    def edge_cache_bytes(self) -> int: ...

    def truncate(self, length: int) -> None: ...


C = TypeVar("C", bound=Reusable)


@dataclass(frozen=True)
class Taken(Generic[C]):
    client: C
    reused: int  # prompt tokens already in the client's caches (after the truncation)


class PrefixCache(Generic[C]):
    """LRU of idle sessions; most recently used last."""

    def __init__(self, max_entries: int, max_edge_bytes: int) -> None:
        self.max_entries = max_entries
        self.max_edge_bytes = max_edge_bytes
        self._idle: OrderedDict[int, C] = OrderedDict()

    def __len__(self) -> int:
        return len(self._idle)

    @property
    def edge_bytes(self) -> int:
        return sum(c.edge_cache_bytes for c in self._idle.values())

    def take(self, prompt: Sequence[int], reuse: bool = True) -> Taken[C] | None:
        """The idle session to run ``prompt`` on, truncated to what it can reuse; None: open a new one.

        With ``reuse`` the longest match wins (ties: the most recent). While the cache has room, a match that
        would keep less than half of that session's tokens is not taken: every chat shares a few header tokens
        with every other, and truncating another conversation's session to them would throw its turns away for
        nothing. Without a match, the least recently used session is recycled from scratch when the cache is
        full (its connection is kept; only its sequence is dropped). At least one prompt token is always left
        to run.
        """
        if not self._idle:
            return None
        best_key, best = None, 0
        if reuse:
            for key, client in reversed(self._idle.items()):
                n = plan_turn(client.history, prompt).keep
                if n > best:
                    best_key, best = key, n
        room = len(self._idle) < self.max_entries
        if best_key is not None and room and 2 * best < len(self._idle[best_key].history):
            return None  # another conversation's: keep it, open a session of our own
        if best_key is None:
            if reuse and room:
                return None
            best_key = next(iter(self._idle))
        client = self._idle.pop(best_key)
        client.truncate(best)
        return Taken(client, best)

    def put(self, client: C) -> list[C]:
        """Keep ``client`` as the most recent entry; return the entries evicted to stay in bounds (a client larger
        than the whole byte bound alone: it would have flushed every other entry, then itself)."""
        if client.edge_cache_bytes > self.max_edge_bytes:
            return [client]
        self._idle[id(client)] = client
        evicted = []
        while self._idle and (len(self._idle) > self.max_entries or self.edge_bytes > self.max_edge_bytes):
            evicted.append(self._idle.popitem(last=False)[1])
        return evicted

    def drain(self) -> list[C]:
        """Remove and return every idle entry."""
        out = list(self._idle.values())
        self._idle.clear()
        return out
