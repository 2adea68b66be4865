"""A bounded pool of cloud sessions: one :class:`SplitClient` per request in flight.

At most ``max_active`` requests generate at once. A request beyond that waits up to
``queue_timeout_s`` for a session to come free and then gets 429 with ``Retry-After`` (waiting
absorbs bursts; the bound keeps a flood from queueing forever); ``queue_timeout_s`` 0 queues
nothing: a free session at once, or 429 at once. A finished request's session goes
to the :class:`PrefixCache`; a failed or abandoned one (client disconnect, trunk error) is closed at
once in the background, so its cloud session is freed without waiting for the handler.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from splitspec.edge.client import SplitClient
from splitspec.serve.errors import server_busy
from splitspec.serve.prefix_cache import PrefixCache

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Lease:
    client: SplitClient
    reused: int  # prompt tokens already in the session's caches


class SessionPool:
    def __init__(
        self,
        new_client: Callable[[], SplitClient],
        max_active: int,
        queue_timeout_s: float,
        cache: PrefixCache[SplitClient],
        reuse: bool = True,
    ) -> None:
        self._new_client = new_client
        self.max_active = max_active
        self.queue_timeout_s = queue_timeout_s
        self.cache = cache
        self.reuse = reuse
        self._slots = asyncio.Semaphore(max_active)
        self._active = 0
        self._closing: set[asyncio.Task[None]] = set()

    @property
    def active(self) -> int:
        """Requests holding a session now."""
        return self._active

    async def acquire(self, prompt: Sequence[int], reuse: bool = True) -> Lease:
        """A connected session for ``prompt``; raises 429 after the queue wait, or the connect error.

        ``reuse=False``: no cached prefix is reused (a request that needs every prompt row computed,
        such as echo with logprobs); an idle session may still be recycled from scratch.
        """
        if self.queue_timeout_s <= 0:
            # no queueing (--queue-timeout 0): a free slot at once, or 429 at once. wait_for with a
            # zero timeout would cancel even an acquire that could succeed, refusing every request
            if self._slots.locked():
                raise server_busy(1)
            await self._slots.acquire()  # a slot is free: returns without suspending
        else:
            try:
                await asyncio.wait_for(self._slots.acquire(), self.queue_timeout_s)
            except TimeoutError:
                raise server_busy(max(1, round(self.queue_timeout_s))) from None
        self._active += 1
        try:
            taken = self.cache.take(prompt, self.reuse and reuse)
            if taken is not None:
                return Lease(taken.client, taken.reused)
            client = self._new_client()
            await client.connect()
            return Lease(client, 0)
        except BaseException:
            self._free_slot()
            raise

    def release(self, lease: Lease, healthy: bool) -> None:
        """Give the session back: kept for reuse if ``healthy``, else closed now."""
        self._free_slot()
        if healthy:
            for evicted in self.cache.put(lease.client):
                self._close_soon(evicted)
        else:
            self._close_soon(lease.client)

    async def close(self) -> None:
        """Close every idle session and wait for all closes in flight."""
        for client in self.cache.drain():
            self._close_soon(client)
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)

    def _free_slot(self) -> None:
        self._active -= 1
        self._slots.release()

    def _close_soon(self, client: SplitClient) -> None:
        # a task of its own: the caller may be a handler being cancelled (client disconnect)
        task = asyncio.get_running_loop().create_task(client.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)
