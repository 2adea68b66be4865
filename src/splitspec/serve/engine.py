"""One request's generation: take a session, prefill what the cloud lacks, stream text pieces.

``start`` acquires a session and runs the prefill up to the first token, so that an unreachable
trunk or a full pool is an HTTP error status, not a broken stream. ``pieces`` then yields text as
it becomes safe to show (see :mod:`splitspec.serve.text`) until a stop token, a stop string or the
token limit; the session goes back to the pool's prefix cache, or is closed at once if the
request failed or the HTTP client went away.

A speculative step's tokens go out as one piece (one SSE chunk), as vLLM streams a step's output:
fewer chunks for the server to send and the client to parse, with the same text and tokens.
Each :class:`Piece` carries the tokens (with their logprobs, when asked) consumed since the last
piece, so logprobs line up with the text they produced, as vLLM streams them: a token whose text
the stop-string scanner holds back rides with the piece that releases it, and the tokens that
release none (a stop token, the end of a stop string) come with the last piece. Every completion
token counted in ``usage`` has its entry. ``prompt_logprobs`` (echo with logprobs) scores every
prompt token on a session that reuses no cached prefix, so no row is skipped; with
``max_tokens`` 0 the generation is the prefill alone (the token it picks is not returned).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

from splitspec.decoding.loop import Emitted, PromptLogprobs
from splitspec.decoding.processors import LogitsProcessor
from splitspec.decoding.sampling import SamplingParams
from splitspec.detokenize import CONTEXT_TOKENS
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


@dataclass
class Piece:
    """Text safe to show, and the tokens consumed since the previous piece (in order)."""

    text: str
    tokens: list[Emitted] = field(default_factory=list)


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
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
        min_tokens: int = 0,
        continues_prompt: bool = False,
        include_stop: bool = False,
        skip_special: bool = True,
    ) -> None:
        """``processor``: a grammar, logit_bias, penalties (drafts are cut where it forbids a token);
        ``speculate``: overrides the server's mode for this request (``off`` for a seeded sample);
        ``logprobs``: alternatives per generated token (None: no logprobs); ``prompt_logprobs``: the
        same for the prompt's tokens (echo), which then runs on a session with no reused prefix;
        ``min_tokens``: a stop string ending in the first this many tokens does not stop the reply;
        ``continues_prompt``: the text is decoded after the prompt's last ids (a completion, whose text continues
        the prompt's: a SentencePiece word keeps its space), not alone (a chat reply, a message of its own);
        ``include_stop``: the stop string that ends the reply stays in its text (vLLM's include_stop_str_in_output);
        ``skip_special``: special tokens' text is left out (vLLM's skip_special_tokens; a stop token's always is)."""
        self.state = state
        self.prompt_ids = list(prompt_ids)
        self.max_tokens = max_tokens
        self.params = params
        context = self.prompt_ids[-CONTEXT_TOKENS:] if continues_prompt else []
        self.text = StopTextStream(
            partial(state.decode, skip_special=skip_special), stops, min_tokens, context, include_stop
        )
        self.stop_token_ids = stop_token_ids  # end the reply (finish_reason "stop"), not shown
        self.disconnected = disconnected  # polled between tokens: the HTTP client went away
        self.processor = processor
        self.speculate = speculate if speculate is not None else state.config.speculate
        self.logprobs = logprobs
        self._prompt = None if prompt_logprobs is None else PromptLogprobs(prompt_logprobs)
        self.prompt_entries: list[Emitted] = []  # echo with logprobs: the prompt, its first token unscored
        self.outcome = Outcome(prompt_tokens=len(self.prompt_ids))
        self._t0 = time.perf_counter()
        self._t_first = 0.0
        self._lease: Lease | None = None
        self._tokens: AsyncIterator[Emitted] | None = None
        self._first = Emitted(-1)

    async def start(self) -> None:
        """Take a session and run the prefill; raises :class:`ApiError` (429, 503, ...)."""
        try:
            self._lease = await self.state.pool.acquire(self.prompt_ids, reuse=self._prompt is None)
        except SplitspecError as exc:
            raise self._failed(exc) from exc
        lease = self._lease
        self.outcome.cached_tokens = lease.reused
        self.state.metrics.active.set(self.state.pool.active)
        try:  # from here on, however it fails, the session is given back
            self._tokens = lease.client.stream_tokens(
                self.prompt_ids[lease.reused :],
                max(1, self.max_tokens),  # max_tokens 0 (echo): the prefill alone, its token dropped
                self.params,
                stop_token_ids=self.stop_token_ids,
                generator=lease.client.runtime.generator(self.params)[0],  # where the edge's logits live
                speculate=self.speculate,
                fresh=lease.reused == 0,
                processors=() if self.processor is None else (self.processor,),
                logprobs=self.logprobs,
                prompt_logprobs=self._prompt,
            )
            self._first = await anext(self._tokens)
        except BaseException as exc:
            await self._finish(healthy=False)
            if isinstance(exc, SplitspecError):
                raise self._failed(exc) from exc
            raise
        if self._prompt is not None:
            self.prompt_entries = [Emitted(self.prompt_ids[0]), *self._prompt.entries]
        self._t_first = time.perf_counter()
        self.state.metrics.ttft.observe(self._t_first - self._t0)

    async def pieces(self) -> AsyncGenerator[Piece, None]:
        """Text pieces until the generation ends; the session is given back however it ends."""
        if self._tokens is None:
            raise RuntimeError("start() first")
        healthy = False
        if self.max_tokens == 0:  # the prompt alone: its logprobs came with the prefill
            await self._finish(healthy=True)
            return
        try:
            emitted = self._first
            held: list[Emitted] = []  # tokens whose text has not been sent yet
            text = ""  # their released text
            while True:
                token = emitted.token
                self.outcome.completion_tokens += 1
                held.append(emitted)
                if token in self.stop_token_ids:  # counted, its logprob kept, its text not shown (as vLLM)
                    self.outcome.finish_reason = "stop"
                    break
                text += self.text.push(token)
                if self.text.stopped:
                    self.outcome.finish_reason = "stop"
                    break
                if self.outcome.completion_tokens >= self.max_tokens:
                    break
                if not emitted.more:  # a step's tokens go out as one piece, as vLLM streams a speculative step
                    if text:
                        yield Piece(text, held)
                        held, text = [], ""
                    if await self.disconnected():
                        tokens = self.outcome.completion_tokens
                        log.info("client went away after %d tokens: closing its session", tokens)
                        return
                try:
                    emitted = await anext(self._tokens)
                except StopAsyncIteration:  # the decoder ends where a grammar completes, after its whole last step
                    self.outcome.finish_reason = "stop"
                    break
                except SplitspecError as exc:
                    raise self._failed(exc) from exc
            text += self.text.flush()
            if text or held:
                yield Piece(text, held)
            healthy = True
        finally:
            await self._finish(healthy)

    async def close(self) -> None:
        """Give the session back as failed if ``pieces`` never ran to its end (a no-op otherwise)."""
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
