"""The SpecFed worker: a whole local LLM that scores a coordinator's draft tokens.

Each connection is one session with its own KV cache. Per round the worker keeps the accepted
prefix of its cache (``FedScore.keep``), appends the new tokens in one forward pass, turns the
last γ + 1 positions into probabilities at the requested temperature and answers with only their
top-K (fixed K or adaptive by target ε) in the compact encoding of
:mod:`splitspec.federated.topk`; in audit mode it adds the full distributions.

The handshake pins the vocabulary size and the tokenizer fingerprint: a coordinator whose drafts
live in another vocabulary is refused with ``HandshakeMismatch`` and the connection is closed.
Model compute runs on one worker thread so the event loop keeps answering pings.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from splitspec import __version__
from splitspec.decoding.local import LocalSequence
from splitspec.decoding.sampling import probabilities
from splitspec.devices import HostStaging, resolve_device
from splitspec.exceptions import (
    BadTensor,
    ConfigError,
    PositionOutOfRange,
    SessionQuotaExceeded,
    TooManySessions,
    UnexpectedMessage,
)
from splitspec.federated.codec import encode_topk, max_reply_bytes
from splitspec.federated.lm import LoadedModel, load_model
from splitspec.federated.topk import TopKPolicy, scoring_temperature, select_topk
from splitspec.protocol.fed import (
    MAX_SCORED_POSITIONS,
    FedHello,
    FedMessage,
    FedScore,
    FedScores,
    FedWelcome,
    WorkerIdentity,
    check_fed_hello,
    decode_fed,
    encode_fed,
)
from splitspec.protocol.state import HandshakeGate
from splitspec.transport.peer import MessagePeer
from splitspec.transport.server import ConnectionLimits, FrameServer, run_until_signalled, warn_if_open

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerConfig:
    """Everything a worker needs, built once by the CLI."""

    model_dir: Path  # HF checkpoint directory with tokenizer
    host: str = "127.0.0.1"  # interface to listen on
    port: int = 8780  # TCP port; 0 picks a free one
    auth_token: str | None = None  # shared secret the coordinator must present
    max_message_bytes: int = 64 * 1024 * 1024  # largest frame accepted or sent, bytes
    max_query_tokens: int = 4096  # most tokens one FedScore may append, tokens
    # most positions one FedScore may ask scores for (a round's gamma + 1): bounds the (positions, V) float32
    # probabilities and the adaptive K's sort a reply builds
    max_scored_positions: int = MAX_SCORED_POSITIONS
    max_sessions: int = 16  # concurrent connections (each holds a KV cache)
    max_sessions_per_address: int = 4  # sessions one IP address may hold at once
    handshake_timeout_s: float = 10.0  # seconds a new connection has to complete its handshake
    max_unauthenticated: int = 64  # connections in their handshake at once, all addresses
    max_connections_per_address: int = 32  # open connections from one IP address
    idle_timeout_s: float = 300.0  # a session's connection silent this long is closed, seconds
    delay_s: float = 0.0  # artificial extra compute time per round, seconds (tests, demos)
    device: str = "auto"  # compute device: auto, cpu, cuda, cuda:N or mps
    dtype: str = "auto"  # compute dtype: auto (models.precision: per device), float32, bfloat16 or float16

    def __post_init__(self) -> None:
        if self.max_sessions < 1 or self.max_sessions_per_address < 1:
            raise ConfigError("--max-sessions and --max-sessions-per-address must be at least 1")
        if self.max_message_bytes < 1:
            raise ConfigError("--max-message-mb must be at least 1")
        if self.max_scored_positions < 1:
            raise ConfigError("the scored positions a request may ask for must be at least 1")
        # a `<= 0` check lets NaN through (every comparison with it is false), and a NaN timeout never fires
        if not (math.isfinite(self.handshake_timeout_s) and self.handshake_timeout_s > 0):
            raise ConfigError(f"--handshake-timeout must be a finite number > 0, got {self.handshake_timeout_s}")
        if not (math.isfinite(self.idle_timeout_s) and self.idle_timeout_s > 0):
            raise ConfigError(f"the idle timeout must be a finite number > 0, got {self.idle_timeout_s}")
        if not (math.isfinite(self.delay_s) and self.delay_s >= 0):
            raise ConfigError(f"the artificial delay must be a finite number >= 0, got {self.delay_s}")


class FedWorker:
    """Loads a model and serves FedScore requests. Use as ``async with FedWorker(cfg) as worker``."""

    def __init__(self, config: WorkerConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        device = resolve_device(config.device) if loaded is None else loaded.model.device
        self.loaded = loaded if loaded is not None else load_model(config.model_dir, config.dtype, device)
        self._staging = HostStaging(device)
        self.identity = WorkerIdentity(
            vocab_size=self.loaded.vocab_size, tokenizer_fingerprint=self.loaded.tokenizer_fingerprint
        )
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fed-worker")
        limits = ConnectionLimits(
            handshake_timeout_s=config.handshake_timeout_s,
            max_unauthenticated=config.max_unauthenticated,
            max_per_address=config.max_connections_per_address,
            idle_timeout_s=config.idle_timeout_s,
        )
        self._frames = FrameServer(self._new_peer, config.host, config.port, config.max_message_bytes, limits=limits)
        self._connections = 0
        self.active: dict[int, str] = {}  # connection id -> remote IP, past its handshake (each holds a cache)
        self.rounds_served = 0  # FedScore requests answered, all sessions

    @property
    def port(self) -> int:
        return self._frames.port

    @property
    def url(self) -> str:
        return f"ws://{self.config.host}:{self.port}"

    async def start(self) -> None:
        await self._frames.start()
        log.info(
            "fed worker on %s: %s (vocab %d, tokenizer %s, model %s)",
            self.url,
            self.config.model_dir,
            self.identity.vocab_size,
            self.identity.tokenizer_fingerprint,
            self.loaded.model_fingerprint,
        )
        warn_if_open(self.config.auth_token, self.url, "fed worker")

    async def stop(self) -> None:
        await self._frames.stop()
        self._executor.shutdown(wait=True)

    async def __aenter__(self) -> FedWorker:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    def _new_peer(self, remote: str) -> _WorkerPeer:
        self._connections += 1
        return _WorkerPeer(self, self._connections, remote)

    def score(self, lm: LocalSequence, request: FedScore) -> FedScores:
        """Run one round for a session (on the compute thread)."""
        t0 = time.perf_counter()
        lm.truncate(request.keep)
        logits = lm.append(request.tokens.tolist(), request.num_scored)
        temperature = scoring_temperature(request.temperature)  # a greedy run's scores at T = 1
        # the laws cross to the host once per round: top-K selection and the codec run there
        probs = self._staging.to_host(probabilities(logits, temperature))  # (num_scored, V)
        policy = TopKPolicy(
            k=request.k,
            target_epsilon=request.target_epsilon,
            max_k=request.max_k,
            scope=request.epsilon_scope,
        )
        topk = select_topk(probs, policy)
        stream = encode_topk(probs, topk, request.prob_codec, request.quant_budget)
        if self.config.delay_s > 0:
            time.sleep(self.config.delay_s)
        self.rounds_served += 1
        return FedScores(
            seq=request.seq,
            positions=request.num_scored,
            vocab_size=self.identity.vocab_size,
            stream=stream,
            worker_ms=(time.perf_counter() - t0) * 1e3,
            full=probs.float().contiguous() if request.audit else None,
        )


class _WorkerPeer(MessagePeer[FedMessage]):
    """One connection: handshake state and the session's cache."""

    label = "fed connection"

    def __init__(self, worker: FedWorker, conn_id: int, remote: str) -> None:
        super().__init__(HandshakeGate(FedHello.TYPE, worker.config.auth_token), conn_id, remote)
        self.worker = worker
        self.address = remote.rsplit(":", 1)[0]  # the IP address of "host:port"
        self.lm: LocalSequence | None = None

    def decode(self, data: bytes) -> FedMessage:
        return decode_fed(data, max_bytes=self.worker.config.max_message_bytes)

    def encode(self, message: FedMessage) -> bytes:
        return encode_fed(message)

    async def dispatch(self, message: FedMessage) -> FedMessage:
        worker = self.worker
        config = worker.config
        if isinstance(message, FedHello):
            self.gate.begin_hello(message.auth_token)
            check_fed_hello(message, worker.identity, config.auth_token)
            if len(worker.active) >= config.max_sessions:
                raise TooManySessions(f"the worker already serves {len(worker.active)} sessions")
            held = sum(1 for address in worker.active.values() if address == self.address)
            if held >= config.max_sessions_per_address:
                raise SessionQuotaExceeded(f"your address already holds its maximum of {held} sessions")
            self.gate.open()
            worker.active[self.conn_id] = self.address
            self.lm = LocalSequence(worker.loaded.model)
            log.info("fed connection %d (%s): handshake ok, client %s", self.conn_id, self.remote, message.client)
            return FedWelcome(
                worker=f"splitspec-fed-worker/{__version__}",
                model_fingerprint=worker.loaded.model_fingerprint,
                vocab_size=worker.identity.vocab_size,
                tokenizer_fingerprint=worker.identity.tokenizer_fingerprint,
                max_message_bytes=config.max_message_bytes,
                max_query_tokens=config.max_query_tokens,
                max_positions=worker.loaded.max_positions,
            )
        if isinstance(message, FedScore):
            lm = self.lm
            if lm is None:
                raise UnexpectedMessage("no session")
            self._validate(message, lm)
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(worker._executor, worker.score, lm, message)
        raise UnexpectedMessage(f"a worker does not accept {message.TYPE!r} messages")

    def _validate(self, request: FedScore, lm: LocalSequence) -> None:
        worker = self.worker
        n = request.tokens.numel()
        if request.keep > len(lm.tokens):
            raise PositionOutOfRange(f"cannot keep {request.keep} tokens of a cache holding {len(lm.tokens)}")
        if n > worker.config.max_query_tokens:
            raise BadTensor(f"{n} new tokens exceed the limit of {worker.config.max_query_tokens}")
        if request.num_scored > worker.config.max_scored_positions:
            raise BadTensor(
                f"scores at {request.num_scored} positions exceed this worker's limit of "
                f"{worker.config.max_scored_positions} (a round's gamma + 1)"
            )
        if request.keep + n > worker.loaded.max_positions:
            raise PositionOutOfRange(f"sequence of {request.keep + n} tokens exceeds {worker.loaded.max_positions}")
        vocab = worker.identity.vocab_size
        if bool(((request.tokens < 0) | (request.tokens >= vocab)).any()):
            raise BadTensor(f"token ids must be in [0, {vocab})")
        if request.k is not None and request.k > vocab:
            raise BadTensor(f"K = {request.k} exceeds the vocabulary of {vocab}")
        cap = request.k if request.k is not None else min(request.max_k, vocab)
        reply_bytes = max_reply_bytes(request.num_scored, cap, vocab, audit=request.audit)
        if reply_bytes > worker.config.max_message_bytes:
            raise BadTensor(f"the reply could reach {reply_bytes} bytes, above the cap")

    async def closed(self) -> None:
        self.lm = None
        self.worker.active.pop(self.conn_id, None)


async def serve_forever(config: WorkerConfig) -> None:
    """Run a fed worker until SIGINT or SIGTERM."""
    await run_until_signalled(FedWorker(config), "fed worker")
