"""Issue #12 item 2: one connection can no longer take every session of the trunk."""

from __future__ import annotations

import pytest

from splitspec.cloud.sessions import SessionStore
from splitspec.exceptions import SessionQuotaExceeded, TooManySessions, error_from_code


def test_one_owner_cannot_take_every_session() -> None:
    store = SessionStore(max_sessions=64, ttl_s=60, max_per_owner=8)
    for _ in range(8):
        store.open(owner=1)
    with pytest.raises(SessionQuotaExceeded):
        store.open(owner=1)
    store.open(owner=2)  # another connection still gets one
    assert len(store) == 9


def test_the_quota_refusal_is_typed_and_crosses_the_wire() -> None:
    error = error_from_code(SessionQuotaExceeded.code, "x")
    assert isinstance(error, SessionQuotaExceeded)
    assert isinstance(error, TooManySessions)
