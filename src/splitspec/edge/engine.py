"""The edge engine: many sequences' steps through one edge model and one link to the trunk.

One step of a sequence (``EdgeEngine.forward``) is: embed its query tokens, run the head layers,
add the send noise, send the hidden state to the trunk, run the tail layers on the reply, return
logits. The head and tail forwards of every sequence that steps at the same time run as *one*
batched forward each (:class:`~splitspec.models.batcher.RowBatcher` over
:func:`~splitspec.models.batched.forward_batch`: ragged rows, each with its own positions,
parents and cache), on a worker thread of each, off the event loop; the trunk exchanges of all
sequences are multiplexed over a few connections (:class:`~splitspec.edge.link.TrunkLink`). Each
sequence's decode loop (drafting, verification, its logits processors) runs as its own coroutine
over ``forward``, so sequences with different prompts, speculation modes and sampling share every
forward without waiting for each other's rounds.

A forward is all or nothing on the edge: if any of its chunks fails, the sequence forgets the
chunks that went through before recovering, so the retry never sends a token twice. A sequence
whose cloud session is lost (an eviction, an expired TTL, a broken connection, a failed trunk
step) recovers alone: a new session on a connection with room, then a replay of its committed
tokens; other sequences, on the same connection or not, are not disturbed unless their
connection broke too. A step the trunk refuses for ``capacity`` is sent again after the
refusal's retry-after hint, backing off.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence

import torch

from splitspec.decoding.aside import DraftExecutor
from splitspec.decoding.controller import SpeculationController
from splitspec.decoding.estimates import StepTimes
from splitspec.devices import compute_on_threads
from splitspec.edge.link import TrunkLink
from splitspec.edge.runtime import EdgeRuntime
from splitspec.edge.sequence import EdgeSequence, StepStats
from splitspec.exceptions import (
    BadTensor,
    CapacityExceeded,
    ServerError,
    TooManySessions,
    TransportError,
    UnexpectedMessage,
    UnknownSession,
)
from splitspec.models.batched import BatchRow, forward_batch
from splitspec.models.batcher import BatchLog, RowBatcher
from splitspec.models.features import edge_feature_sources, trunk_feature_layer
from splitspec.models.kv_cache import KVCache
from splitspec.models.masks import chain, step_positions
from splitspec.privacy.defences import add_send_noise, noise_for_tokens, prefix_digests
from splitspec.protocol.codec import wire_bytes_per_token
from splitspec.protocol.messages import Message, Step, StepResult
from splitspec.transport.client import Exchange

log = logging.getLogger(__name__)

_HEADER_RESERVE = 2048  # bytes kept free in every step frame for the prefix and JSON header
EDGE_BIG_STEPS = 8  # prefills whose chunks share one head (tail) forward: a burst of new requests is batched too
MAX_CAPACITY_BACKOFF_S = 5.0  # longest wait between two tries of a step the trunk refused for capacity, seconds
ABANDON_WAIT_S = 5.0  # how long a recovery waits for the trunk to close the session it gives up, seconds


class _HeadBatcher(RowBatcher):
    """The head layers over many sequences' embedded query tokens -> hidden states (1, q, H), on the device."""

    def __init__(self, runtime: EdgeRuntime, max_batch_steps: int, gather: float, threaded: bool) -> None:
        super().__init__(
            max_batch_steps, gather=gather, thread_name="edge-head", max_big_steps=EDGE_BIG_STEPS, threaded=threaded
        )
        self.runtime = runtime  # its model is read per batch: an auto edge may load it again at the first Welcome
        self.log = BatchLog()

    def observe_batch(self, steps: int, tokens: int, compute_ms: float) -> None:
        self.log.observe(steps, compute_ms)

    def run_rows(self, rows: list[BatchRow]) -> list[torch.Tensor]:
        return forward_batch(self.runtime.model.head, rows)


