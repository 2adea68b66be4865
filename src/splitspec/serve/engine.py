"""One request's generation: take a session, prefill what the cloud lacks, stream text deltas.

``start`` acquires a session and runs the prefill up to the first token, so that an unreachable
trunk or a full pool is an HTTP error status, not a broken stream. ``deltas`` then yields text as
it becomes safe to show (see :mod:`splitspec.serve.text`) until a stop token, a stop string or the
token limit; the session goes back to the pool's prefix cache, or is closed at once if the
request failed or the HTTP client went away.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass

from splitspec.decoding.processors import LogitsProcessor
from splitspec.decoding.sampling import SamplingParams
from splitspec.exceptions import SplitspecError
from splitspec.serve.errors import ApiError, api_error_for
from splitspec.serve.pool import Lease
from splitspec.serve.schemas import FinishReason
from splitspec.serve.state import ServeState
from splitspec.serve.text import StopTextStream

log = logging.getLogger(__name__)


@dataclass
class Outcome:
    prompt_tokens: int
    cached_tokens: int = 0  # prompt tokens reused from a kept session (not sent again)
    completion_tokens: int = 0
    finish_reason: FinishReason = "length"


class Generation:
    def __init__(
        self,
        state: ServeState,
        prompt_ids: Sequence[int],
        max_tokens: int,
        params: SamplingParams,
        stops: Sequence[str],
        stop_token_ids: frozenset[int],
        disconnected: Callable[[], Awaitable[bool]],
        processor: LogitsProcessor | None = None,
        speculate: str | None = None,
    ) -> None:
        """``processor``: a grammar, logit_bias, penalties (decodes one token per round trip);
        ``speculate``: overrides the server's mode for this request (``off`` for a seeded sample)."""
        self.state = state
        self.prompt_ids = list(prompt_ids)
        self.max_tokens = max_tokens
        self.params = params
        self.text = StopTextStream(state.decode, stops)
        self.stop_token_ids = stop_token_ids  # end the reply (finish_reason "stop"), not shown
        self.disconnected = disconnected  # polled between tokens: the HTTP client went away
        self.processor = processor
        self.speculate = speculate if speculate is not None else state.config.speculate
        self.outcome = Outcome(prompt_tokens=len(self.prompt_ids))
        self._t0 = time.perf_counter()
        self._t_first = 0.0
        self._lease: Lease | None = None
        self._tokens: AsyncIterator[int] | None = None
        self._first = -1

    async def start(self) -> None:
        """Take a session and run the prefill; raises :class:`ApiError` (429, 503, ...)."""
        try:
            self._lease = await self.state.pool.acquire(self.prompt_ids)
        except SplitspecError as exc:
            raise self._failed(exc) from exc
        lease = self._lease
        self.outcome.cached_tokens = lease.reused
        self.state.metrics.active.set(self.state.pool.active)
        self._tokens = lease.client.stream(
            self.prompt_ids[lease.reused :],
            self.max_tokens,
            self.params,
            stop_token_ids=self.stop_token_ids,
            generator=lease.client.runtime.generator(self.params)[0],  # where the edge's logits live
            speculate=self.speculate,
            fresh=lease.reused == 0,
            processor=self.processor,
        )
        try:
            self._first = await anext(self._tokens)
        except BaseException as exc:
            await self._finish(healthy=False)
            if isinstance(exc, SplitspecError):
                raise self._failed(exc) from exc
            raise
        self._t_first = time.perf_counter()
        self.state.metrics.ttft.observe(self._t_first - self._t0)

    async def deltas(self) -> AsyncGenerator[str, None]:
        """Text deltas until the generation ends; the session is given back however it ends."""
        if self._tokens is None:
            raise RuntimeError("start() first")
        healthy = False
        try:
            token = self._first
            while True:
                self.outcome.completion_tokens += 1
                delta = self.text.push(token)
                if delta:
                    yield delta
                done = self.processor is not None and self.processor.finished  # a grammar complete
                if token in self.stop_token_ids or self.text.stopped or done:
                    self.outcome.finish_reason = "stop"
                    break
                if self.outcome.completion_tokens >= self.max_tokens:
                    break
                if await self.disconnected():
                    log.info("client went away after %d tokens: closing its session", self.outcome.completion_tokens)
                    return
                try:
                    token = await anext(self._tokens)
                except SplitspecError as exc:
                    raise self._failed(exc) from exc
            tail = self.text.flush()
            if tail:
                yield tail
            healthy = True
        finally:
            await self._finish(healthy)

    async def close(self) -> None:
        """Give the session back as failed if ``deltas`` never ran to its end (a no-op otherwise)."""
        await self._finish(healthy=False)

    async def _finish(self, healthy: bool) -> None:
        if self._lease is None:
            return
        lease, self._lease = self._lease, None
        if self._tokens is not None:
            await self._tokens.aclose()  # type: ignore[attr-defined]
        client, m = lease.client, self.state.metrics
        m.observe_steps(client.steps)
        decode_steps = sum(s.kind == "decode" for s in client.steps)
        client.steps.clear()  # a kept session must not accumulate per-step records
        if client.recoveries:
            m.recoveries.inc(client.recoveries)
            client.recoveries = 0
        self.state.pool.release(lease, healthy)
        m.active.set(self.state.pool.active)
        m.idle.set(len(self.state.pool.cache))
        if healthy:
            out = self.outcome
            m.prompt_tokens.inc(out.prompt_tokens)
            m.cached_tokens.inc(out.cached_tokens)
            m.completion_tokens.inc(out.completion_tokens)
            if decode_steps:
                m.tokens_per_trip.observe((out.completion_tokens - 1) / decode_steps)
            elapsed = time.perf_counter() - self._t_first
            if out.completion_tokens > 1 and elapsed > 0:
                m.decode_rate.observe((out.completion_tokens - 1) / elapsed)

    def _failed(self, exc: SplitspecError) -> ApiError:
        """The HTTP error for a failed generation, counted here: a stream reports it in-band."""
        log.warning("request failed: %s: %s", type(exc).__name__, exc)
        err = api_error_for(exc)
        self.state.metrics.errors.labels(err.code or err.type).inc()
        err.counted = True
        return err
