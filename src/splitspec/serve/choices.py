"""The choices of one request: ``n`` per prompt, each its own :class:`Generation`, in index order.

Choice i of a request with ``seed`` s samples with seed s + i, so choices differ from each other
and a repeated request repeats them; a seeded sample decodes one token per round trip (speculation
would make the random draws depend on what the link measured before). Logits processors (the
grammar, ``logit_bias``, ``min_tokens``, penalties) are made afresh for every choice. Replies go
through :class:`~splitspec.serve.tool_parsers.ToolCallStream` when the request has tools, so a
streamed reply and a whole one carry the same calls and content.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from splitspec.decoding.adjusters import LogitBias, MinTokens, Penalties
from splitspec.decoding.grammar import GrammarCompiler
from splitspec.decoding.processors import LogitsProcessor, ProcessorChain
from splitspec.decoding.sampling import SamplingParams
from splitspec.serve import schemas
from splitspec.serve.engine import Generation
from splitspec.serve.errors import invalid
from splitspec.serve.schemas import FinishReason
from splitspec.serve.state import ServeState
from splitspec.serve.tool_parsers import Event, Format, ToolCall, ToolCallStream


@dataclass
class Job:
    """What every choice of one prompt shares."""

    prompt_ids: list[int]
    max_tokens: int
    params: SamplingParams
    stops: list[str]
    stop_ids: frozenset[int]
    make_processor: Callable[[], LogitsProcessor | None]
    echo: str = ""  # completions with echo: the prompt's text, before the completion's
    tool_format: Format | None = None
    tools: dict[str, dict[str, Any]] = field(default_factory=dict)
    parallel: bool = True


@dataclass
class Tally:
    """Usage over all choices (a prompt counted once however many choices it has)."""

    prompt: int = 0
    completion: int = 0
    cached: int = 0

    def usage(self, running: int = 0) -> dict[str, Any]:
        return schemas.usage(self.prompt, self.completion + running, self.cached)


def sampling(body: schemas.GenerationRequest) -> SamplingParams:
    top_k = body.top_k if body.top_k is not None and body.top_k > 0 else 0
    temperature = 1.0 if body.temperature is None else body.temperature
    top_p = 1.0 if body.top_p is None else body.top_p
    return SamplingParams(temperature=temperature, top_p=top_p, seed=body.seed, top_k=top_k)


def stop_ids(body: schemas.GenerationRequest, default: frozenset[int], vocab_size: int) -> frozenset[int]:
    extra = frozenset(body.stop_token_ids or ())
    if any(not 0 <= t < vocab_size for t in extra):
        raise invalid(f"stop_token_ids must be token ids in 0..{vocab_size - 1}", "stop_token_ids")
    return extra if body.ignore_eos else default | extra


def processors(
    body: schemas.GenerationRequest,
    grammar: str | None,
    stops: frozenset[int],
    vocab_size: int,
    compiler: Callable[[], GrammarCompiler],
) -> Callable[[], LogitsProcessor | None]:
    """A factory of the request's logits processors (one set per choice); 400 for bad values."""
    bias = {int(k): v for k, v in (body.logit_bias or {}).items()}
    if any(t >= vocab_size for t in bias):
        raise invalid(f"logit_bias keys must be token ids in 0..{vocab_size - 1}", "logit_bias")
    presence, frequency = body.presence_penalty or 0.0, body.frequency_penalty or 0.0

    def make() -> LogitsProcessor | None:
        chain: list[LogitsProcessor] = []
        if bias:
            chain.append(LogitBias(bias, vocab_size))
        if presence or frequency:
            chain.append(Penalties(presence, frequency))
        if body.min_tokens:
            chain.append(MinTokens(body.min_tokens, stops))
        if grammar is not None:  # last: nothing after it may re-allow what it forbids
            chain.append(compiler().processor(grammar, stops))
        return None if not chain else chain[0] if len(chain) == 1 else ProcessorChain(chain)

    return make


@dataclass
class Choice:
    index: int
    text: str
    finish: FinishReason
    calls: list[ToolCall]


class Runner:
    """Runs the choices of one request one after another (``n`` per job, jobs in order)."""

    def __init__(self, state: ServeState, jobs: list[Job], n: int, disconnected: Callable[[], Awaitable[bool]]) -> None:
        self.state, self.jobs, self.n, self.disconnected = state, jobs, n, disconnected
        self.tally = Tally(prompt=sum(len(j.prompt_ids) for j in jobs))
        self.current: Generation | None = None

    def generation(self, job: Job, i: int) -> Generation:
        params = job.params
        seeded = params.seed is not None
        if seeded:
            params = dataclasses.replace(params, seed=params.seed + i)  # type: ignore[operator]
        speculate = "off" if seeded and not params.greedy else None
        return Generation(self.state, job.prompt_ids, job.max_tokens, params, job.stops, job.stop_ids,
                          self.disconnected, job.make_processor(), speculate)  # fmt: skip

    async def first(self) -> None:
        """Start the first generation now, so a full pool or a dead trunk is an HTTP status."""
        if self.jobs[0].max_tokens > 0:
            self.current = self.generation(self.jobs[0], 0)
            await self.current.start()

    async def events(self) -> AsyncIterator[tuple[int, Job, Event | None, FinishReason | None]]:
        """(choice index, its job, an event or None, finish reason on the choice's last item)."""
        for j, job in enumerate(self.jobs):
            for i in range(self.n):
                index = j * self.n + i
                if job.echo:
                    yield index, job, Event(content=job.echo), None
                if job.max_tokens == 0:
                    yield index, job, None, "length"
                    continue
                gen = self.current if index == 0 and self.current is not None else self.generation(job, i)
                if gen is not self.current:
                    self.current = gen
                    await gen.start()
                parser = ToolCallStream(job.tool_format, job.tools, job.parallel) if job.tool_format else None
                async with aclosing(gen.deltas()) as deltas:
                    async for delta in deltas:
                        for event in parser.feed(delta) if parser else [Event(content=delta)]:
                            yield index, job, event, None
                for event in parser.finish() if parser else []:
                    yield index, job, event, None
                out = gen.outcome
                self.tally.completion += out.completion_tokens
                if i == 0:  # the prompt counts once, so do its reused tokens
                    self.tally.cached += out.cached_tokens
                self.current = None  # counted: no longer running
                finish: FinishReason = "tool_calls" if parser and parser.calls else out.finish_reason
                yield index, job, None, finish
                if await self.disconnected():  # the generation stopped early: start no more choices
                    return

    def running(self) -> int:
        """Completion tokens of the choice in progress (for usage on every chunk)."""
        return self.current.outcome.completion_tokens if self.current is not None else 0

    async def close(self) -> None:
        if self.current is not None:
            await self.current.close()

    async def collect(self) -> list[Choice]:
        """Every choice, whole."""
        choices: dict[int, Choice] = {}
        async for index, _, event, finish in self.events():
            choice = choices.setdefault(index, Choice(index, "", "length", []))
            if event is not None:
                choice.text += event.content
                if event.call is not None:
                    choice.calls.append(event.call)
            if finish is not None:
                choice.finish = finish
        return [choices[i] for i in sorted(choices)]
