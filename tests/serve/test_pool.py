"""The session pool's admission: slots, the queue wait and its 429."""

from __future__ import annotations

import asyncio
import time
from typing import cast

import pytest

from splitspec.edge.client import SplitClient
from splitspec.serve.errors import ApiError
from splitspec.serve.pool import SessionPool
from splitspec.serve.prefix_cache import PrefixCache


class _Client:
    history: tuple[int, ...] = ()
    edge_cache_bytes = 0

    async def connect(self) -> None:
        pass

    async def close(self) -> None:
        pass


def _pool(max_active: int, queue_timeout_s: float) -> SessionPool:
    cache: PrefixCache[SplitClient] = PrefixCache(max_entries=0, max_edge_bytes=0)
    return SessionPool(lambda: cast(SplitClient, _Client()), max_active, queue_timeout_s, cache)


def test_queue_timeout_zero_admits_while_slots_are_free_and_refuses_at_once_when_full() -> None:
    """``serve --queue-timeout 0`` used to answer every request 429: wait_for(acquire, 0) cancels even
    an acquire that would succeed at once."""

    async def main() -> None:
        pool = _pool(max_active=4, queue_timeout_s=0)
        leases = [await pool.acquire([1, 2, 3]) for _ in range(4)]
        assert pool.active == 4
        start = time.monotonic()
        with pytest.raises(ApiError) as busy:
            await pool.acquire([1, 2, 3])
        assert time.monotonic() - start < 0.5
        assert busy.value.status == 429
        assert busy.value.code == "server_busy"
        assert pool.active == 4
        pool.release(leases[0], healthy=False)
        again = await pool.acquire([4])  # a slot came free: admitted at once
        assert pool.active == 4
        for lease in [*leases[1:], again]:
            pool.release(lease, healthy=False)
        await pool.close()
        assert pool.active == 0

    asyncio.run(asyncio.wait_for(main(), 5))


def test_a_positive_queue_timeout_waits_then_refuses() -> None:
    async def main() -> None:
        pool = _pool(max_active=1, queue_timeout_s=0.05)
        lease = await pool.acquire([1])
        with pytest.raises(ApiError) as busy:
            await pool.acquire([1])
        assert busy.value.status == 429
        pool.release(lease, healthy=False)
        pool.release(await pool.acquire([1]), healthy=False)
        await pool.close()

    asyncio.run(asyncio.wait_for(main(), 5))
