"""The split client: edge head -> remote trunk -> edge tail, with recovery.

:class:`SplitClient` is a :class:`~splitspec.decoding.generate.Verifier`: ``forward(tokens)``
embeds the tokens, runs the edge's head layers, sends the hidden states to the cloud, runs the
tail layers on what comes back and returns logits. It keeps the token ids behind every cache
entry, so when the cloud loses the session (TTL expiry, restart, a failed step) it reconnects,
opens a new session and replays that history; the caller sees the same logits as if nothing had
happened. A forward is all or nothing on the edge: if any of its chunks fails, the edge forgets
the chunks that went through before recovering, so the retry never sends a token twice. A step
the trunk refuses for ``capacity`` (its KV budget is full) is sent again after the refusal's
retry-after hint, backing off.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Collection, Sequence
from dataclasses import asdict, dataclass, field
from types import TracebackType
from typing import Any

import torch

from splitspec.decoding.controller import SpeculationController
from splitspec.decoding.generate import decode_sequential
from splitspec.decoding.published import published_sampling, sampling_settings
from splitspec.decoding.sampling import SamplingParams
from splitspec.decoding.speculative import SpecStep, make_drafters, speculative_decode
from splitspec.devices import HostStaging, resolve_device
from splitspec.edge.config import EdgeConfig
from splitspec.edge.provenance import check_edge_weights, send_noise
from splitspec.exceptions import (
    BadTensor,
    CapacityExceeded,
    CheckpointError,
    ConfigError,
    HandshakeMismatch,
    ProtocolError,
    ServerError,
    TransportError,
    UnexpectedMessage,
    UnknownSession,
)
from splitspec.measure import median
from splitspec.models.checkpoint import Checkpoint, fingerprint, generation_stop_ids
from splitspec.models.kv_cache import KVCache
from splitspec.models.masks import chain, depths
from splitspec.models.split import SplitPlan
from splitspec.models.stack import EdgeModel, FullModel, load_edge, load_full, resolve_dtype
from splitspec.models.static_kv import StaticKVCache, static_cache_size
from splitspec.models.trunk_fingerprint import trunk_fingerprint
from splitspec.privacy.defences import add_send_noise, noise_for_tokens, prefix_digests
from splitspec.protocol.codec import WIRE_CODECS, wire_bytes_per_token
from splitspec.protocol.messages import (
    CacheCommand,
    CloseSession,
    Hello,
    Message,
    OpenSession,
    SessionOpened,
    Step,
    StepResult,
    Welcome,
)
from splitspec.protocol.trunk_fingerprint import TrunkFingerprint, check_trunk
from splitspec.transport.client import Channel, Exchange

log = logging.getLogger(__name__)

_HEADER_RESERVE = 2048  # bytes kept free in every step frame for the prefix and JSON header
MAX_CAPACITY_BACKOFF_S = 5.0  # longest wait between two tries of a step the trunk refused for capacity, seconds


@dataclass(frozen=True)
class StepStats:
    """What one round trip cost, as the edge saw it."""

    kind: str  # "prefill", "decode" or "replay"
    query_tokens: int  # tokens in the step
    network_ms: float  # round trip minus the cloud's compute, milliseconds
    edge_ms: float  # head + tail compute on the edge (kernels queued; see serialize_ms), milliseconds
    cloud_ms: float  # trunk compute reported by the cloud, milliseconds
    # copying the hidden state to the host and back + encoding the request + decoding the reply, on
    # the edge, milliseconds; on an accelerator the copy to the host also waits for the head's kernels
    serialize_ms: float
    bytes_up: int  # request frame, bytes
    bytes_down: int  # reply frame, bytes


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
    """Edge side of split inference. Use as ``async with SplitClient(cfg) as client``."""

    def __init__(
        self,
        config: EdgeConfig,
        edge: EdgeModel | None = None,
        draft_model: FullModel | None = None,
        controller: SpeculationController | None = None,
    ) -> None:
        """``edge``, ``draft_model`` and ``controller`` may be shared by many clients (a server's
        pool): the models hold no per-sequence state, and the controller's estimates describe the
        link and the model pair, not a sequence."""
        self.config = config
        ckpt = Checkpoint(config.model_dir)
        self.plan = SplitPlan(ckpt.config.num_hidden_layers, *config.edge_layers)
        self.provenance = check_edge_weights(
            config.model_dir, self.plan, config.published_model_dir, config.allow_stock_edge_weights
        )
        self.send_noise = send_noise(config.model_dir)  # the defence the edge layers were trained with
        self.dtype, dtype_name = resolve_dtype(ckpt, config.dtype)
        if config.wire_codec not in WIRE_CODECS:
            raise ConfigError(f"--wire-codec must be one of {', '.join(WIRE_CODECS)}, got {config.wire_codec!r}")
        self.device = edge.device if edge is not None else resolve_device(config.device)
        self.model = (
            edge
            if edge is not None
            else load_edge(ckpt, self.plan, self.dtype, config.attn_implementation, self.device)
        )
        self._staging = HostStaging(self.device)
        self.max_positions = int(ckpt.config.max_position_embeddings)  # longest sequence, tokens
        self.cache_size = self._compile_fixed_decode()  # static KV entries with --compile, else None
        self.hello = Hello(
            fingerprint=fingerprint(ckpt.config),
            layer_start=self.plan.trunk_layers.start,
            layer_end=self.plan.trunk_layers.stop,
            dtype=dtype_name,
            hidden_size=self.model.hidden_size,
            auth_token=config.auth_token,
            client="splitspec-edge",
            wire_codec=config.wire_codec,
        )
        self.expected_trunk, self.trunk_source = expected_trunk(config, ckpt, self.plan)
        self.eos_token_ids = generation_stop_ids(config.model_dir, ckpt.config)
        self.published_sampling = published_sampling(config.model_dir)  # generation_config.json's
        self._default_sampling: SamplingParams | None = None
        self.draft_model: FullModel | None = draft_model
        if draft_model is None and config.draft_model_dir is not None:
            draft_ckpt = Checkpoint(config.draft_model_dir)
            if draft_ckpt.config.vocab_size != ckpt.config.vocab_size:
                raise ConfigError(
                    f"draft model vocabulary ({draft_ckpt.config.vocab_size}) differs from the model's "
                    f"({ckpt.config.vocab_size}): they must share one tokenizer"
                )
            draft_dtype = None if config.dtype is None else self.dtype  # the draft's own unless --dtype
            self.draft_model = load_full(draft_ckpt, draft_dtype, config.attn_implementation, self.device)
        self._channel: Channel | None = None
        self._welcome: Welcome | None = None
        self._session_id: str | None = None
        self._seq = 0
        self._head_cache = self._new_cache()
        self._tail_cache = self._new_cache()
        self._tokens: list[int] = []  # token id behind every committed cache entry
        self._digests: list[bytes] = []  # keyed prefix digest of every committed token (send noise only)
        self._command: CacheCommand | None = None  # rides on the next step
        self._lost = False  # the cloud session is gone or unknown: recover before the next step
        self.steps: list[StepStats] = []
        self.recoveries = 0
        self.capacity_waits = 0  # steps sent again after a capacity refusal
        self._controller = controller  # kept across chat turns

    def _compile_fixed_decode(self) -> int | None:
        """With ``compile``: the head's and tail's fixed-shape decode steps, compiled now (once per
        shared model); return the static KV size. None without (growable caches)."""
        config = self.config
        size = static_cache_size(config.compile, config.max_cache_tokens, self.max_positions)
        if config.compile is None or size is None:
            return None
        for stack in (self.model.head, self.model.tail):
            if len(stack.layers) and stack.fixed_decode is None:
                stack.enable_fixed_decode(config.compile, config.compile_backend).warm_up(size)
        return size

    def _new_cache(self) -> KVCache:
        """A sequence's cache on the edge: static buffers with ``compile``, else growable."""
        return KVCache() if self.cache_size is None else StaticKVCache(self.cache_size)

    # -- connection ----------------------------------------------------------------------------

    async def __aenter__(self) -> SplitClient:
        await self.connect()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def connect(self) -> None:
        """Connect, handshake and open a session."""
        cfg = self.config
        self._channel = await Channel.connect(
            cfg.cloud_url,
            max_message_bytes=cfg.max_message_bytes,
            timeout_s=cfg.connect_timeout_s,
            ca_file=cfg.tls_ca_file,
        )
        try:
            welcome, _ = await self._channel.request(self.hello, cfg.request_timeout_s)
            if not isinstance(welcome, Welcome):
                raise UnexpectedMessage(f"expected a Welcome, got {welcome.TYPE!r}")
            check_trunk(self.expected_trunk, welcome.trunk, self.trunk_source)
            if welcome.wire_codec != self.hello.wire_codec:
                raise HandshakeMismatch(
                    f"wire codec: edge sends {self.hello.wire_codec!r}, trunk answered {welcome.wire_codec!r}"
                )
            self._welcome = welcome
            opened, _ = await self._channel.request(OpenSession(request_id=0), cfg.request_timeout_s)
            if not isinstance(opened, SessionOpened):
                raise UnexpectedMessage(f"expected SessionOpened, got {opened.TYPE!r}")
        except BaseException:
            await self._drop_channel()
            raise
        self._session_id = opened.session_id
        log.debug("session %s opened on %s", self._session_id, cfg.cloud_url)
        if self.provenance.stock:
            log.warning(
                "session %s runs STOCK public edge weights (%s): the cloud can invert what it sees",
                self._session_id,
                self.provenance.reason,
            )

    async def close(self) -> None:
        if self._channel is not None and self._session_id is not None:
            try:
                await self._channel.request(CloseSession(self._session_id), 5.0)
            except (ProtocolError, TransportError) as exc:
                log.debug("closing session %s: %s", self._session_id, exc)
        await self._drop_channel()

    async def _drop_channel(self) -> None:
        if self._channel is not None:
            channel, self._channel = self._channel, None
            await channel.close()
        self._session_id = None

    @property
    def session_id(self) -> str | None:
        return self._session_id

    @property
    def server_headers(self) -> dict[str, str]:
        """The current connection's WebSocket upgrade answer headers, names lower-cased (empty when not connected).

        Behind Ray Serve, ``x-splitspec-replica`` names the replica serving this connection.
        """
        return {} if self._channel is None else self._channel.response_headers

    @property
    def chunk_tokens(self) -> int:
        """Most query tokens one step may carry without hitting either side's caps."""
        if self._welcome is None:
            raise TransportError("not connected")
        cap = min(self._welcome.max_message_bytes, self.config.max_message_bytes)
        # per token: hidden state in the wire codec (both ways: the reply's raw one is the trunk's dtype, which
        # the handshake made ours), int32 position, int32 parent, and up to 8 header bytes of keep_last
        per_token = wire_bytes_per_token(self.hello.wire_codec, self.model.hidden_size, self.dtype) + 16
        return max(1, min(self._welcome.max_query_tokens, (cap - _HEADER_RESERVE) // per_token))

    # -- the verifier interface ------------------------------------------------------------------

    @property
    def edge_cache_bytes(self) -> int:
        """Memory held by this sequence's edge KV caches (head and tail), bytes."""
        return self._head_cache.nbytes + self._tail_cache.nbytes

    def reset(self) -> None:
        """Start a new sequence: the cloud cache is truncated on the next step."""
        self._head_cache = self._new_cache()
        self._tail_cache = self._new_cache()
        # a pending command (a truncation, a kept path) is superseded: the cloud's cache empties too
        self._command = CacheCommand(truncate_to=0) if self._tokens or self._command is not None else None
        self._tokens = []
        self._digests = []

    def sampling(
        self,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        seed: int | None = None,
    ) -> SamplingParams:
        """Sampling as the checkpoint publishes it (generation_config.json), with the values given here overriding it.

        What :meth:`generate` and :meth:`stream` use when given no ``params``, and what the CLI's
        ``--temperature/--top-p/--top-k/--seed`` build; see :mod:`splitspec.decoding.published`.
        """
        return sampling_settings(self.published_sampling, temperature, top_p, top_k, seed)

    @property
    def default_sampling(self) -> SamplingParams:
        """:meth:`sampling` with no overrides (worked out once)."""
        if self._default_sampling is None:
            self._default_sampling = self.sampling()
        return self._default_sampling

    def check_length(self, prompt_tokens: int, max_new_tokens: int, context_tokens: int = 0) -> None:
        """Refuse a generation that could pass the model's maximum positions: context + prompt + max new tokens.

        The one length policy: the CLI calls it before connecting, :meth:`stream` before sending
        anything, so a request either fits whole or fails at once, never midway.
        """
        total = context_tokens + prompt_tokens + max_new_tokens
        if self.cache_size is not None and total > self.cache_size:
            raise ConfigError(
                f"prompt + max new tokens + context = {total} exceeds the edge's static KV size of "
                f"{self.cache_size} (--max-cache-tokens)"
            )
        if total > self.max_positions:
            raise ConfigError(
                f"prompt ({prompt_tokens} tokens) + max new tokens ({max_new_tokens})"
                + (f" + context ({context_tokens})" if context_tokens else "")
                + f" = {total} exceeds the model's {self.max_positions} positions: shorten the prompt or "
                "lower --max-new-tokens"
            )

    @property
    def history(self) -> tuple[int, ...]:
        """The token ids behind every committed cache entry, in order (what the caches hold)."""
        return tuple(self._tokens)

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` committed tokens on both sides (prefix reuse across chat turns).

        The edge caches change now; the cloud's change rides on the next step, merged with a
        pending keep of the last step's accepted path.
        """
        if not 0 <= length <= len(self._tokens):
            raise ValueError(f"cannot truncate {len(self._tokens)} committed tokens to {length}")
        if length == len(self._tokens):
            return
        pending = self._command
        command = CacheCommand(truncate_to=length)
        if pending is not None and pending.keep_last is not None:
            start = len(self._tokens) - len(pending.keep_last)  # the kept step's first entry
            if length > start:
                command = CacheCommand(truncate_to=pending.truncate_to, keep_last=pending.keep_last[: length - start])
        self._head_cache.truncate(length)
        self._tail_cache.truncate(length)
        del self._tokens[length:]
        self._command = command

    def keep(self, indices: Sequence[int]) -> None:
        """Keep only ``indices`` of the last step's entries (the accepted path), on both sides.

        The edge caches change now; the cloud's change rides on the next step (no extra trip).
        """
        if self._command is not None:
            raise RuntimeError("a cache command is already pending")
        keep = tuple(indices)
        start = len(self._tokens) - self._tail_cache.last_step
        self._head_cache.keep_last(keep)
        self._tail_cache.keep_last(keep)
        self._tokens = self._tokens[:start] + [self._tokens[start + i] for i in keep]
        if self._digests:
            self._digests = self._digests[:start] + [self._digests[start + i] for i in keep]
        self._command = CacheCommand(keep_last=keep)

    async def forward(self, tokens: Sequence[int], parents: Sequence[int] | None = None) -> torch.Tensor:
        """Run ``tokens`` (a chain unless ``parents`` says otherwise) -> logits (q, V) float32."""
        tokens = list(tokens)
        if not tokens:
            raise ValueError("forward needs at least one token")
        parents = chain(len(tokens)) if parents is None else list(parents)
        if len(parents) != len(tokens):
            raise ValueError("tokens and parents must have the same length")
        kind = "prefill" if len(tokens) > 1 and not self._tokens else "decode"
        base = len(self._tokens)
        for attempt in range(self.config.max_recoveries + 1):
            try:
                if self._lost:
                    await self._recover()
                return await self._forward_chunked(tokens, parents, kind)
            except (UnknownSession, TransportError, ServerError) as exc:
                # the chunks of this forward that went through are forgotten: the retry sends them
                # again, after the recovery replayed only what was committed before this forward.
                # A server error leaves the cloud's cache unknown (its cache command may have been
                # applied), so it too is recovered from on a fresh session.
                self._tokens = self._tokens[:base]
                self._lost = True  # this attempt, or the next forward, starts with a recovery
                if attempt == self.config.max_recoveries:
                    raise
                log.warning("lost the cloud session (%s); recovering by replaying %d tokens", exc, base)
        raise AssertionError("unreachable")  # pragma: no cover

    async def _forward_chunked(self, tokens: list[int], parents: list[int], kind: str) -> torch.Tensor:
        size = self.chunk_tokens
        if len(tokens) <= size:
            return await self._forward_once(tokens, parents, kind)
        if parents != chain(len(tokens)):
            raise ValueError(f"a draft tree of {len(tokens)} tokens exceeds one step's {size}-token limit")
        out = [
            await self._forward_once(tokens[i : i + size], chain(len(tokens[i : i + size])), kind)
            for i in range(0, len(tokens), size)
        ]
        return torch.cat(out, dim=0)

    async def _forward_once(self, tokens: list[int], parents: list[int], kind: str) -> torch.Tensor:
        if self._channel is None or self._session_id is None:
            raise TransportError("not connected")
        base = len(self._tokens)
        parent_t = torch.tensor(parents, dtype=torch.int32)
        positions = (base + depths(parent_t)).to(torch.int32)
        ids = torch.tensor(tokens, dtype=torch.long)
        try:
            t0 = time.perf_counter()
            hidden = self.model.run_head(ids, positions, parent_t, self._head_cache)  # (1, q, H) on the device
            digests: list[bytes] = []
            if self.send_noise.scale > 0:
                base_digest = self._digests[-1] if self._digests else b""
                digests = prefix_digests(self.send_noise.key, tokens, parents, base_digest)
                eps = noise_for_tokens(digests, hidden.shape[-1])[None].to(hidden.device)  # (1, q, H)
                hidden = add_send_noise(hidden, self.send_noise.scale, eps)
            t1 = time.perf_counter()
            host_hidden = self._staging.to_host(hidden)  # the step's one wait for the device
            t2 = time.perf_counter()
            self._seq += 1
            codec = self.hello.wire_codec  # encodes host_hidden in encode_message, decodes the reply's
            step = Step(self._session_id, self._seq, host_hidden, positions, parent_t, self._command, codec)
            raw_reply, exchange = await self._send_step(self._channel, step)
            reply = _checked_reply(raw_reply, step, self.dtype)
            t3 = time.perf_counter()
            trunk_out = self._staging.to_device(reply.hidden)  # (1, q, H)
            t4 = time.perf_counter()
            logits = self.model.run_tail(trunk_out, positions, parent_t, self._tail_cache)  # (q, V) on the device
            t5 = time.perf_counter()
        except BaseException:
            for cache in (self._head_cache, self._tail_cache):  # leave no half-run step behind
                if len(cache) > base:
                    cache.truncate(base)
            raise
        self._command = None
        self._tokens.extend(tokens)
        self._digests.extend(digests)
        self.steps.append(
            StepStats(
                kind=kind,
                query_tokens=len(tokens),
                network_ms=max(0.0, exchange.roundtrip_ms - reply.cloud_ms),
                edge_ms=((t1 - t0) + (t5 - t4)) * 1e3,
                cloud_ms=reply.cloud_ms,
                serialize_ms=exchange.encode_ms + exchange.decode_ms + ((t2 - t1) + (t4 - t3)) * 1e3,
                bytes_up=exchange.bytes_up,
                bytes_down=exchange.bytes_down,
            )
        )
        return logits

    async def _send_step(self, channel: Channel, step: Step) -> tuple[Message, Exchange]:
        """Send ``step`` and return its reply, waiting out the trunk's capacity refusals.

        A refusal with a retry-after hint is retried after the hint, the wait doubling on each new
        refusal (at most :data:`MAX_CAPACITY_BACKOFF_S`), for at most ``capacity_wait_s`` in all; a
        refusal without a hint (the step can never fit) is raised at once. The trunk refuses before
        applying the step's cache command, so sending it again is safe.
        """
        deadline = time.monotonic() + self.config.capacity_wait_s
        delay = 0.0
        while True:
            try:
                return await channel.request(step, self.config.request_timeout_s)
            except CapacityExceeded as exc:
                if exc.retry_after_s is None:
                    raise
                delay = min(max(exc.retry_after_s, 2 * delay), MAX_CAPACITY_BACKOFF_S)
                if time.monotonic() + delay > deadline:
                    raise
                self.capacity_waits += 1
                log.info("the trunk is at capacity (%s); retrying in %.2f s", exc, delay)
                await asyncio.sleep(delay)

    async def _recover(self) -> None:
        """Reconnect if needed, open a fresh session and replay every committed token.

        The history is kept whole until the replay succeeds: a replay that fails leaves the client
        disconnected with its full history, so the next attempt replays all of it again.
        """
        self.recoveries += 1
        history = list(self._tokens)
        await self._drop_channel()
        deadline = time.monotonic() + self.config.reconnect_timeout_s
        delay = 0.05
        while True:
            try:
                await self.connect()
                break
            except TransportError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(delay)
                delay = min(1.0, delay * 2)
        self._head_cache, self._tail_cache = self._new_cache(), self._new_cache()
        self._tokens, self._command, self._digests = [], None, []
        if history:
            try:
                await self._forward_chunked(history, chain(len(history)), "replay")
            except BaseException:
                self._tokens = history
                raise
        self._lost = False

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
    ) -> AsyncIterator[int]:
        """Yield new tokens as they are produced.

        ``speculate``: ``off`` (one round trip per token) or a drafter (``ngram``,
        ``prompt-lookup``, ``draft``) or ``auto`` (the default, as the CLI's ``--speculate``); the
        adaptive controller then drafts only when it pays, and output is the same whatever the
        mode (greedy: token for token; sampling: in law).
        ``fresh=False`` appends ``prompt_ids`` to the sequence already in the caches instead of
        starting over (multi-turn chat); the last token generated before is not in the caches yet,
        so a continuation should start with it.
        """
        params = params if params is not None else self.default_sampling
        if generator is None:
            generator, _ = params.generator(self.device)
        self.check_length(len(prompt_ids), max_new_tokens, 0 if fresh else len(self._tokens))
        stops = self.eos_token_ids if stop_token_ids is None else stop_token_ids
        drafters = make_drafters(speculate, params, self.draft_model, generator)
        if not drafters:
            async for token in decode_sequential(
                self, prompt_ids, max_new_tokens, params, generator, stops, fresh=fresh
            ):
                yield token
            return
        # the controller's step-time and acceptance estimates outlive one generation: they describe
        # this link and this model pair, and a new one would have to learn them again
        controller = self._controller
        if controller is None or controller.drafters != list(drafters):
            controller = self._controller = SpeculationController(list(drafters))
        history = None if fresh else list(self._tokens)
        async for token in speculative_decode(
            self, prompt_ids, max_new_tokens, params, generator, drafters, controller, stops, trace, history
        ):
            yield token

    async def generate(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        params: SamplingParams | None = None,
        stop_token_ids: Collection[int] | None = None,
        speculate: str = "auto",
        produced: list[int] | None = None,
    ) -> GenerationResult:
        """Generate and return the tokens with per-step figures.

        ``params`` None: :attr:`default_sampling` (the checkpoint's published settings). Each new
        token is also appended to ``produced`` when given, so a caller still has every token
        produced (the last one included) when the generation fails midway.
        """
        params = params if params is not None else self.default_sampling
        generator, seed = params.generator(self.device)
        first_step, recoveries = len(self.steps), self.recoveries
        trace: list[SpecStep] = []
        t0 = time.perf_counter()
        tokens = produced if produced is not None else []
        async for token in self.stream(prompt_ids, max_new_tokens, params, stop_token_ids, generator, speculate, trace):
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


def expected_trunk(config: EdgeConfig, ckpt: Checkpoint, plan: SplitPlan) -> tuple[TrunkFingerprint, str]:
    """The trunk fingerprint the cloud must send, and where it comes from: the pin, else the edge's own copy."""
    if config.trunk_fingerprint is not None:
        try:
            pinned = TrunkFingerprint.parse(config.trunk_fingerprint)
        except ValueError as exc:
            raise ConfigError(f"--trunk-fingerprint: {exc}") from None
        if (pinned.layer_start, pinned.layer_end) != (plan.trunk_layers.start, plan.trunk_layers.stop):
            raise ConfigError(
                f"--trunk-fingerprint is for {pinned.layers}, but --edge-layers {plan.head},{plan.tail} "
                f"leave layers {plan.trunk_layers.start}..{plan.trunk_layers.stop - 1} to the trunk"
            )
        return pinned, "the pinned --trunk-fingerprint"
    try:
        own = trunk_fingerprint(ckpt, plan)
    except CheckpointError as exc:
        raise CheckpointError(
            f"{exc}: the edge checks the cloud's trunk against its own copy; without one, pin the trunk with "
            "--trunk-fingerprint (the trunk server logs it at start)"
        ) from None
    return own, f"the edge's copy of the checkpoint ({ckpt.directory})"


def _checked_reply(reply: object, step: Step, dtype: torch.dtype) -> StepResult:
    """The cloud is untrusted too: its reply must answer this step, with matching tensors in the step's
    codec; returned with its hidden state in the edge's compute ``dtype``."""
    if not isinstance(reply, StepResult):
        raise UnexpectedMessage(f"expected a StepResult, got {getattr(reply, 'TYPE', reply)!r}")
    if reply.session_id != step.session_id or reply.seq != step.seq:
        raise UnexpectedMessage(f"reply for {reply.session_id}/{reply.seq}, sent {step.session_id}/{step.seq}")
    if reply.codec != step.codec:
        raise BadTensor(f"reply hidden state in the {reply.codec!r} codec, the step's is {step.codec!r}")
    if reply.hidden.shape != step.hidden.shape or (step.codec == "raw" and reply.hidden.dtype != step.hidden.dtype):
        raise BadTensor(f"reply hidden {tuple(reply.hidden.shape)} {reply.hidden.dtype} does not match the step")
    if reply.hidden.dtype == dtype:
        return reply
    return dataclasses.replace(reply, hidden=reply.hidden.to(dtype))  # a bf16 or int8 wire's bfloat16 or float32
