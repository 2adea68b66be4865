"""The choices of one request: ``n`` per prompt, each its own :class:`Generation`, in index order.

Choice i of a request with ``seed`` s samples with seed s + i, so choices differ from each other
and a repeated request repeats them; a seeded sample decodes one token per round trip (speculation
would make the random draws depend on what the link measured before). Logits processors (the
grammar, ``logit_bias``, ``allowed_token_ids``, ``min_tokens``, the penalties) are made afresh for every choice.
Replies go through :class:`~splitspec.serve.tool_parsers.ToolCallStream` when the request has tools, so a
streamed reply and a whole one carry the same calls and content. Each :class:`Item` carries the
tokens behind its text (with their logprobs when asked): an echoed prompt its prompt tokens, a
piece of content the tokens that released it; tokens that released no content of their own (held
by the tool-call parser, a stop token) go with the next item, at the latest the choice's last.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from splitspec.decoding.adjusters import AllowedTokens, BadWords, LogitBias, MinTokens, Penalties, RepetitionPenalty
from splitspec.decoding.grammar import GrammarCompiler
from splitspec.decoding.loop import Emitted
from splitspec.decoding.processors import LogitsProcessor, ProcessorChain
from splitspec.decoding.sampling import SamplingParams
from splitspec.serve import schemas
from splitspec.serve.engine import Generation
from splitspec.serve.errors import invalid
from splitspec.serve.sampling_defaults import SamplingDefaults
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
    echo: str = ""  # text before the reply's: a completion's echoed prompt, a chat's echoed last message (vLLM's)
    tool_format: Format | None = None
    tools: dict[str, dict[str, Any]] = field(default_factory=dict)
    parallel: bool = True
    call_finish: FinishReason = "tool_calls"  # a reply that ends with calls ("stop" under a named tool_choice)
    logprobs: int | None = None  # alternatives per generated token; None: no logprobs
    prompt_logprobs: int | None = None  # alternatives scored for the prompt's tokens (echo's logprobs, vLLM's field)
    min_tokens: int = 0  # vLLM's: no stop token, and no stop string ending, in the first this many
    continues_prompt: bool = False  # a completion: its text is decoded after the prompt's (a chat reply: alone)
    include_stop: bool = False  # vLLM's include_stop_str_in_output: the stop string that ends the text stays in it
    skip_special: bool = True  # vLLM's skip_special_tokens: special tokens' text left out


@dataclass
class Item:
    """One thing a choice produces: an event (text or a tool call) and/or, last, its finish reason."""

    index: int
    job: Job
    event: Event | None = None
    finish: FinishReason | None = None
    tokens: list[Emitted] = field(default_factory=list)  # the tokens behind this item, in order
    prompt: bool = False  # the echoed prompt (its first token has no logprob)


@dataclass
class Tally:
    """Usage over all choices (a prompt counted once however many choices it has)."""

    prompt: int = 0
    completion: int = 0
    cached: int = 0

    def usage(self, running: int = 0) -> dict[str, Any]:
        return schemas.usage(self.prompt, self.completion + running, self.cached)


def sampling(body: schemas.GenerationRequest, defaults: SamplingDefaults) -> SamplingParams:
    """The request's sampling: what it sent, else the server's defaults (serve/sampling_defaults.py)."""
    return defaults.params(body.temperature, body.top_p, body.top_k, body.seed, body.min_p)


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
    defaults: SamplingDefaults,
    bad_words: Sequence[Sequence[int]] = (),
) -> Callable[[], LogitsProcessor | None]:
    """A factory of the request's logits processors (one set per choice), in vLLM's order (the allowed tokens, the
    bad words, the bias, the repetition penalty, OpenAI's penalties); 400 for bad values. ``bad_words``: the token
    sequences of :func:`bad_word_ids`."""
    bias = {int(k): v for k, v in (body.logit_bias or {}).items()}
    if any(t >= vocab_size for t in bias):
        raise invalid(f"logit_bias keys must be token ids in 0..{vocab_size - 1}", "logit_bias")
    allowed = body.allowed_token_ids
    if allowed is not None and any(not 0 <= t < vocab_size for t in allowed):
        raise invalid(f"allowed_token_ids must be token ids in 0..{vocab_size - 1}", "allowed_token_ids")
    presence, frequency = body.presence_penalty or 0.0, body.frequency_penalty or 0.0
    repetition = defaults.repetition_penalty if body.repetition_penalty is None else body.repetition_penalty

    def make() -> LogitsProcessor | None:
        chain: list[LogitsProcessor] = []
        if allowed is not None:
            chain.append(AllowedTokens(allowed, vocab_size))
        if bad_words:
            chain.append(BadWords(bad_words))
        if bias:
            chain.append(LogitBias(bias, vocab_size))
        if repetition != 1.0:
            chain.append(RepetitionPenalty(repetition))
        if presence or frequency:
            chain.append(Penalties(presence, frequency))
        if body.min_tokens:
            chain.append(MinTokens(body.min_tokens, stops))
        if grammar is not None:  # last: nothing after it may re-allow what it forbids
            chain.append(compiler().processor(grammar, stops))
        return None if not chain else chain[0] if len(chain) == 1 else ProcessorChain(chain)

    return make


def bad_word_ids(encode: Callable[[str], list[int]], words: Sequence[str]) -> list[list[int]]:
    """vLLM's token sequences for ``bad_words``: each word as it is (leading spaces dropped), and again after a space
    where that starts with another token and is as long (a word inside a sentence rather than at its start)."""
    out: list[list[int]] = []
    for word in words:
        alone, spaced = encode(word.lstrip()), encode(" " + word.lstrip())
        if alone:  # a text that encodes to nothing bans nothing
            out.append(alone)
        if spaced and alone and spaced[0] != alone[0] and len(spaced) == len(alone):
            out.append(spaced)
    return out


def trimmed(entries: list[Emitted], alternatives: int | None) -> list[Emitted]:
    """``entries`` with at most ``alternatives`` each (the prompt is scored for the larger of two asks)."""
    keep = alternatives or 0
    return [e if len(e.top) <= keep else dataclasses.replace(e, top=e.top[:keep]) for e in entries]


@dataclass
class Choice:
    index: int
    text: str
    finish: FinishReason
    calls: list[ToolCall]
    tokens: list[Emitted] = field(default_factory=list)  # echoed prompt tokens first, then the generated ones
    prompt: list[Emitted] = field(default_factory=list)  # the scored prompt (its first token unscored), when asked


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
                          self.disconnected, job.make_processor(), speculate, job.logprobs,
                          job.prompt_logprobs, job.min_tokens, job.continues_prompt, job.include_stop,
                          job.skip_special)  # fmt: skip

    @staticmethod
    def runs(job: Job) -> bool:
        """Whether the job needs the model: it generates, or its echoed prompt needs logprobs."""
        return job.max_tokens > 0 or job.prompt_logprobs is not None

    async def first(self) -> None:
        """Start the first generation now, so a full pool or a dead trunk is an HTTP status."""
        if self.runs(self.jobs[0]):
            self.current = self.generation(self.jobs[0], 0)
            await self.current.start()

    async def events(self) -> AsyncIterator[Item]:
        """Every choice's items in index order, each choice ending with an item carrying its finish reason."""
        for j, job in enumerate(self.jobs):
            for i in range(self.n):
                index = j * self.n + i
                if not self.runs(job):  # max_tokens 0: the echoed prompt alone, no model needed
                    if job.echo:
                        yield Item(index, job, Event(content=job.echo), prompt=True)
                    yield Item(index, job, finish="length")
                    continue
                gen = self.current if index == 0 and self.current is not None else self.generation(job, i)
                if gen is not self.current:
                    self.current = gen
                    await gen.start()
                if job.echo or job.prompt_logprobs is not None:
                    yield Item(index, job, Event(content=job.echo), tokens=gen.prompt_entries, prompt=True)
                parser = ToolCallStream(job.tool_format, job.tools, job.parallel) if job.tool_format else None
                held: list[Emitted] = []  # tokens whose text produced no item yet
                async with aclosing(gen.pieces()) as pieces:
                    async for piece in pieces:
                        held += piece.tokens
                        if parser is None and not piece.text:
                            continue  # tokens without text (the end of a stop string): with the last item
                        for event in parser.feed(piece.text) if parser else [Event(content=piece.text)]:
                            yield Item(index, job, event, tokens=held)
                            held = []
                for event in parser.finish() if parser else []:
                    yield Item(index, job, event, tokens=held)
                    held = []
                out = gen.outcome
                self.tally.completion += out.completion_tokens
                if i == 0:  # the prompt counts once, so do its reused tokens
                    self.tally.cached += out.cached_tokens
                self.current = None  # counted: no longer running
                # a reply cut by max_tokens says "length" even after complete calls (vLLM's rule): it did not end
                called = parser is not None and bool(parser.calls) and out.finish_reason == "stop"
                finish = job.call_finish if called else out.finish_reason
                yield Item(index, job, finish=finish, tokens=held)
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
        async for item in self.events():
            choice = choices.setdefault(item.index, Choice(item.index, "", "length", []))
            if item.prompt:
                choice.prompt = list(item.tokens)
            if not item.prompt or (item.job.continues_prompt and item.job.echo):  # a completion's echo leads
                choice.tokens += trimmed(item.tokens, item.job.logprobs) if item.prompt else item.tokens
            if item.event is not None:
                choice.text += item.event.content
                if item.event.call is not None:
                    choice.calls.append(item.event.call)
            if item.finish is not None:
                choice.finish = item.finish
        return [choices[i] for i in sorted(choices)]
