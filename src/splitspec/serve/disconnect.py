"""Whether the HTTP client went away, asked of the connection at most once per interval.

A generation asks between tokens whether its client is still there, and a speculative step
delivers several tokens at once. Starlette answers ``Request.is_disconnected`` by receiving from
the connection under a cancelled scope; asked per token, that was 8 % of the event loop's
interpreter time at 16 streams through ``splitspec serve`` (py-spy ``--gil``). :class:`DisconnectPoll`
asks the connection at most once per :data:`DISCONNECT_POLL_S` and answers from what it last
heard in between; once the client is gone it stays gone. A client that leaves costs at most one
interval more of generation before its session is closed.

Only a non-streamed generation is polled: a streamed one's ``StreamingResponse`` listens to its
connection and cancels the stream when the client leaves, which closes the generation.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

DISCONNECT_POLL_S = 0.05  # seconds between two questions to the connection, at least (under one round trip)


class DisconnectPoll:
    """An awaitable ``disconnected()`` over ``check`` (e.g. ``request.is_disconnected``), asked at most once per
    ``interval_s`` of ``clock`` (seconds)."""

    def __init__(
        self,
        check: Callable[[], Awaitable[bool]],
        interval_s: float = DISCONNECT_POLL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if interval_s < 0:
            raise ValueError(f"the polling interval must be >= 0 seconds, got {interval_s}")
        self._check = check
        self.interval_s = interval_s
        self._clock = clock
        self._next = -float("inf")  # when the connection may be asked again (clock seconds)
        self._gone = False

    async def __call__(self) -> bool:
        if self._gone:
            return True
        now = self._clock()
        if now < self._next:
            return False  # asked within the interval: still there then
        self._next = now + self.interval_s
        self._gone = await self._check()
        return self._gone
