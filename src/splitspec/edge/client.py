"""The split client: one sequence of split inference and its generation API.

:class:`SplitClient` is a :class:`~splitspec.decoding.generate.Verifier` over one
:class:`~splitspec.edge.sequence.EdgeSequence` of an :class:`~splitspec.edge.engine.EdgeEngine`:
``forward(tokens)`` embeds the tokens, runs the edge's head layers, sends the hidden states to the
cloud, runs the tail layers on what comes back and returns logits (batched with every other
sequence of the engine stepping at the same time). When the cloud loses the session (TTL expiry,
eviction, restart, a failed step) the engine opens a new one and replays the sequence's history;
the caller sees the same logits as if nothing had happened. ``stream`` and ``generate`` run the
decoding loops (sequential, or speculative with the adaptive controller) over it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable, Collection, Sequence
from dataclasses import asdict, dataclass, field
from types import TracebackType
from typing import Any

import torch

from splitspec.decoding.controller import SpeculationController
from splitspec.decoding.loop import Emitted, PromptLogprobs, decode
from splitspec.decoding.processors import LogitsProcessor
from splitspec.decoding.sampling import SamplingParams
from splitspec.decoding.speculative import SpecStep, make_drafters
from splitspec.edge.config import EdgeConfig
from splitspec.edge.engine import EdgeEngine
from splitspec.edge.provenance import EdgeProvenance
from splitspec.edge.runtime import EdgeRuntime, expected_trunk
from splitspec.edge.sequence import StepStats
from splitspec.measure import median
from splitspec.models.split import SplitPlan
from splitspec.models.stack import EdgeModel, FullModel
from splitspec.protocol.messages import Hello
from splitspec.protocol.trunk_fingerprint import TrunkFingerprint

__all__ = ["GenerationResult", "SplitClient", "StepStats", "expected_trunk"]

log = logging.getLogger(__name__)

_HEADER_RESERVE = 2048  # bytes kept free in every step frame for the prefix and JSON header
MAX_CAPACITY_BACKOFF_S = 5.0  # longest wait between two tries of a step the trunk refused for capacity, seconds


@dataclass
class GenerationResult:
    """Tokens produced by one generation and what each step cost."""

    prompt_ids: list[int]
    token_ids: list[int]
    seed: int
    wall_s: float  # whole generation including prefill, seconds
    steps: list[StepStats] = field(default_factory=list)
    recoveries: int = 0
    speculate: str = "off"  # the --speculate mode used
    spec_steps: list[SpecStep] = field(default_factory=list)  # per step, when speculating

    @property
    def decode_steps(self) -> list[StepStats]:
        return [s for s in self.steps if s.kind == "decode"]

    def summary(self) -> dict[str, Any]:
        """Medians of the per-step figures over decode steps, and totals."""
        decode = self.decode_steps

        def step_median(key: str) -> float:
            return median((float(getattr(s, key)) for s in decode), empty=0.0)

        decode_tokens = len(self.token_ids) - 1  # the first token comes from the prefill
        return {
            "speculate": self.speculate,
            "tokens_per_decode_step": decode_tokens / len(decode) if decode else 0.0,
            "new_tokens": len(self.token_ids),
            "wall_s": self.wall_s,
            "tokens_per_s": len(self.token_ids) / self.wall_s if self.wall_s > 0 else 0.0,
            "steps": len(self.steps),
            "recoveries": self.recoveries,
            "median_step_ms": {k: step_median(k) for k in ("network_ms", "edge_ms", "cloud_ms", "serialize_ms")},
            "median_bytes": {k: step_median(k) for k in ("bytes_up", "bytes_down")},
            "total_bytes": {
                "up": sum(s.bytes_up for s in self.steps),
                "down": sum(s.bytes_down for s in self.steps),
            },
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "prompt_ids": self.prompt_ids,
            "token_ids": self.token_ids,
            "seed": self.seed,
            "summary": self.summary(),
            "steps": [asdict(s) for s in self.steps],
            "spec_steps": [asdict(s) for s in self.spec_steps],
        }


class SplitClient:
    """One sequence of split inference, with the generation API. Use as ``async with SplitClient(cfg) as client``.

    Alone (the CLI's ``generate``, a test) it loads an :class:`EdgeRuntime` and runs an
    :class:`EdgeEngine` of its own. Given a shared ``runtime`` and ``engine`` (``splitspec serve``),
    it is just one more :class:`EdgeSequence` of that engine: no weights loaded, no connection of
    its own, and its steps batched with every other sequence's.
    """

    def __init__(
        self,
        config: EdgeConfig,
        edge: EdgeModel | None = None,
        draft_model: FullModel | None = None,
        controller: SpeculationController | None = None,
        *,
        runtime: EdgeRuntime | None = None,
        engine: EdgeEngine | None = None,
    ) -> None:
        """``edge`` and ``draft_model``: already loaded weights to use (they hold no per-sequence
        state); ``controller``: the speculation controller to use (default: the sequence's own,
        sharing the engine's step-time estimates)."""
        if engine is not None:
            runtime = engine.runtime
        self.runtime = runtime if runtime is not None else EdgeRuntime(config, edge, draft_model)
        self.config = self.runtime.config
        self._owns_engine = engine is None
        self.engine = engine if engine is not None else EdgeEngine(self.runtime)
        self.sequence = self.engine.new_sequence()
        self._step_limit: int | None = None  # the last session's step limit, kept while a recovery is pending
        self.sequence.controller = controller

    # -- what the runtime holds ------------------------------------------------------------------

    @property
    def model(self) -> EdgeModel:
        return self.runtime.model

    @property
    def draft_model(self) -> FullModel | None:
        return self.runtime.draft_model

    @property
    def dtype(self) -> torch.dtype:
        return self.runtime.dtype

    @property
    def device(self) -> torch.device:
        return self.runtime.device

    @property
    def hello(self) -> Hello:
        return self.runtime.hello

    @property
    def plan(self) -> SplitPlan:
        return self.runtime.plan

    @property
    def provenance(self) -> EdgeProvenance:
        return self.runtime.provenance

    @property
    def max_positions(self) -> int:
        return self.runtime.max_positions

    @property
    def cache_size(self) -> int | None:
        return self.runtime.cache_size

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.runtime.eos_token_ids

    @property
    def expected_trunk(self) -> TrunkFingerprint:
        return self.runtime.expected_trunk

    # -- what the sequence holds -----------------------------------------------------------------

    @property
    def steps(self) -> list[StepStats]:
        return self.sequence.steps

    @property
    def recoveries(self) -> int:
        return self.sequence.recoveries

    @recoveries.setter
    def recoveries(self, value: int) -> None:
        self.sequence.recoveries = value

    @property
    def capacity_waits(self) -> int:
        return self.sequence.capacity_waits

    @property
    def session_id(self) -> str | None:
        return self.sequence.session_id

    @property
    def history(self) -> tuple[int, ...]:
        """The token ids behind every committed cache entry, in order (what the caches hold)."""
        return tuple(self.sequence.tokens)

    @property
    def edge_cache_bytes(self) -> int:
        """Memory held by this sequence's edge KV caches (head and tail), bytes."""
        return self.sequence.edge_cache_bytes

    # -- connection ----------------------------------------------------------------------------

    async def __aenter__(self) -> SplitClient:
        await self.connect()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def connect(self) -> None:
        """Open this sequence's cloud session (connecting and handshaking first if the engine has no room)."""
        await self.engine.open(self.sequence)

    async def close(self) -> None:
        await self.engine.release(self.sequence)
        if self._owns_engine:
            await self.engine.close()

    @property
    def server_headers(self) -> dict[str, str]:
        """The current connection's WebSocket upgrade answer headers, names lower-cased (empty when not connected).

        Behind Ray Serve, ``x-splitspec-replica`` names the replica serving this connection.
        """
        conn = self.sequence.connection
        return {} if conn is None else conn.channel.response_headers

    @property
    def chunk_tokens(self) -> int:
        """Most query tokens one step may carry without hitting either side's caps."""
        return self.engine.chunk_tokens(self.sequence)

    def max_step_tokens(self) -> int | None:
        """:attr:`chunk_tokens` while a session is open, else the last session's (its recovery is pending: the
        next step opens a session on the same trunk), None before any: what ``decode`` keeps a draft tree
        within (a tree, unlike a chain, cannot be split across steps)."""
        if self.sequence.connection is not None:
            self._step_limit = self.engine.chunk_tokens(self.sequence)
        return self._step_limit

    # -- the verifier interface ------------------------------------------------------------------

    def reset(self) -> None:
        """Start a new sequence: the cloud cache is truncated on the next step."""
        self.sequence.reset()

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` committed tokens on both sides (prefix reuse across chat turns)."""
        self.sequence.truncate(length)

    def keep(self, indices: Sequence[int]) -> None:
        """Keep only ``indices`` of the last step's entries (the accepted path), on both sides."""
        self.sequence.keep(indices)

    async def forward(
        self,
        tokens: Sequence[int],
        parents: Sequence[int] | None = None,
        logits_from: int = 0,
        *,
        sent: Callable[[], None] | None = None,
    ) -> torch.Tensor:
        """Run ``tokens`` (a chain unless ``parents`` says otherwise) -> logits (q - logits_from, V) float32;
        ``sent()`` once the head forward ran and the step goes to the trunk."""
        return await self.engine.forward(self.sequence, tokens, parents, logits_from, sent=sent)

    def sampling(
        self,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        seed: int | None = None,
        min_p: float | None = None,
    ) -> SamplingParams:
        """Sampling as the checkpoint publishes it (generation_config.json), with the values given here overriding it.

        What :meth:`generate` and :meth:`stream` use when given no ``params``, and what the CLI's
        ``--temperature/--top-p/--top-k/--seed/--min-p`` build; see :mod:`splitspec.decoding.published`.
        """
        return self.runtime.sampling(temperature, top_p, top_k, seed, min_p)

    @property
    def default_sampling(self) -> SamplingParams:
        """:meth:`sampling` with no overrides (worked out once)."""
        return self.runtime.default_sampling

    def check_length(self, prompt_tokens: int, max_new_tokens: int, context_tokens: int = 0) -> None:
        """Refuse a generation that could pass the model's maximum positions (see :meth:`EdgeRuntime.check_length`)."""
        self.runtime.check_length(prompt_tokens, max_new_tokens, context_tokens)

    # -- generation ------------------------------------------------------------------------------

    async def stream(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        params: SamplingParams | None = None,
        stop_token_ids: Collection[int] | None = None,
        generator: torch.Generator | None = None,
        speculate: str = "auto",
        trace: list[SpecStep] | None = None,
        fresh: bool = True,
        processor: LogitsProcessor | None = None,
    ) -> AsyncIterator[int]:
        """Yield new token ids as they are produced (:meth:`stream_tokens` without logprobs).

        ``processor`` (a grammar, logit_bias, penalties) sees every row of logits before a token is
        chosen from it; a draft loses the nodes whose path it forbids, so speculation goes on.
        """
        processors = () if processor is None else (processor,)
        async for emitted in self.stream_tokens(
            prompt_ids, max_new_tokens, params, stop_token_ids, generator, speculate, trace, fresh, processors
        ):
            yield emitted.token

    async def stream_tokens(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        params: SamplingParams | None = None,
        stop_token_ids: Collection[int] | None = None,
        generator: torch.Generator | None = None,
        speculate: str = "auto",
        trace: list[SpecStep] | None = None,
        fresh: bool = True,
        processors: Sequence[LogitsProcessor] = (),
        logprobs: int | None = None,
        prompt_logprobs: PromptLogprobs | None = None,
    ) -> AsyncIterator[Emitted]:
        """Yield new tokens as they are produced, with their logprobs when ``logprobs`` is not None.

        ``speculate``: ``off`` (one round trip per token) or a drafter (``ngram``,
        ``prompt-lookup``, ``draft``) or ``auto`` (the default, as the CLI's ``--speculate``); the
        adaptive controller then drafts only when it pays, and output is the same whatever the
        mode (greedy: token for token; sampling: in law).
        ``fresh=False`` appends ``prompt_ids`` to the sequence already in the caches instead of
        starting over (multi-turn chat); the last token generated before is not in the caches yet,
        so a continuation should start with it. ``processors`` see every row of logits before a
        token is chosen from it (see :mod:`splitspec.decoding.loop`); ``logprobs``: how many
        alternatives each token carries (0: its own logprob only); ``prompt_logprobs`` is filled
        with the prompt's own logprobs before the first token comes (give ``fresh=True`` for every
        prompt token to be scored: a continuation's history is not scored again).
        """
        params = params if params is not None else self.default_sampling
        if generator is None:
            generator, _ = self.runtime.generator(params)
        self.check_length(len(prompt_ids), max_new_tokens, 0 if fresh else len(self.sequence.tokens))
        stops = self.eos_token_ids if stop_token_ids is None else stop_token_ids
        # under processors, sampled drafts must be deterministic (q one-hot) for the acceptance rule to stay exact
        draft_params = SamplingParams() if processors else params
        runtime = self.runtime
        drafters = make_drafters(
            speculate, draft_params, self.draft_model, generator, runtime.draft_head, runtime.ends, self.sequence,
            self.config.draft_tree_width,
        )  # fmt: skip
        if "eagle" in drafters and fresh and runtime.draft_head is not None:
            self.sequence.reset()  # a new sequence keeps its tokens' features from the prefill on
            self.sequence.keep_features(runtime.draft_head.config.feature_layers)
        # the sequence's controller outlives one generation (a chat's turns): its acceptance estimates
        # are this conversation's; its step times are the engine's, shared by every sequence on the link
        controller = self.engine.controller(self.sequence, list(drafters)) if drafters else None
        history = None if fresh else list(self.sequence.tokens)
        executor = self.engine.draft_executor
        with executor.decoding():  # a lone sequence may judge dear drafters aside (decoding/aside.py)
            async for emitted in decode(
                self, prompt_ids, max_new_tokens, params, generator, drafters, controller, stops, trace, history,
                processors, logprobs, executor, prompt_logprobs,
            ):  # fmt: skip
                yield emitted

    async def generate(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        params: SamplingParams | None = None,
        stop_token_ids: Collection[int] | None = None,
        speculate: str = "auto",
        produced: list[int] | None = None,
        processor: LogitsProcessor | None = None,
    ) -> GenerationResult:
        """Generate and return the tokens with per-step figures (``processor``: as :meth:`stream`'s).

        ``params`` None: :attr:`default_sampling` (the checkpoint's published settings). Each new
        token is also appended to ``produced`` when given, so a caller still has every token
        produced (the last one included) when the generation fails midway.
        """
        params = params if params is not None else self.default_sampling
        generator, seed = self.runtime.generator(params)
        first_step, recoveries = len(self.steps), self.recoveries
        trace: list[SpecStep] = []
        t0 = time.perf_counter()
        tokens = produced if produced is not None else []
        async for token in self.stream(
            prompt_ids, max_new_tokens, params, stop_token_ids, generator, speculate, trace, processor=processor
        ):
            tokens.append(token)
        return GenerationResult(
            prompt_ids=list(prompt_ids),
            token_ids=list(tokens),
            seed=seed,
            wall_s=time.perf_counter() - t0,
            steps=self.steps[first_step:],
            recoveries=self.recoveries - recoveries,
            speculate=speculate,
            spec_steps=trace,
        )