class _TailBatcher(RowBatcher):
    """The tail layers, final norm and LM head over many sequences' trunk outputs -> logits (1, q - from, V)
    float32: the LM head runs only on the rows a step wants (a prefill wants its last)."""

    def __init__(self, runtime: EdgeRuntime, max_batch_steps: int, gather: float, threaded: bool) -> None:
        super().__init__(
            max_batch_steps, gather=gather, thread_name="edge-tail", max_big_steps=EDGE_BIG_STEPS, threaded=threaded
        )
        self.runtime = runtime  # its model is read per batch, as the head's
        self.log = BatchLog()
        # tail cache id -> the tail's outputs (q_chunk, H) of that sequence's step in flight, chunk by chunk, for a
        # sequence that keeps features (see want_stream); written by the worker thread, read once the step is done
        self._streams: dict[int, list[torch.Tensor]] = {}

    def want_stream(self, cache: KVCache) -> list[torch.Tensor]:
        """Record the tail's output stream (before the final norm) of the next step on ``cache``."""
        chunks: list[torch.Tensor] = []
        self._streams[id(cache)] = chunks
        return chunks

    def drop_stream(self, cache: KVCache) -> None:
        self._streams.pop(id(cache), None)

    def observe_batch(self, steps: int, tokens: int, compute_ms: float) -> None:
        self.log.observe(steps, compute_ms)

    @torch.inference_mode()
    def run_rows(self, rows: list[BatchRow]) -> list[torch.Tensor]:
        model = self.runtime.model
        outs = forward_batch(model.tail, rows)
        for out, row in zip(outs, rows, strict=True):
            stream = self._streams.get(id(row.cache))
            if stream is not None:
                stream.append(out[0].clone())  # (q, H): the batch's packed tensor is not kept alive
        return model.row_logits([out[:, row.outputs_from :] for out, row in zip(outs, rows, strict=True)])


