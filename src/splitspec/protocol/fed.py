"""Typed wire messages of federated speculative inference (SpecFed), sans-I/O.

Conversation (coordinator -> worker on the left), one session per connection::

    FedHello         ->   <- FedWelcome              pins protocol version, vocabulary size and
                                                     tokenizer fingerprint, auth
    FedScore         ->   <- FedScores               draft tokens in, compact top-K laws out
    (anything)       ->   <- Error                   typed refusal (protocol.messages.Error)

A :class:`FedScore` says how many tokens of the worker's cache to keep (``keep``: the accepted
prefix of the previous round, so rollback costs no extra round trip), the new tokens to append
(the tokens committed since, then the γ draft tokens) and how many of the last positions to score
(γ + 1). The worker answers, per scored position, only its top-K (token id, probability) pairs in
the bit stream of :mod:`splitspec.federated.codec`; in audit mode it adds the full distributions.

Every message but :class:`FedScores` is a frame of :mod:`splitspec.protocol.frames`. FedScores is
the hot uplink message and has its own fixed binary layout (big-endian), because a JSON header
would weigh as much as the top-K it carries::

    offset  size  field
    0       4     magic b"SPFS"
    4       2     federated protocol version (uint16)
    6       4     seq (uint32)
    10      2     positions (uint16)
    12      4     vocabulary size (uint32)
    16      4     worker compute time, microseconds (uint32, saturating)
    20      1     flags: bit 0 = full distributions follow the stream (audit mode)
    21      4     stream length S (uint32)
    25      S     top-K bit stream (federated.codec)
    25+S    ...   audit mode only: positions × vocabulary float32, little-endian

Nothing here imports asyncio, websockets or transformers.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, get_args

import torch

from splitspec.exceptions import (
    BadMagic,
    BadTensor,
    HandshakeMismatch,
    MalformedFrame,
    MessageTooLarge,
    UnsupportedVersion,
)
from splitspec.protocol.choices import DEFAULT_QUANT_BUDGET
from splitspec.protocol.fields import (
    bool_field,
    choice_field,
    int_field,
    number_field,
    str_field,
    tensor_field,
)
from splitspec.protocol.frames import Frame, decode_frame, encode_frame, tensor_bytes
from splitspec.protocol.messages import Error
from splitspec.protocol.state import check_secret

FED_VERSION = 2  # version of the federated conversation (the frame version is separate)
ValueCodec = Literal["quantized", "float16", "float32"]  # how top-K probabilities travel
EpsilonScope = Literal["position", "round"]  # where an adaptive-K target applies
VALUE_CODECS: tuple[ValueCodec, ...] = get_args(ValueCodec)
EPSILON_SCOPES: tuple[EpsilonScope, ...] = get_args(EpsilonScope)
MAX_QUANT_BUDGET = 0.5  # largest quantization budget ρ a coordinator may ask for
MAX_TEMPERATURE = 100.0  # highest softmax temperature a worker applies (a FedScore asking for more is refused)
# most positions a worker scores for one FedScore by default (a round's γ + 1): coordinators keep γ below it
MAX_SCORED_POSITIONS = 64
DEFAULT_MAX_K = 4096  # cap on adaptive K when a coordinator sets none, tokens
SCORES_MAGIC = b"SPFS"
MAX_SEQ = 0xFFFFFFFF  # a round counter travels as uint32 in FedScores
_SCORES_HEAD = struct.Struct(">4sHIHIIBI")  # magic, version, seq, positions, vocab, worker µs, flags, S
SCORES_HEADER_SIZE = _SCORES_HEAD.size  # 25 bytes
_AUDIT_FLAG = 1


@dataclass(frozen=True)
class FedHello:
    """Coordinator -> worker, first message: the vocabulary the coordinator's drafts live in."""

    TYPE: ClassVar[str] = "fed_hello"
    vocab_size: int  # logits width of the draft model, tokens
    tokenizer_fingerprint: str  # hash of the tokenizer's vocabulary, see federated.lm
    auth_token: str | None = None  # shared secret, when the worker requires one
    client: str = "splitspec-fed"  # free-form client name, for logs
    fed_version: int = FED_VERSION

    def to_wire(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        return {
            "vocab_size": self.vocab_size,
            "tokenizer_fingerprint": self.tokenizer_fingerprint,
            "auth_token": self.auth_token,
            "client": self.client,
            "fed_version": self.fed_version,
        }, {}

    @classmethod
    def from_wire(cls, frame: Frame) -> FedHello:
        h = frame.header
        return cls(
            vocab_size=int_field(h, "vocab_size", minimum=1),
            tokenizer_fingerprint=str_field(h, "tokenizer_fingerprint", max_len=128),
            auth_token=str_field(h, "auth_token", optional=True, max_len=1024),
            client=str_field(h, "client", max_len=256),
            fed_version=int_field(h, "fed_version", minimum=1),
        )


@dataclass(frozen=True)
class FedWelcome:
    """Worker -> coordinator: the handshake is accepted; the worker's limits."""

    TYPE: ClassVar[str] = "fed_welcome"
    worker: str  # worker name and version, for logs
    model_fingerprint: str  # config hash of the worker's model (models.checkpoint.fingerprint)
    vocab_size: int  # logits width, tokens
    tokenizer_fingerprint: str  # same hash as in the Hello
    max_message_bytes: int  # largest frame the worker accepts, bytes
    max_query_tokens: int  # most tokens one FedScore may append, tokens
    max_positions: int  # longest sequence the worker's model supports, tokens

    def to_wire(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        return {
            "worker": self.worker,
            "model_fingerprint": self.model_fingerprint,
            "vocab_size": self.vocab_size,
            "tokenizer_fingerprint": self.tokenizer_fingerprint,
            "max_message_bytes": self.max_message_bytes,
            "max_query_tokens": self.max_query_tokens,
            "max_positions": self.max_positions,
        }, {}

    @classmethod
    def from_wire(cls, frame: Frame) -> FedWelcome:
        h = frame.header
        return cls(
            worker=str_field(h, "worker", max_len=256),
            model_fingerprint=str_field(h, "model_fingerprint", max_len=128),
            vocab_size=int_field(h, "vocab_size", minimum=1),
            tokenizer_fingerprint=str_field(h, "tokenizer_fingerprint", max_len=128),
            max_message_bytes=int_field(h, "max_message_bytes", minimum=1),
            max_query_tokens=int_field(h, "max_query_tokens", minimum=1),
            max_positions=int_field(h, "max_positions", minimum=1),
        )


@dataclass(frozen=True)
class FedScore:
    """Coordinator -> worker: keep ``keep`` cached tokens, append ``tokens``, score the last positions.

    Row j of the reply is the next-token law after ``context[: keep + n − num_scored + j + 1]``.
    Exactly one of ``k`` (fixed K) and ``target_epsilon`` (adaptive K, capped at ``max_k``) is set.
    """

    TYPE: ClassVar[str] = "fed_score"
    seq: int  # per-connection round counter, echoed in the reply
    keep: int  # cached tokens to keep before appending, tokens
    tokens: torch.Tensor  # (n,) int32 token ids to append
    num_scored: int  # positions to score, the last ones of ``tokens`` (γ + 1)
    temperature: float  # softmax temperature the worker applies; 0 means 1 (greedy uses argmax)
    k: int | None = None  # fixed K per position, tokens
    target_epsilon: float | None = None  # adaptive K: largest residual mass allowed, probability
    max_k: int = DEFAULT_MAX_K  # cap on adaptive K, tokens
    epsilon_scope: EpsilonScope = "position"  # adaptive K: target per position, or on a round's mean
    prob_codec: ValueCodec = "quantized"  # how top-K probabilities travel
    quant_budget: float = DEFAULT_QUANT_BUDGET  # ρ: quantization error allowed, fraction of the tail mass
    audit: bool = False  # also return the full distributions (n_scored, V) float32

    def to_wire(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        return {
            "seq": self.seq,
            "keep": self.keep,
            "num_scored": self.num_scored,
            "temperature": self.temperature,
            "k": self.k,
            "target_epsilon": self.target_epsilon,
            "max_k": self.max_k,
            "epsilon_scope": self.epsilon_scope,
            "prob_codec": self.prob_codec,
            "quant_budget": self.quant_budget,
            "audit": self.audit,
        }, {"tokens": self.tokens}

    @classmethod
    def from_wire(cls, frame: Frame) -> FedScore:
        h = frame.header
        tokens = tensor_field(frame, "tokens", torch.int32)
        if tokens.dim() != 1 or tokens.numel() < 1:
            raise BadTensor(f"tokens must have shape (n>=1,), got {tuple(tokens.shape)}")
        num_scored = int_field(h, "num_scored", minimum=1, maximum=0xFFFF)  # uint16 in the reply
        if num_scored > tokens.numel():
            raise BadTensor(f"cannot score {num_scored} positions of {tokens.numel()} new tokens")
        k = int_field(h, "k", minimum=1, optional=True)
        target_epsilon = number_field(h, "target_epsilon", optional=True, upper=1.0)
        if (k is None) == (target_epsilon is None):
            raise MalformedFrame("give exactly one of 'k' and 'target_epsilon'")
        if target_epsilon is not None and target_epsilon >= 1.0:  # the top-K policy's own limit
            raise MalformedFrame(f"target_epsilon must be in [0, 1), got {target_epsilon}")
        prob_codec = choice_field(h, "prob_codec", VALUE_CODECS)
        scope = choice_field(h, "epsilon_scope", EPSILON_SCOPES)
        quant_budget = number_field(h, "quant_budget", upper=MAX_QUANT_BUDGET)
        if quant_budget <= 0:
            raise MalformedFrame("quant_budget must be positive")
        return cls(
            seq=int_field(h, "seq", maximum=MAX_SEQ),  # checked here, not when the reply is packed
            keep=int_field(h, "keep"),
            tokens=tokens,
            num_scored=num_scored,
            temperature=number_field(h, "temperature", upper=MAX_TEMPERATURE),
            k=k,
            target_epsilon=target_epsilon,
            max_k=int_field(h, "max_k", minimum=1),
            epsilon_scope=scope,
            prob_codec=prob_codec,
            quant_budget=quant_budget,
            audit=bool_field(h, "audit"),
        )


@dataclass(frozen=True)
class FedScores:
    """Worker -> coordinator: per scored position, the top-K as a bit stream (layout in the module doc).

    ``stream`` is opaque here; :func:`splitspec.federated.codec.decode_topk` validates it.
    """

    TYPE: ClassVar[str] = "fed_scores"
    seq: int  # round counter of the request this answers
    positions: int  # scored positions, = num_scored of the request
    vocab_size: int  # tokens
    stream: bytes  # top-K bit stream
    worker_ms: float  # model compute time on the worker, milliseconds (sent in whole microseconds)
    full: torch.Tensor | None = None  # (positions, V) float32, audit mode only

    def to_bytes(self) -> bytes:
        worker_us = min(0xFFFFFFFF, max(0, round(self.worker_ms * 1e3)))
        head = _SCORES_HEAD.pack(
            SCORES_MAGIC,
            FED_VERSION,
            self.seq,
            self.positions,
            self.vocab_size,
            worker_us,
            _AUDIT_FLAG if self.full is not None else 0,
            len(self.stream),
        )
        full = b"" if self.full is None else tensor_bytes(self.full.float())
        return head + self.stream + full

    @classmethod
    def from_bytes(cls, data: bytes, *, max_bytes: int | None = None) -> FedScores:
        if max_bytes is not None and len(data) > max_bytes:
            raise MessageTooLarge(f"fed_scores of {len(data)} bytes exceeds the limit of {max_bytes}")
        if len(data) < SCORES_HEADER_SIZE:
            raise MalformedFrame(
                f"fed_scores of {len(data)} bytes is shorter than its {SCORES_HEADER_SIZE}-byte header"
            )
        magic, version, seq, positions, vocab, worker_us, flags, nbytes = _SCORES_HEAD.unpack_from(data)
        if magic != SCORES_MAGIC:
            raise BadMagic(f"expected {SCORES_MAGIC!r}, got {magic!r}")
        if version != FED_VERSION:
            raise UnsupportedVersion(f"federated protocol version {version}, expected {FED_VERSION}")
        if positions < 1 or vocab < 1:
            raise MalformedFrame(f"fed_scores needs positions >= 1 and a vocabulary >= 1, got {positions}, {vocab}")
        if flags & ~_AUDIT_FLAG:
            raise MalformedFrame(f"unknown fed_scores flags {flags:#x}")
        full_bytes = positions * vocab * 4 if flags & _AUDIT_FLAG else 0
        if len(data) != SCORES_HEADER_SIZE + nbytes + full_bytes:
            raise BadTensor(
                f"fed_scores is {len(data)} bytes; its header says {SCORES_HEADER_SIZE} + {nbytes} + {full_bytes}"
            )
        end = SCORES_HEADER_SIZE + nbytes
        full = None
        if full_bytes:
            full = torch.frombuffer(bytearray(memoryview(data)[end:]), dtype=torch.float32).reshape(positions, vocab)
        return cls(
            seq=seq,
            positions=positions,
            vocab_size=vocab,
            stream=bytes(data[SCORES_HEADER_SIZE:end]),
            worker_ms=worker_us / 1e3,
            full=full,
        )


FedMessage = FedHello | FedWelcome | FedScore | FedScores | Error
_TYPES: dict[str, Any] = {cls.TYPE: cls for cls in (FedHello, FedWelcome, FedScore, Error)}


def encode_fed(message: FedMessage) -> bytes:
    """Serialize a federated message into one frame (FedScores: its own binary layout)."""
    if isinstance(message, FedScores):
        return message.to_bytes()
    header, tensors = message.to_wire()
    return encode_frame({"type": message.TYPE, **header}, tensors)


def decode_fed(data: bytes, *, max_bytes: int | None = None) -> FedMessage:
    """Parse one frame into a typed federated message, validating every field."""
    if data[: len(SCORES_MAGIC)] == SCORES_MAGIC:
        return FedScores.from_bytes(data, max_bytes=max_bytes)
    frame = decode_frame(data, max_bytes=max_bytes)
    kind = frame.header.get("type")
    cls = _TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise MalformedFrame(f"unknown federated message type {kind!r}")
    message: FedMessage = cls.from_wire(frame)
    return message


@dataclass(frozen=True)
class WorkerIdentity:
    """What a worker is: the coordinator's FedHello must match it."""

    vocab_size: int  # logits width, tokens
    tokenizer_fingerprint: str  # hash of the tokenizer's vocabulary


def check_fed_hello(hello: FedHello, identity: WorkerIdentity, auth_token: str | None) -> None:
    """Check auth, version, vocabulary size and tokenizer; raise a typed error on any mismatch."""
    check_secret(hello.auth_token, auth_token)
    mismatches = [
        f"{name}: coordinator has {theirs!r}, worker has {ours!r}"
        for name, theirs, ours in (
            ("fed_version", hello.fed_version, FED_VERSION),
            ("vocab_size", hello.vocab_size, identity.vocab_size),
            ("tokenizer_fingerprint", hello.tokenizer_fingerprint, identity.tokenizer_fingerprint),
        )
        if theirs != ours
    ]
    if mismatches:
        raise HandshakeMismatch("; ".join(mismatches))
