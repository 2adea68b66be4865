"""The trunk's session store: idle expiry (sweep), ownership and the limits, without a server."""

from __future__ import annotations

import pytest
import torch

from splitspec.cloud.sessions import Session, SessionStore
from splitspec.exceptions import TooManySessions, UnknownSession


def test_sweep_drops_only_idle_sessions_past_the_ttl() -> None:
    store = SessionStore(max_sessions=4, ttl_s=10.0)
    idle, fresh, computing = store.open(owner=1), store.open(owner=1), store.open(owner=2)
    t0 = idle.last_used
    idle.last_used, fresh.last_used, computing.last_used = t0 - 11.0, t0 - 9.0, t0 - 60.0
    computing.busy = True  # a step is running: never swept, however old
    assert store.sweep(now=t0) == 1
    with pytest.raises(UnknownSession):
        store.get(idle.session_id, owner=1)
    assert store.get(fresh.session_id, owner=1) is fresh
    assert store.get(computing.session_id, owner=2) is computing
    assert store.sweep(now=t0) == 0  # `get` refreshed the survivors
    computing.busy = False
    assert store.sweep(now=computing.last_used + 10.5) == 2


def test_a_swept_slot_can_be_reused_and_foreign_ids_look_unknown() -> None:
    store = SessionStore(max_sessions=1, ttl_s=1.0)
    first = store.open(owner=1)
    with pytest.raises(TooManySessions):
        store.open(owner=2)
    with pytest.raises(UnknownSession):
        store.get(first.session_id, owner=2)  # another connection's id is refused like a missing one
    assert store.sweep(now=first.last_used + 2.0) == 1
    assert len(store) == 0
    second = store.open(owner=2)
    assert second.session_id != first.session_id


def test_the_kv_total_follows_growth_closes_and_a_cache_dropped_mid_step() -> None:
    """kv_bytes() is kept as caches grow (O(1) per step), not summed; it must equal the live caches' bytes."""
    store = SessionStore(max_sessions=4, ttl_s=10.0)
    a, b = store.open(owner=1), store.open(owner=1)

    def grow(session: Session, entries: int) -> None:  # what a step's forward does to the cache, per layer
        for layer in range(2):
            session.cache.update(torch.zeros(1, 2, entries, 4), torch.zeros(1, 2, entries, 4), layer)
        session.cache.commit()

    assert store.kv_bytes() == 0
    grow(a, 5)
    grow(b, 20)
    grow(a, 30)  # a second block-rounded growth copies into bigger buffers: the old ones are subtracted
    assert store.kv_bytes() == a.cache.nbytes + b.cache.nbytes > 0
    held_by_a = a.cache.nbytes
    store.close(b.session_id, "test")
    assert store.kv_bytes() == held_by_a
    grow(b, 40)  # its step was still computing when its connection went: the closed cache is not counted
    assert store.kv_bytes() == held_by_a
    store.close(a.session_id, "test")
    assert store.kv_bytes() == 0
