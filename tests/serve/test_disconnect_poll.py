"""The client's connection is asked whether it went away at most once per interval; gone stays gone."""

from __future__ import annotations

import pytest

from splitspec.serve.disconnect import DisconnectPoll


class Connection:
    """A fake ``request.is_disconnected``: counts the questions, answers ``gone``."""

    def __init__(self) -> None:
        self.asked = 0
        self.gone = False

    async def is_disconnected(self) -> bool:
        self.asked += 1
        return self.gone


async def test_the_connection_is_asked_at_most_once_per_interval() -> None:
    now = [100.0]
    conn = Connection()
    poll = DisconnectPoll(conn.is_disconnected, interval_s=0.05, clock=lambda: now[0])
    for _ in range(10):  # ten tokens of one step, at the same moment: one question
        assert await poll() is False
    assert conn.asked == 1
    now[0] += 0.049
    assert await poll() is False
    assert conn.asked == 1
    now[0] += 0.002  # the interval has passed
    assert await poll() is False
    assert conn.asked == 2


async def test_a_client_that_left_is_seen_within_one_interval_and_stays_gone() -> None:
    now = [0.0]
    conn = Connection()
    poll = DisconnectPoll(conn.is_disconnected, interval_s=0.05, clock=lambda: now[0])
    assert await poll() is False
    conn.gone = True
    assert await poll() is False  # within the interval: what was last heard
    now[0] += 0.05
    assert await poll() is True
    asked = conn.asked
    conn.gone = False  # whatever the connection says later, the client has gone
    now[0] += 1.0
    assert await poll() is True
    assert conn.asked == asked


async def test_interval_zero_asks_every_time() -> None:
    conn = Connection()
    poll = DisconnectPoll(conn.is_disconnected, interval_s=0.0, clock=lambda: 5.0)
    for _ in range(3):
        await poll()
    assert conn.asked == 3


def test_a_negative_interval_is_refused() -> None:
    with pytest.raises(ValueError, match="polling interval"):
        DisconnectPoll(Connection().is_disconnected, interval_s=-1)