class EdgeEngine:
    """Runs every sequence's steps for one :class:`EdgeRuntime` against one trunk."""

    def __init__(self, runtime: EdgeRuntime) -> None:
        self.runtime = runtime
        self.config = runtime.config
        self.link = TrunkLink(
            self.config, runtime.hello, runtime.expected_trunk, runtime.trunk_source, runtime.follow_trunk_dtype
        )
        # static KV buffers (--compile) run each sequence's fixed-shape step alone
        rows = 1 if runtime.cache_size is not None else 64
        # on worker threads, or on the event loop (a CPU edge: each torch call would wait for the lock on a thread)
        self.threaded = compute_on_threads(self.config.compute_on, [runtime.device])
        self._head = _HeadBatcher(runtime, rows, self.config.batch_gather, self.threaded)
        self._tail = _TailBatcher(runtime, rows, self.config.batch_gather, self.threaded)
        # step-time estimates describe the link and the trunk, so every sequence's controller shares them
        self.step_times = StepTimes()
        self._populations: dict[tuple[str, ...], SpeculationController] = {}
        # drafting (a draft model's forwards) runs here, one draft at a time: on its thread, or on the event loop
        self.draft_executor = DraftExecutor(threaded=self.threaded)

    # -- sequences -----------------------------------------------------------------------------

    @property
    def head_batches(self) -> BatchLog:
        """The head worker's forwards by batch size."""
        return self._head.log

    @property
    def tail_batches(self) -> BatchLog:
        """The tail worker's forwards by batch size."""
        return self._tail.log

    def new_sequence(self) -> EdgeSequence:
        return EdgeSequence(self.runtime)

    def population(self, drafters: Sequence[str]) -> SpeculationController:
        """The engine-wide speculation estimates for this set of drafters: every sequence's observations."""
        key = tuple(drafters)
        if key not in self._populations:
            self._populations[key] = SpeculationController(list(drafters), step_times=self.step_times)
        return self._populations[key]

    def forget_acceptance(self) -> None:
        """Drop the engine-wide acceptance estimates (every drafter set's); the step times, which describe the
        link and the trunk, stay. A sequence whose controller is then cleared starts as a fresh engine's first
        sequence does (a benchmark's runs, each learning from nothing)."""
        self._populations.clear()

    def controller(self, sequence: EdgeSequence, drafters: Sequence[str]) -> SpeculationController:
        """The sequence's speculation controller: its own acceptance estimates, starting from the engine-wide
        ones (so a short request does not spend itself exploring), and the engine's step times."""
        if sequence.controller is None or sequence.controller.drafters != list(drafters):
            population = self.population(drafters)
            sequence.controller = SpeculationController(
                list(drafters), step_times=self.step_times, population=population
            )
        return sequence.controller

    def _start(self) -> None:
        for batcher in (self._head, self._tail):
            if not batcher.running:
                batcher.start()

    async def open(self, sequence: EdgeSequence) -> None:
        """Open a cloud session for ``sequence`` (on a connection with room)."""
        self._start()
        sequence.connection, sequence.session_id = await self.link.open_session()
        log.debug("session %s opened on %s", sequence.session_id, self.config.cloud_url)
        if self.runtime.provenance.stock:
            log.warning(
                "session %s runs STOCK public edge weights (%s): the cloud can invert what it sees",
                sequence.session_id,
                self.runtime.provenance.reason,
            )

    async def release(self, sequence: EdgeSequence) -> None:
        """Close ``sequence``'s cloud session (best effort)."""
        conn, session_id = sequence.connection, sequence.session_id
        sequence.connection = sequence.session_id = None
        if conn is not None and session_id is not None:
            await self.link.close_session(conn, session_id)

    async def close(self) -> None:
        """Close every connection and stop the workers (sequences must be released first)."""
        await self.link.close()
        for batcher in (self._head, self._tail):
            await batcher.stop()
        self.draft_executor.shutdown(wait=False)
        self.draft_executor = DraftExecutor(threaded=self.threaded)  # reusable

    def chunk_tokens(self, sequence: EdgeSequence) -> int:
        """Most query tokens one step may carry without hitting either side's caps."""
        conn = sequence.connection
        if conn is None:
            raise TransportError("not connected")
        # per token: hidden state in the wire codec (both ways: the reply's raw one is the trunk's dtype, which
        # the handshake made ours), int32 position, int32 parent, and up to 8 header bytes of keep_last; a reply
        # with a state inside the trunk carries two hidden states
        features = sequence.features
        asked = features is not None and self._trunk_feature(features.layers) is not None
        per_token = self._hidden_bytes() * (2 if asked else 1) + 16
        return max(1, min(conn.welcome.max_query_tokens, (conn.max_message_bytes - _HEADER_RESERVE) // per_token))

    # -- the verifier interface ------------------------------------------------------------------

    async def forward(
        self,
        sequence: EdgeSequence,
        tokens: Sequence[int],
        parents: Sequence[int] | None = None,
        logits_from: int = 0,
        *,
        sent: Callable[[], None] | None = None,
    ) -> torch.Tensor:
        """Run ``tokens`` (a chain unless ``parents`` says otherwise) of ``sequence`` -> logits (q - logits_from, V)
        float32: the rows of query tokens ``logits_from`` onwards (a prefill needs only its last).

        ``sent()`` is called once: when the head forward of the first step sent has run and the edge waits
        for the trunk (a retry after a recovery does not call it again)."""
        tokens = list(tokens)
        pending = [sent] if sent is not None else []  # emptied by the first call
        if not tokens:
            raise ValueError("forward needs at least one token")
        parents = chain(len(tokens)) if parents is None else list(parents)
        if len(parents) != len(tokens):
            raise ValueError("tokens and parents must have the same length")
        kind = "prefill" if len(tokens) > 1 and not sequence.tokens else "decode"
        base = len(sequence.tokens)
        for attempt in range(self.config.max_recoveries + 1):
            try:
                if sequence.lost:
                    await self._recover(sequence)
                return await self._forward_chunked(sequence, tokens, parents, kind, logits_from, pending)
            except asyncio.CancelledError:
                sequence.tokens = sequence.tokens[:base]  # the chunks that went through are forgotten too
                raise
            except (UnknownSession, TransportError, ServerError) as exc:
                # the chunks of this forward that went through are forgotten: the retry sends them
                # again, after the recovery replayed only what was committed before this forward.
                # A server error leaves the cloud's cache unknown (its cache command may have been
                # applied), so it too is recovered from on a fresh session.
                sequence.tokens = sequence.tokens[:base]
                sequence.lost = True  # this attempt, or the next forward, starts with a recovery
                if attempt == self.config.max_recoveries:
                    raise
                log.warning("lost the cloud session (%s); recovering by replaying %d tokens", exc, base)
            except Exception:
                if len(sequence.tokens) > base:  # chunks of this forward went through: all or nothing, as above
                    sequence.tokens = sequence.tokens[:base]
                    sequence.lost = True
                raise
        raise AssertionError("unreachable")  # pragma: no cover

    async def _forward_chunked(
        self,
        sequence: EdgeSequence,
        tokens: list[int],
        parents: list[int],
        kind: str,
        logits_from: int = 0,
        sent: list[Callable[[], None]] | None = None,
    ) -> torch.Tensor:
        size = self.chunk_tokens(sequence)
        if len(tokens) <= size:
            return await self._forward_once(sequence, tokens, parents, kind, logits_from, sent)
        if parents != chain(len(tokens)):
            raise ValueError(f"a draft tree of {len(tokens)} tokens exceeds one step's {size}-token limit")
        out = []
        for i in range(0, len(tokens), size):
            part = tokens[i : i + size]
            wanted = min(len(part), max(0, logits_from - i))  # this chunk's rows before logits_from get none
            out.append(await self._forward_once(sequence, part, chain(len(part)), kind, wanted, sent))
        return torch.cat(out, dim=0)

    async def _forward_once(
        self,
        sequence: EdgeSequence,
        tokens: list[int],
        parents: list[int],
        kind: str,
        logits_from: int = 0,
        sent: list[Callable[[], None]] | None = None,
    ) -> torch.Tensor:
        """One step to the trunk and back; ``sent`` (a one-shot list) is popped and called once the step's head
        forward ran, before the step is encoded and sent."""
        conn, session_id = sequence.connection, sequence.session_id
        if conn is None or session_id is None:
            raise TransportError("not connected")
        runtime = self.runtime
        base = len(sequence.tokens)
        parent_t = torch.tensor(parents, dtype=torch.int32)
        positions = torch.tensor(step_positions(base, parents), dtype=torch.int32)
        ids = torch.tensor(tokens, dtype=torch.long)
        features: torch.Tensor | None = None  # (q, F * H) when the sequence keeps features
        tail_cache = sequence.tail_cache  # this step's (a cancellation gives the sequence new caches)
        sent_to_trunk = False
        try:
            t0 = time.perf_counter()
            with torch.inference_mode():  # as the head's own forward (a compiled step guards on it)
                embedded = runtime.model.embed(ids[None])  # (1, q, H) on the device
            hidden, _, head_queue_ms = await self._head.submit(embedded, positions, parent_t, sequence.head_cache)
            head_out = hidden  # before the send noise: the head's output, as a whole model computes it
            digests: list[bytes] = []
            noise = runtime.send_noise
            if noise.scale > 0:
                base_digest = sequence.digests[-1] if sequence.digests else b""
                digests = prefix_digests(noise.key, tokens, parents, base_digest)
                eps = noise_for_tokens(digests, hidden.shape[-1])[None].to(hidden.device)  # (1, q, H)
                hidden = add_send_noise(hidden, noise.scale, eps)
            t1 = time.perf_counter()
            host_hidden = runtime.staging.to_host(hidden)  # the step's one wait for the device
            t2 = time.perf_counter()
            sequence.seq += 1
            codec = runtime.hello.wire_codec  # encodes host_hidden in encode_message, decodes the reply's
            asked = None if sequence.features is None else self._trunk_feature(sequence.features.layers)
            step = Step(session_id, sequence.seq, host_hidden, positions, parent_t, sequence.command, codec, asked)
            if sent:
                sent.pop()()
            sent_to_trunk = True
            raw_reply, exchange = await self._send_step(sequence, step)
            reply = _checked_reply(raw_reply, step, runtime.dtype)
            t3 = time.perf_counter()
            trunk_out = runtime.staging.to_device(reply.hidden)  # (1, q, H)
            t4 = time.perf_counter()
            stream = None if sequence.features is None else self._tail.want_stream(sequence.tail_cache)
            tail = self._tail.submit(trunk_out, positions, parent_t, sequence.tail_cache, logits_from)
            logits, _, tail_queue_ms = await tail  # (1, q - logits_from, V)
            if stream is not None and sequence.features is not None:
                middle = None if reply.feature is None else runtime.staging.to_device(reply.feature)[0]  # (q, H)
                features = self._features(sequence.features.layers, head_out[0], trunk_out[0], stream, middle)
            t5 = time.perf_counter()
        except asyncio.CancelledError:
            # a worker may still be computing this step on the caches: leave them to it, and start the
            # sequence's caches afresh; its next forward replays the committed tokens on a new session
            sequence.head_cache, sequence.tail_cache = runtime.new_cache(), runtime.new_cache()
            sequence.lost = True
            raise
        except BaseException as exc:  # the workers are done with this step: leave no half-run step behind
            for cache in (sequence.head_cache, sequence.tail_cache):
                if len(cache) > base:
                    cache.truncate(base)
            if sent_to_trunk and not isinstance(exc, CapacityExceeded):  # a refused step changed nothing there
                # the trunk may have run the step (a reply that failed our checks, a failed tail forward): its
                # cache no longer matches the edge's, so the next forward starts with a recovery
                sequence.lost = True
            raise
        finally:
            self._tail.drop_stream(tail_cache)
        sequence.command = None
        sequence.tokens.extend(tokens)
        sequence.digests.extend(digests)
        if features is not None and sequence.features is not None:
            sequence.features.append(features)
        sequence.steps.append(
            StepStats(
                kind=kind,
                query_tokens=len(tokens),
                network_ms=max(0.0, exchange.roundtrip_ms - reply.cloud_ms),
                edge_ms=((t1 - t0) + (t5 - t4)) * 1e3,
                cloud_ms=reply.cloud_ms,
                serialize_ms=exchange.encode_ms + exchange.decode_ms + ((t2 - t1) + (t4 - t3)) * 1e3,
                bytes_up=exchange.bytes_up,
                bytes_down=exchange.bytes_down,
                feature_bytes_down=0 if asked is None else len(tokens) * self._hidden_bytes(),
                edge_queue_ms=head_queue_ms + tail_queue_ms,
                cloud_queue_ms=reply.queue_ms,
            )
        )
        return logits[0]

    def _hidden_bytes(self) -> int:
        """One token's hidden state on the wire, bytes."""
        runtime = self.runtime
        return wire_bytes_per_token(runtime.hello.wire_codec, runtime.model.hidden_size, runtime.dtype)

    def _trunk_feature(self, layers: Sequence[int]) -> int | None:
        """The feature layer the trunk must return with each step (inside the trunk), or None."""
        plan = self.runtime.plan
        return trunk_feature_layer(layers, plan.num_layers, plan.head, plan.tail)

    def _features(
        self,
        layers: Sequence[int],
        head_out: torch.Tensor,
        trunk_out: torch.Tensor,
        stream: list[torch.Tensor],
        middle: torch.Tensor | None,
    ) -> torch.Tensor:
        """The step's features (q, F * H) for feature ``layers``: from the head's output (q, H), the trunk's
        (q, H), the tail's (chunks of (q_i, H)) and the state inside the trunk it returned (q, H)."""
        plan = self.runtime.plan
        sources = edge_feature_sources(layers, plan.num_layers, plan.head, plan.tail)
        parts = {"head": head_out, "trunk": trunk_out}
        if "tail" in sources:
            parts["tail"] = torch.cat(stream, dim=0) if len(stream) > 1 else stream[0]
        if middle is not None:
            parts["middle"] = middle
        return torch.cat([parts[s] for s in sources], dim=-1)

    async def _send_step(self, sequence: EdgeSequence, step: Step) -> tuple[Message, Exchange]:
        """Send ``step`` and return its reply, waiting out the trunk's capacity refusals.

        A refusal with a retry-after hint is retried after the hint, the wait doubling on each new
        refusal (at most :data:`MAX_CAPACITY_BACKOFF_S`), for at most ``capacity_wait_s`` in all; a
        refusal without a hint (the step can never fit) is raised at once. The trunk refuses before
        applying the step's cache command, so sending it again is safe.
        """
        conn = sequence.connection
        if conn is None:
            raise TransportError("not connected")
        deadline = time.monotonic() + self.config.capacity_wait_s
        delay = 0.0
        while True:
            try:
                return await conn.channel.request(step, self.config.request_timeout_s)
            except CapacityExceeded as exc:
                if exc.retry_after_s is None:
                    raise
                delay = min(max(exc.retry_after_s, 2 * delay), MAX_CAPACITY_BACKOFF_S)
                if time.monotonic() + delay > deadline:
                    raise
                sequence.capacity_waits += 1
                log.info("the trunk is at capacity (%s); retrying in %.2f s", exc, delay)
                await asyncio.sleep(delay)

    async def _recover(self, sequence: EdgeSequence) -> None:
        """Open a fresh session (reconnecting if needed) and replay every committed token of ``sequence``.

        The history is kept whole until the replay succeeds: a replay that fails leaves the
        sequence lost with its full history, so the next attempt replays all of it again.

        The session given up is closed first (waiting up to :data:`ABANDON_WAIT_S` for the trunk's answer):
        at the trunk's session limits, the new session's open would otherwise be refused for the old one, the
        edge's own. Should the trunk still count it (the close unanswered, or the connection lost before the
        trunk noticed), a ``too_many_sessions`` refusal is retried like a lost connection, for at most
        ``reconnect_timeout_s``.
        """
        sequence.recoveries += 1
        conn, session_id = sequence.connection, sequence.session_id
        sequence.connection = sequence.session_id = None
        abandoned = conn is not None and session_id is not None
        if conn is not None and session_id is not None:
            await self.link.abandon(conn, session_id, wait_s=min(ABANDON_WAIT_S, self.config.reconnect_timeout_s))
        deadline = time.monotonic() + self.config.reconnect_timeout_s
        delay = 0.05
        while True:
            try:
                await self.open(sequence)
                break
            except (TransportError, TooManySessions) as exc:
                if time.monotonic() > deadline or (isinstance(exc, TooManySessions) and not abandoned):
                    raise
                await asyncio.sleep(delay)
                delay = min(1.0, delay * 2)
        history = sequence.forget_caches()
        if history:
            try:
                await self._forward_chunked(sequence, history, chain(len(history)), "replay", len(history))
            except BaseException:
                sequence.tokens = history
                raise
        sequence.lost = False


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
    if (reply.feature is None) != (step.return_layer is None):
        asked = "asked for" if step.return_layer is not None else "did not ask for"
        raise BadTensor(
            f"the step {asked} the state after layer {step.return_layer}, and the reply disagrees (a trunk "
            "that predates return_layer returns none)"
        )
    feature = reply.feature
    if feature is not None and step.codec == "raw" and feature.dtype != step.hidden.dtype:
        raise BadTensor(f"reply feature {feature.dtype} does not match the step's {step.hidden.dtype}")
    if reply.hidden.dtype == dtype and (feature is None or feature.dtype == dtype):
        return reply
    # a bf16 or int8 wire's bfloat16 or float32
    return dataclasses.replace(
        reply, hidden=reply.hidden.to(dtype), feature=None if feature is None else feature.to(dtype)
    )
