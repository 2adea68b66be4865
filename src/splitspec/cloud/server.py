"""The trunk server: runs the middle decoder layers for many edge sessions.

Each connection handshakes once (protocol version, model fingerprint, layer range, dtype, auth,
the hidden states' wire codec), then opens sessions and sends steps. Where the model compute runs is
``--compute-on``'s (:func:`~splitspec.devices.compute_on_threads`): on an accelerator a worker thread, so the
event loop keeps answering pings and other sessions while a step computes; on a CPU (auto) the batched
forwards run on the event loop itself (a thread would wait for the interpreter lock after every torch call).
Without batching each step runs alone on a thread pool.
Every refusal is a typed ``Error`` reply; only handshake failures close the connection.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from types import TracebackType

import torch

from splitspec import __version__
from splitspec.cloud.batcher import StepBatcher
from splitspec.cloud.budget import default_budget_bytes, kv_bytes_per_token
from splitspec.cloud.config import CloudConfig, check_config
from splitspec.cloud.metrics import TrunkMetrics, step_kind
from splitspec.cloud.sessions import KVBudget, SessionStore
from splitspec.devices import HostStaging, compute_on_threads, parse_devices, resolve_device
from splitspec.exceptions import (
    BadTensor,
    ConfigError,
    MalformedFrame,
    PositionOutOfRange,
    UnexpectedMessage,
    UnknownSession,
)
from splitspec.models.checkpoint import Checkpoint, fingerprint
from splitspec.models.kv_cache import KVCache
from splitspec.models.loading import load_trunk, resolve_dtype
from splitspec.models.masks import depths
from splitspec.models.prepack import prepack_linears, prepack_obstacle
from splitspec.models.quantization import published_method
from splitspec.models.split import SplitPlan
from splitspec.models.static_kv import StaticKVCache, static_cache_size
from splitspec.models.trunk_fingerprint import trunk_fingerprint
from splitspec.models.warm_up import WARM_UP_WIDTHS, pays_cold_start, warm_up_stack
from splitspec.protocol.messages import (
    CloseSession,
    Error,
    Hello,
    Message,
    OpenSession,
    SessionClosed,
    SessionOpened,
    Step,
    StepResult,
    Welcome,
    decode_message,
    encode_message,
)
from splitspec.protocol.state import ServerConnection, TrunkIdentity
from splitspec.transport.peer import MessagePeer
from splitspec.transport.server import (
    ConnectionGuard,
    ConnectionLimits,
    FrameServer,
    run_until_signalled,
    server_tls,
    warn_if_open,
    warn_if_unencrypted,
)

log = logging.getLogger(__name__)

BIG_REPLY_BYTES = 1 << 20  # a step result above this many bytes is encoded off the event loop


class TrunkServer:
    """Loads the trunk of a checkpoint and serves it. Use as ``async with TrunkServer(cfg) as srv``."""

    def __init__(self, config: CloudConfig) -> None:
        self.config = config
        check_config(config)  # what needs no model is checked before the model loads (minutes, for a big one)
        if config.torch_threads is not None:
            torch.set_num_threads(config.torch_threads)
        tls = None
        if config.tls_cert_file is not None and config.tls_key_file is not None:
            tls = server_tls(config.tls_cert_file, config.tls_key_file)
        self.checkpoint = Checkpoint(config.model_dir)
        model_config = self.checkpoint.config
        self.plan = SplitPlan(model_config.num_hidden_layers, *config.edge_layers)
        devices = parse_devices(",".join(config.devices)) if config.devices else (resolve_device(config.device),)
        slowest = next((d for d in devices if d.type == "cpu"), devices[0])  # a CPU share sets auto's choice
        self.dtype, dtype_name = resolve_dtype(self.checkpoint, config.dtype, slowest, "trunk", config.quantize)
        self.trunk = load_trunk(
            self.checkpoint, self.plan, self.dtype, config.attn_implementation, devices, config.quantize
        )
        if self._should_prepack(devices):
            # auto: each layer shape only where it runs faster packed on this CPU (timed at load); on: every one
            packed = prepack_linears(self.trunk, where_faster=config.prepack == "auto")
            log.info("trunk: %d linear layers prepacked for oneDNN", packed)
        self.trunk_fingerprint = trunk_fingerprint(self.checkpoint, self.plan, config.quantize)  # in every Welcome
        self._into_trunk = HostStaging(self.trunk.input_device)
        self._out_of_trunk = HostStaging(self.trunk.output_device)
        self.identity = TrunkIdentity(
            fingerprint=fingerprint(model_config),
            layer_start=self.plan.trunk_layers.start,
            layer_end=self.plan.trunk_layers.stop,
            dtype=dtype_name,
            hidden_size=model_config.hidden_size,
            wire_codecs=config.wire_codecs,
        )
        self.max_positions = int(model_config.max_position_embeddings)
        # entries per session with --compile, else None
        self.cache_size = static_cache_size(config.compile, config.max_cache_tokens, self.max_positions)
        if config.compile is not None and self.cache_size is not None:
            self.trunk.enable_fixed_decode(config.compile, config.compile_backend).warm_up(self.cache_size)
        elif pays_cold_start(devices):  # each step width once, so no edge measures a cold GPU (models/warm_up.py)
            seconds = warm_up_stack(self.trunk, self.dtype)
            log.info("trunk: warmed up at step widths %s in %.0f ms", WARM_UP_WIDTHS, seconds * 1e3)
        self.budget = KVBudget(
            budget_bytes=default_budget_bytes(devices, config.kv_budget_share)
            if config.kv_budget_mb is None
            else int(config.kv_budget_mb * 2**20),
            bytes_per_token=kv_bytes_per_token(model_config, len(self.plan.trunk_layers), self.dtype),
            evict_idle_s=config.evict_idle_s,
            block_tokens=config.kv_block_tokens,
        )
        self.sessions = SessionStore(
            config.max_sessions,
            config.session_ttl_s,
            max_per_owner=config.max_sessions_per_connection,
            max_per_address=config.max_sessions_per_address,
            budget=self.budget,
            new_cache=None if self.cache_size is None else partial(StaticKVCache, self.cache_size),
        )
        self.metrics = TrunkMetrics(self.sessions, self.compute_failure)  # /health: 503 once compute died
        threaded = compute_on_threads(config.compute_on, devices)  # a CPU trunk's forwards run on the event loop
        self.batcher = (
            StepBatcher(
                self.trunk,
                self.metrics,
                config.max_batch_steps,
                prefill_chunk_tokens=config.prefill_chunk_tokens,
                gather=config.batch_gather,
                threaded=threaded,
            )
            if config.batching
            else None
        )
        # a session runs one step at a time (run_step refuses a second while one is in flight);
        # different sessions compute in parallel (torch releases the GIL in its kernels)
        self._executor = self._new_pool()  # stop_compute shuts it down; start_compute makes a new one
        self._pool_open = True
        warn_if_unencrypted(config.host, tls is not None, config.auth_token)
        self.scheme = "ws" if tls is None else "wss"
        limits = ConnectionLimits(
            handshake_timeout_s=config.handshake_timeout_s,
            max_unauthenticated=config.max_unauthenticated,
            max_per_address=config.max_connections_per_address,
            idle_timeout_s=config.session_ttl_s,  # a connection idle that long has lost its sessions anyway
        )
        routes = {"/metrics": self.metrics.render, "/health": self.metrics.health}
        self._frames = FrameServer(
            self.new_peer, config.host, config.port, config.max_message_bytes, tls, limits, http_routes=routes
        )
        self._sweeper: asyncio.Task[None] | None = None
        self._connection_ids = itertools.count()

    @property
    def port(self) -> int:
        return self._frames.port

    @property
    def guard(self) -> ConnectionGuard:
        """The connection limits every connection is served under, whichever front end accepted it."""
        return self._frames.guard

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.config.host}:{self.port}"

    async def start(self) -> None:
        await self._frames.start()
        self.start_compute()
        log.info(
            "trunk server on %s: layers %d..%d of %s, dtype %s, wire codecs %s, on %s, fingerprint %s, "
            "trunk fingerprint %s",
            self.url,
            self.identity.layer_start,
            self.identity.layer_end - 1,
            self.config.model_dir,
            self.identity.dtype,
            ",".join(self.identity.wire_codecs),
            ", ".join(str(d) for d in dict.fromkeys(self.trunk.devices)),
            self.identity.fingerprint,
            self.trunk_fingerprint,
        )
        warn_if_open(self.config.auth_token, self.url, "trunk server")

    async def stop(self) -> None:
        await self._frames.stop()
        await self.stop_compute()

    def start_compute(self) -> None:
        """Start the TTL sweep and the batcher on the running loop (what serving needs besides a listener); after
        :meth:`stop_compute` too (a Ray replica stopped, then connected to again), with a new thread pool."""
        if not self._pool_open:
            self._executor = self._new_pool()
            self._pool_open = True
        self._sweeper = asyncio.create_task(self._sweep_forever())
        if self.batcher is not None:
            self.batcher.start()

    def compute_failure(self) -> str | None:
        """Why steps cannot be served though compute was started (its batching loop or TTL sweep ended), or None."""
        if self._sweeper is None:
            return None  # not started (a replica before its first connection), or stopped
        if self._sweeper.done():
            return "the session TTL sweep stopped"
        if self.batcher is not None and self.batcher.failed:  # every step now fails "not running"
            return "the batching loop stopped"
        return None

    async def stop_compute(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        if self.batcher is not None:
            await self.batcher.stop()
        self._executor.shutdown(wait=True)
        self._pool_open = False

    def _new_pool(self) -> ThreadPoolExecutor:
        """The pool of the per-session path (``batching=False``)."""
        return ThreadPoolExecutor(max_workers=self.config.compute_workers, thread_name_prefix="trunk")

    async def __aenter__(self) -> TrunkServer:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    async def _sweep_forever(self) -> None:
        interval = self.config.sweep_interval_s or min(5.0, self.config.session_ttl_s / 4)
        while True:
            await asyncio.sleep(interval)
            self.sessions.sweep()

    def new_peer(self, remote: str) -> _TrunkPeer:
        """The protocol handling of one new connection from ``remote`` (``host:port``)."""
        return _TrunkPeer(self, next(self._connection_ids), remote)

    def _compute(self, step: Step, cache: KVCache) -> tuple[torch.Tensor, float, float]:
        """Run the trunk (on a worker thread); return the output on the host, the time in ms and
        when it started (``time.perf_counter``).

        The time includes the copies to and from the device: on an accelerator the copy back is
        where the host waits for the trunk's kernels, so compute alone is not separable from it.
        """
        t0 = time.perf_counter()
        hidden = self._into_trunk.to_device(step.hidden)  # (1, q, H)
        out = self.trunk(hidden, step.positions, step.parents, cache, self._capture(step))
        host = self._out_of_trunk.to_host(out)  # (1, q, H), or (1, q, 2H) with the step's return layer
        return host, (time.perf_counter() - t0) * 1e3, t0

    async def _compute_alone(self, step: Step, cache: KVCache) -> tuple[torch.Tensor, float, float]:
        """The per-session path (``batching=False``): the step alone on the thread pool -> output,
        compute ms, queue wait ms."""
        queued = time.perf_counter()
        loop = asyncio.get_running_loop()
        out, cloud_ms, started = await loop.run_in_executor(self._executor, self._compute, step, cache)
        self.metrics.observe_batch(1, step.hidden.shape[1], cloud_ms)
        return out, cloud_ms, (started - queued) * 1e3

    async def _compute_step(self, step: Step, cache: KVCache) -> tuple[torch.Tensor, float, float]:
        """The step through the batcher, or alone (``batching=False``) -> output, compute ms, queue wait ms."""
        if self.batcher is not None:
            return await self.batcher.submit(
                step.hidden, step.positions, step.parents, cache, capture=self._capture(step)
            )
        return await self._compute_alone(step, cache)

    def _capture(self, step: Step) -> int | None:
        """The local trunk layer whose output is the state after the step's ``return_layer`` model layers."""
        return None if step.return_layer is None else step.return_layer - self.plan.trunk_layers.start - 1

    def validate_step(self, step: Step, cache_length: int, last_step: int) -> int:
        """Check a step against the session; return the committed length after its cache command."""
        hidden = step.hidden
        trunk = self.plan.trunk_layers
        if step.return_layer is not None and not trunk.start < step.return_layer < trunk.stop:
            raise MalformedFrame(
                f"return_layer {step.return_layer} is not inside this trunk: the states after layers "
                f"{trunk.start + 1} .. {trunk.stop - 1} can be returned (the edge has the others)"
            )
        if step.codec == "raw" and hidden.dtype != self.dtype:  # another codec's is cast to ours in run_step
            raise BadTensor(f"raw hidden dtype {hidden.dtype} does not match the session dtype {self.dtype}")
        if hidden.shape[2] != self.identity.hidden_size:
            raise BadTensor(f"hidden size {hidden.shape[2]}, the model's is {self.identity.hidden_size}")
        if hidden.shape[1] > self.config.max_query_tokens:
            raise BadTensor(f"{hidden.shape[1]} query tokens exceed the limit of {self.config.max_query_tokens}")
        length = cache_length if step.cache is None else step.cache.length_after(cache_length, last_step)
        if hidden.shape[1] == 1:  # a decode step (its parent is -1, checked when decoded): read one value
            matches, top = int(step.positions[0]) == length, length
        else:
            expected = length + depths(step.parents)
            matches, top = torch.equal(step.positions.to(torch.long), expected), int(expected.max())
        if not matches:
            raise PositionOutOfRange(
                f"position ids must be the committed length ({length}) plus each token's depth in the step"
            )
        if top >= self.max_positions:
            raise PositionOutOfRange(f"position {top} exceeds the model's {self.max_positions}")
        if length + hidden.shape[1] > self.max_positions:
            raise PositionOutOfRange(
                f"{hidden.shape[1]} query tokens would grow the cache of {length} entries beyond the model's "
                f"{self.max_positions} positions"
            )
        if self.cache_size is not None and length + hidden.shape[1] > self.cache_size:
            raise PositionOutOfRange(
                f"{hidden.shape[1]} query tokens would grow the cache of {length} entries beyond this trunk's "
                f"static KV capacity of {self.cache_size} entries per session (--max-cache-tokens)"
            )
        return length

    def _should_prepack(self, devices: tuple[torch.device, ...]) -> bool:
        """Whether to swap the trunk's linear layers for oneDNN-prepacked ones (``--prepack``)."""
        config = self.config  # its prepack is one of PREPACK_CHOICES (check_config)
        if config.prepack == "off":
            return False
        on_cpu = all(device.type == "cpu" for device in devices)
        quantized = config.quantize is not None or published_method(self.checkpoint.config) is not None
        why_not = prepack_obstacle("trunk", on_cpu, self.dtype, quantized, config.compile is not None)
        if config.prepack == "on" and why_not is not None:
            raise ConfigError(f"--prepack on: {why_not}")
        # auto: for batched steps only; the per-session pool's concurrent one-row forwards ran ~10 % slower packed
        return why_not is None and (config.prepack == "on" or config.batching)

    async def run_step(self, step: Step, owner: int) -> StepResult:
        session = self.sessions.get(step.session_id, owner)
        if session.busy:  # a connection's frames are served concurrently, but a session's steps go one by one
            raise UnexpectedMessage(f"session {step.session_id} already has a step in flight: send one at a time")
        cache = session.cache
        length = self.validate_step(step, len(cache), cache.last_step)
        # may evict idle sessions, or refuse before anything changed (the edge sends the step again); the bytes
        # are held for this step until it ends
        self.sessions.reserve(session, length + step.hidden.shape[1])
        session.busy = True
        try:
            cache.reserve(length + step.hidden.shape[1])  # the bytes just accounted: grown at once, not per chunk
            if step.cache is not None:
                if step.cache.truncate_to is not None:
                    cache.truncate(step.cache.truncate_to)
                if step.cache.keep_last is not None:
                    cache.keep_last(step.cache.keep_last)
            if step.hidden.dtype != self.dtype:  # a bf16 or int8 wire: decoded to bfloat16 or float32
                step = dataclasses.replace(step, hidden=step.hidden.to(self.dtype))
            compute = asyncio.ensure_future(self._compute_step(step, cache))
            session.step = compute  # closing the session meanwhile cancels it
            try:
                out, cloud_ms, queue_ms = await compute
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if compute.cancelled() and task is not None and not task.cancelling():
                    raise UnknownSession(f"session {step.session_id} was closed while its step ran") from None
                raise
        except Exception:
            # the cache command is applied and the compute may have half-run: the cache no longer
            # matches anything the edge knows, so the session goes (the edge replays its history)
            self.sessions.close(step.session_id, "its step failed")
            raise
        finally:
            session.busy = False
            session.step = None
            self.sessions.release(session)
            session.last_used = time.monotonic()
        q = step.hidden.shape[1]
        session.steps += 1
        session.tokens += q
        session.compute_ms += cloud_ms
        kind = step_kind(step.parents)
        self.metrics.steps.labels(kind).inc()
        self.metrics.step_tokens.labels(kind).inc(q)
        self.metrics.queue_ms.observe(queue_ms)
        feature = None
        if step.return_layer is not None:  # the trunk's output, then the state after the return layer
            out, feature = out.chunk(2, dim=-1)
        return StepResult(step.session_id, step.seq, out, cloud_ms, step.codec, feature, queue_ms)


