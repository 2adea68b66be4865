"""The session store's limits: counts per connection and per address (#12, #15), and the KV budget (#15)."""

from __future__ import annotations

import pytest
import torch

from splitspec.cloud.budget import available_memory_bytes, default_budget_bytes
from splitspec.cloud.sessions import KVBudget, Session, SessionStore
from splitspec.exceptions import CapacityExceeded, SessionQuotaExceeded, TooManySessions, error_from_code
from splitspec.models.kv_cache import KV_BLOCK_TOKENS

PER_TOKEN = 2 * 1 * 2 * 16 * 4  # one layer, 2 kv heads of 16, float32: 256 bytes an entry
SLAB = KV_BLOCK_TOKENS * PER_TOKEN  # the smallest cache allocation, one block: 4 KiB


def test_one_owner_cannot_take_every_session() -> None:
    store = SessionStore(max_sessions=64, ttl_s=60, max_per_owner=8)
    for _ in range(8):
        store.open(owner=1)
    with pytest.raises(SessionQuotaExceeded):
        store.open(owner=1)
    store.open(owner=2)  # another connection still gets one
    assert len(store) == 9


def test_one_address_cannot_take_every_session() -> None:
    store = SessionStore(max_sessions=64, ttl_s=60, max_per_owner=4, max_per_address=6)
    for owner in (1, 1, 1, 2, 2, 2):
        store.open(owner, "10.0.0.1")
    with pytest.raises(SessionQuotaExceeded, match="address"):
        store.open(3, "10.0.0.1")  # a fresh connection from the same address
    store.open(4, "10.0.0.2")


def test_the_quota_refusal_is_typed_and_crosses_the_wire() -> None:
    error = error_from_code(SessionQuotaExceeded.code, "x")
    assert isinstance(error, SessionQuotaExceeded)
    assert isinstance(error, TooManySessions)


def _filled(store: SessionStore, owner: int, entries: int, last_used: float) -> Session:
    session = store.open(owner)
    store.reserve(session, entries, now=last_used)
    session.cache.update(torch.zeros(1, 2, entries, 16), torch.zeros(1, 2, entries, 16), 0)
    session.cache.commit()
    session.last_used = last_used
    return session


def test_a_full_budget_evicts_the_least_recently_used_idle_session() -> None:
    store = SessionStore(64, ttl_s=600, budget=KVBudget(3 * SLAB, PER_TOKEN, evict_idle_s=1.0))
    old = _filled(store, 1, 10, last_used=100.0)  # the least recently used idle session
    newer = _filled(store, 2, 10, last_used=101.0)
    busy = _filled(store, 3, 10, last_used=50.0)  # the oldest, but computing: never evicted
    busy.busy = True
    assert store.kv_bytes() == 3 * SLAB
    fresh = store.open(4)
    store.reserve(fresh, 10, now=105.0)
    assert set(store._sessions) == {newer.session_id, busy.session_id, fresh.session_id}
    assert old.session_id not in store._sessions
    assert store.evictions == 1


def test_nothing_evictable_refuses_with_a_hint_and_too_big_refuses_without() -> None:
    store = SessionStore(64, ttl_s=600, budget=KVBudget(2 * SLAB, PER_TOKEN, evict_idle_s=1.0))
    a = _filled(store, 1, 10, last_used=100.0)
    _filled(store, 2, 10, last_used=100.5)
    fresh = store.open(3)
    with pytest.raises(CapacityExceeded) as refused:
        store.reserve(fresh, 10, now=100.25)  # both used less than a second ago
    assert refused.value.retry_after_s == pytest.approx(0.75)  # when the older one becomes evictable
    assert len(store) == 3
    with pytest.raises(CapacityExceeded) as never:
        store.reserve(a, 200, now=200.0)  # 208 entries alone exceed the budget
    assert never.value.retry_after_s is None
    store.reserve(a, KV_BLOCK_TOKENS, now=200.0)  # growing within its capacity needs nothing new


def test_the_default_budget_is_a_share_of_available_memory() -> None:
    cpu = torch.device("cpu")
    available = available_memory_bytes(cpu)
    assert available > 0
    assert 0 < default_budget_bytes([cpu]) <= available


def test_steps_in_flight_together_cannot_count_on_the_same_free_bytes() -> None:
    """Each step's reservation is held until it ends: the bytes reach the ledger only when a cache grows, on the
    compute thread, so prefills arriving together all passed a check against the same empty ledger."""
    store = SessionStore(64, ttl_s=600, budget=KVBudget(2 * SLAB, PER_TOKEN, evict_idle_s=1.0))
    a, b, c = store.open(1), store.open(2), store.open(3)
    store.reserve(a, 10, now=100.0)  # one block each: the budget holds two
    store.reserve(b, 10, now=100.0)
    with pytest.raises(CapacityExceeded):
        store.reserve(c, 10, now=100.0)  # nothing grown yet, and nothing idle to evict: no room
    store.release(a)  # a's step ended (failed before growing its cache)
    store.reserve(c, 10, now=100.0)
    assert a.reserved_bytes == 0
    assert c.reserved_bytes == SLAB


def test_a_step_within_its_caches_capacity_is_never_refused() -> None:
    store = SessionStore(64, ttl_s=600, budget=KVBudget(SLAB, PER_TOKEN, evict_idle_s=1.0))
    a = _filled(store, 1, 10, last_used=100.0)
    over = store.open(2)  # grown past the budget without a reservation (as before reservations were held)
    over.cache.update(torch.zeros(1, 2, 10, 16), torch.zeros(1, 2, 10, 16), 0)
    over.cache.commit()
    over.busy = True
    assert store.kv_bytes() == 2 * SLAB
    store.reserve(a, KV_BLOCK_TOKENS, now=100.5)  # fits a's buffers: it needs nothing new, whatever the ledger says


def test_another_connections_steps_do_not_count_in_a_sessions_bytes() -> None:
    store = SessionStore(64, ttl_s=600)
    mine = store.open(owner=1)
    store.account_bytes(mine.session_id, 2, 1000, 2000)  # a step of connection 2 naming it (refused as unknown)
    store.account_bytes(mine.session_id, 1, 10, 20)
    assert (mine.bytes_in, mine.bytes_out) == (10, 20)


def test_the_retry_hint_counts_only_sessions_that_may_become_evictable() -> None:
    """A busy session and one evictable already (which did not free enough) used to give the floor, 0.05 s."""
    store = SessionStore(64, ttl_s=600, budget=KVBudget(2 * SLAB, PER_TOKEN, evict_idle_s=1.0))
    busy = _filled(store, 1, 10, last_used=100.0)
    busy.busy = True  # idle-looking, but computing: not evictable until its step ends
    _filled(store, 2, 10, last_used=100.5)
    with pytest.raises(CapacityExceeded) as refused:
        store.reserve(store.open(3), 10, now=101.0)
    assert refused.value.retry_after_s == pytest.approx(0.5)  # when the second one has idled for 1 s