class _TrunkPeer(MessagePeer[Message]):
    """One connection's protocol handling on the server. Past the handshake its frames are served
    concurrently: an edge engine multiplexes many sessions' steps over one connection, and every
    reply names its session and sequence number."""

    concurrent = True

    def __init__(self, server: TrunkServer, conn_id: int, remote: str) -> None:
        self.state = ServerConnection(server.identity, server.config.auth_token)
        super().__init__(self.state, conn_id, remote)
        self.server = server
        self.address = remote.rsplit(":", 1)[0]  # the IP address, without the port

    def decode(self, data: bytes) -> Message:
        return decode_message(data, max_bytes=self.server.config.max_message_bytes)

    def encode(self, message: Message) -> bytes:
        return encode_message(message)

    async def encode_reply(self, reply: Message) -> bytes:
        if isinstance(reply, StepResult) and reply.hidden.nbytes > BIG_REPLY_BYTES:  # int8 encoding included
            # a big prefill's reply (8 MB for 2,000 x 1024 float32: 6-27 ms) is copied on a thread: the event
            # loop gets the GIL back at every switch interval instead of stalling every other session's steps
            return await asyncio.to_thread(self.encode, reply)
        return self.encode(reply)

    async def dispatch(self, message: Message) -> Message:
        server = self.server
        if isinstance(message, Hello):
            self.state.accept_hello(message)
            log.info("connection %d (%s): handshake ok, client %s", self.conn_id, self.remote, message.client)
            return Welcome(
                server=f"splitspec-trunk/{__version__}",
                max_message_bytes=server.config.max_message_bytes,
                max_query_tokens=server.config.max_query_tokens,
                session_ttl_s=server.config.session_ttl_s,
                trunk=server.trunk_fingerprint,
                wire_codec=message.wire_codec,
                wire_codecs=server.identity.wire_codecs,
                dtype=server.identity.dtype,
            )
        if isinstance(message, OpenSession):
            session = server.sessions.open(self.conn_id, self.address)
            return SessionOpened(request_id=message.request_id, session_id=session.session_id)
        if isinstance(message, Step):
            self.state.check_step_codec(message.codec)
            return await server.run_step(message, self.conn_id)
        if isinstance(message, CloseSession):
            server.sessions.get(message.session_id, self.conn_id)
            server.sessions.close(message.session_id, "closed by the edge")
            return SessionClosed(session_id=message.session_id)
        raise UnexpectedMessage(f"a server does not accept {message.TYPE!r} messages")

    def served(self, request: Message | None, reply: Message | Error, bytes_in: int, bytes_out: int) -> None:
        metrics = self.server.metrics
        metrics.wire_bytes.labels("in", "undecodable" if request is None else request.TYPE).inc(bytes_in)
        metrics.wire_bytes.labels("out", reply.TYPE).inc(bytes_out)
        if isinstance(reply, Error):
            metrics.errors.labels(reply.code).inc()
        if isinstance(request, Step):
            self.server.sessions.account_bytes(request.session_id, self.conn_id, bytes_in, bytes_out)

    async def closed(self) -> None:
        self.server.sessions.close_owned_by(self.conn_id)


async def serve_forever(config: CloudConfig) -> None:
    """Run a trunk server until SIGINT or SIGTERM."""
    await run_until_signalled(TrunkServer(config), "trunk server")
