"""Typed wire messages and their (de)serialization.

Conversation (edge -> cloud on the left)::

    Hello            ->   <- Welcome                 once per connection; pins version, model
                                                     fingerprint, trunk layer range, dtype, auth
                                                     and the hidden states' wire codec; the
                                                     Welcome carries the trunk's content
                                                     fingerprint, which the edge checks, its
                                                     dtype, which an edge that says "auto"
                                                     follows, and the codecs the trunk accepts
    OpenSession      ->   <- SessionOpened           a session owns one KV cache on the cloud
    Step             ->   <- StepResult              hidden states in, hidden states out
    CloseSession     ->   <- SessionClosed
    (anything)       ->   <- Error                   typed refusal; the connection stays usable
                                                     unless the error is about the handshake

A :class:`Step` carries, for each of its q query tokens, the position id and the index of its
parent within the step (-1 = the committed prefix). The trunk rebuilds the attention mask from
those, so a step's size depends on q only, never on the context length. The optional
:class:`CacheCommand` edits the cache *before* the step runs: it is how the edge tells the cloud
which speculative tokens of the previous step were accepted, without an extra round trip.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from splitspec.exceptions import BadTensor, MalformedFrame, PositionOutOfRange
from splitspec.protocol.codec import WIRE_CODECS, decode_hidden, encode_hidden
from splitspec.protocol.fields import choice_field, int_field, number_field, str_field, tensor_field
from splitspec.protocol.frames import Frame, decode_frame, encode_frame
from splitspec.protocol.trunk_fingerprint import MAX_TEXT_LEN as MAX_TRUNK_TEXT_LEN
from splitspec.protocol.trunk_fingerprint import TrunkFingerprint

MAX_ID_LEN = 128
AUTO_DTYPE = "auto"  # a Hello's dtype when the edge follows the trunk's (given in the Welcome)
WIRE_DTYPE_NAMES = ("float32", "bfloat16", "float16")  # a session's hidden-state dtypes
MAX_ERROR_CHARS = 4096  # longest error message a peer accepts, characters
MAX_RETRY_AFTER_S = 3600.0  # longest retry-after hint a peer accepts, seconds


@dataclass(frozen=True)
class Hello:
    """Edge -> cloud, first message of a connection: what the edge expects the trunk to be."""

    TYPE: ClassVar[str] = "hello"
    fingerprint: str  # model fingerprint (config hash), see models.checkpoint.fingerprint
    layer_start: int  # first trunk layer index (inclusive)
    layer_end: int  # last trunk layer index (exclusive)
    dtype: str  # the edge's compute dtype, e.g. "float32" (the raw codec's wire dtype); "auto": the trunk's (Welcome)
    hidden_size: int  # width of the hidden states, in elements
    auth_token: str | None = None  # shared secret, when the server requires one
    client: str = "splitspec"  # free-form client name, for logs
    wire_codec: str = "raw"  # how hidden states travel both ways (protocol.codec); the trunk must accept it

    def to_wire(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        return {
            "fingerprint": self.fingerprint,
            "layer_start": self.layer_start,
            "layer_end": self.layer_end,
            "dtype": self.dtype,
            "hidden_size": self.hidden_size,
            "auth_token": self.auth_token,
            "client": self.client,
            "wire_codec": self.wire_codec,
        }, {}

    @classmethod
    def from_wire(cls, frame: Frame) -> Hello:
        h = frame.header
        return cls(
            fingerprint=str_field(h, "fingerprint", max_len=256),
            layer_start=int_field(h, "layer_start"),
            layer_end=int_field(h, "layer_end"),
            dtype=str_field(h, "dtype", max_len=32),
            hidden_size=int_field(h, "hidden_size", minimum=1),
            auth_token=str_field(h, "auth_token", optional=True, max_len=1024),
            client=str_field(h, "client", max_len=256),
            wire_codec=choice_field(h, "wire_codec", WIRE_CODECS),
        )


@dataclass(frozen=True)
class Welcome:
    """Cloud -> edge: the handshake is accepted; the limits the edge must respect."""

    TYPE: ClassVar[str] = "welcome"
    server: str  # server name and version, for logs
    max_message_bytes: int  # largest frame the server accepts, in bytes
    max_query_tokens: int  # largest q of one Step, in tokens
    session_ttl_s: float  # idle seconds after which a session is dropped
    trunk: TrunkFingerprint  # what the trunk's weights are; the edge checks it against its own copy
    dtype: str  # the trunk's compute dtype ("float32", "bfloat16", "float16"), the raw codec's wire dtype
    wire_codec: str = "raw"  # the Hello's codec, which this connection's steps use both ways
    wire_codecs: tuple[str, ...] = WIRE_CODECS  # every codec the trunk accepts (cloud serve --wire-codecs)

    def to_wire(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        return {
            "server": self.server,
            "max_message_bytes": self.max_message_bytes,
            "max_query_tokens": self.max_query_tokens,
            "session_ttl_s": self.session_ttl_s,
            "trunk_fingerprint": str(self.trunk),
            "wire_codec": self.wire_codec,
            "wire_codecs": list(self.wire_codecs),
            "dtype": self.dtype,
        }, {}

    @classmethod
    def from_wire(cls, frame: Frame) -> Welcome:
        h = frame.header
        return cls(
            server=str_field(h, "server", max_len=256),
            max_message_bytes=int_field(h, "max_message_bytes", minimum=1),
            max_query_tokens=int_field(h, "max_query_tokens", minimum=1),
            session_ttl_s=number_field(h, "session_ttl_s"),
            trunk=_trunk_field(h),
            dtype=_dtype_field(h),
            wire_codec=choice_field(h, "wire_codec", WIRE_CODECS),
            wire_codecs=_codecs_field(h),
        )


def _dtype_field(header: dict[str, Any]) -> str:
    """A Welcome's dtype: one of the wire's hidden-state dtypes, nothing else."""
    text: str = str_field(header, "dtype", max_len=32)
    if text not in WIRE_DTYPE_NAMES:
        raise MalformedFrame(f"field 'dtype': {text!r:.40} is not one of {', '.join(WIRE_DTYPE_NAMES)}")
    return text


def _codecs_field(header: dict[str, Any]) -> tuple[str, ...]:
    value = header.get("wire_codecs")
    if not isinstance(value, list) or not value or not all(c in WIRE_CODECS for c in value):
        raise MalformedFrame(f"field 'wire_codecs' must be a non-empty list of {WIRE_CODECS}, got {value!r:.80}")
    return tuple(value)


def _codec_field(header: dict[str, Any]) -> str:
    """A step's or a reply's codec: absent means raw."""
    return "raw" if "codec" not in header else choice_field(header, "codec", WIRE_CODECS)


def _hidden_field(frame: Frame, codec: str, *, min_tokens: int) -> torch.Tensor:
    """The hidden state (1, q >= ``min_tokens``, H) a step or a reply carries in ``codec``, decoded."""
    hidden = tensor_field(frame, "hidden")
    if hidden.dim() != 3 or hidden.shape[0] != 1 or hidden.shape[1] < min_tokens:
        raise BadTensor(f"hidden must have shape (1, q>={min_tokens}, H), got {tuple(hidden.shape)}")
    return decode_hidden(codec, frame.tensors)


def _trunk_field(header: dict[str, Any]) -> TrunkFingerprint:
    text = str_field(header, "trunk_fingerprint", max_len=MAX_TRUNK_TEXT_LEN)
    try:
        return TrunkFingerprint.parse(text)
    except ValueError as exc:
        raise MalformedFrame(f"field 'trunk_fingerprint': {exc}") from None


@dataclass(frozen=True)
class OpenSession:
    """Edge -> cloud: create a fresh session (an empty KV cache)."""

    TYPE: ClassVar[str] = "open_session"
    request_id: int  # echoed in SessionOpened

    def to_wire(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        return {"request_id": self.request_id}, {}

    @classmethod
    def from_wire(cls, frame: Frame) -> OpenSession:
        return cls(request_id=int_field(frame.header, "request_id"))


@dataclass(frozen=True)
class SessionOpened:
    """Cloud -> edge: the new session's id."""

    TYPE: ClassVar[str] = "session_opened"
    request_id: int
    session_id: str

    def to_wire(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        return {"request_id": self.request_id, "session_id": self.session_id}, {}

    @classmethod
    def from_wire(cls, frame: Frame) -> SessionOpened:
        h = frame.header
        return cls(request_id=int_field(h, "request_id"), session_id=str_field(h, "session_id", max_len=MAX_ID_LEN))


def truncated_length(length: int, truncate_to: int) -> int:
    """Entries left when a cache of ``length`` entries is truncated to ``truncate_to``; ValueError if impossible."""
    if not 0 <= truncate_to <= length:
        raise ValueError(f"cannot truncate a cache of {length} entries to {truncate_to}")
    return truncate_to


def kept_length(length: int, last_step: int, keep: Sequence[int]) -> int:
    """Entries left when only ``keep`` (indices within the last step of ``last_step`` tokens) of that step stay.

    ValueError if an index lies outside the last step. With :func:`truncated_length`, the one home
    of the cache-command arithmetic: the KV cache (``models.kv_cache``) and the trunk's check of a
    step (:meth:`CacheCommand.length_after`) both use it.
    """
    if any(not 0 <= i < last_step for i in keep):
        raise ValueError(f"keep indices {tuple(keep)} outside the last step of {last_step} tokens")
    return length - last_step + len(keep)


@dataclass(frozen=True)
class CacheCommand:
    """Cache edit applied before a step runs.

    ``truncate_to``: drop every cache entry at index >= this (tokens). ``keep_last``: indices,
    within the previous step's query tokens, of the entries to keep (in order); the previous
    step's other entries are dropped. ``truncate_to`` applies first (and leaves no last step).
    """

    truncate_to: int | None = None
    keep_last: tuple[int, ...] | None = None

    def length_after(self, length: int, last_step: int) -> int:
        """Committed entries once this command edits a cache of ``length`` whose last step added ``last_step``.

        Raises :class:`PositionOutOfRange` if the command cannot apply to that cache.
        """
        try:
            if self.truncate_to is not None:
                length, last_step = truncated_length(length, self.truncate_to), 0
            if self.keep_last is not None:
                length = kept_length(length, last_step, self.keep_last)
        except ValueError as exc:
            raise PositionOutOfRange(str(exc)) from None
        return length

    def to_header(self) -> dict[str, Any]:
        return {
            "truncate_to": self.truncate_to,
            "keep_last": None if self.keep_last is None else list(self.keep_last),
        }

    @classmethod
    def from_header(cls, raw: object, max_keep: int) -> CacheCommand:
        if not isinstance(raw, dict):
            raise MalformedFrame("cache command is not an object")
        truncate_to = int_field(raw, "truncate_to", optional=True)
        keep = raw.get("keep_last")
        if keep is not None:
            if (
                not isinstance(keep, list)
                or len(keep) > max_keep
                or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in keep)
            ):
                raise MalformedFrame(f"keep_last must be a list of <= {max_keep} non-negative ints")
            if any(b <= a for a, b in itertools.pairwise(keep)):
                raise MalformedFrame("keep_last must be strictly increasing")
            keep = tuple(keep)
        return cls(truncate_to=truncate_to, keep_last=keep)


@dataclass(frozen=True)
class Step:
    """Edge -> cloud: run the trunk over q query tokens of a session.

    ``hidden`` (1, q, H), which travels in ``codec`` (protocol.codec; decoded: the raw codec's
    tensor as sent, else bfloat16 or float32); ``positions`` (q,) int32 absolute position ids;
    ``parents`` (q,) int32, parent index within the step or -1 for the committed prefix.
    """

    TYPE: ClassVar[str] = "step"
    session_id: str
    seq: int  # per-session step counter, echoed in the reply
    hidden: torch.Tensor  # (1, q, H)
    positions: torch.Tensor  # (q,) int32
    parents: torch.Tensor  # (q,) int32
    cache: CacheCommand | None = None
    codec: str = "raw"  # the hidden state's wire codec, the connection's (protocol.codec)
    # also return the trunk's state after this many model layers (layer_start < k < layer_end): the feature a
    # draft head reads from the middle of the model (EAGLE-3); None: not asked (the reply carries none)
    return_layer: int | None = None

    def to_wire(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        header: dict[str, Any] = {"session_id": self.session_id, "seq": self.seq, "codec": self.codec}
        if self.cache is not None:
            header["cache"] = self.cache.to_header()
        if self.return_layer is not None:
            header["return_layer"] = self.return_layer
        return header, {**encode_hidden(self.codec, self.hidden), "positions": self.positions, "parents": self.parents}

    @classmethod
    def from_wire(cls, frame: Frame) -> Step:
        h = frame.header
        codec = _codec_field(h)
        hidden = _hidden_field(frame, codec, min_tokens=1)
        positions = tensor_field(frame, "positions", torch.int32)
        parents = tensor_field(frame, "parents", torch.int32)
        q = hidden.shape[1]
        if tuple(positions.shape) != (q,) or tuple(parents.shape) != (q,):
            raise BadTensor(f"positions and parents must have shape ({q},)")
        check_parents(parents)
        cache = h.get("cache")
        return cls(
            session_id=str_field(h, "session_id", max_len=MAX_ID_LEN),
            seq=int_field(h, "seq"),
            hidden=hidden,
            positions=positions,
            parents=parents,
            cache=None if cache is None else CacheCommand.from_header(cache, max_keep=1 << 16),
            codec=codec,
            return_layer=int_field(h, "return_layer", minimum=1, optional=True),
        )


FEATURE_PREFIX = "feature."  # a reply's feature travels as the hidden state's tensors under these names


@dataclass(frozen=True)
class StepResult:
    """Cloud -> edge: the trunk's output hidden states (1, q, H) and its compute time."""

    TYPE: ClassVar[str] = "step_result"
    session_id: str
    seq: int
    hidden: torch.Tensor  # (1, q, H), travelling in codec like the step's
    cloud_ms: float  # trunk compute on the cloud, with its copies to and from the device, milliseconds
    codec: str = "raw"  # the hidden state's wire codec: the step's
    feature: torch.Tensor | None = None  # (1, q, H): the state after the step's return_layer, in codec; None: unasked
    # the step's wait on the cloud before its compute began (the trunk's batch gathering and the
    # batches ahead of it, or the thread pool), milliseconds; absent on the wire when 0
    queue_ms: float = 0.0

    def to_wire(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        header = {"session_id": self.session_id, "seq": self.seq, "cloud_ms": self.cloud_ms, "codec": self.codec}
        if self.queue_ms > 0.0:
            header["queue_ms"] = self.queue_ms
        tensors = encode_hidden(self.codec, self.hidden)
        if self.feature is not None:
            tensors |= {FEATURE_PREFIX + k: v for k, v in encode_hidden(self.codec, self.feature).items()}
        return header, tensors

    @classmethod
    def from_wire(cls, frame: Frame) -> StepResult:
        h = frame.header
        codec = _codec_field(h)
        hidden = _hidden_field(frame, codec, min_tokens=0)
        feature = None
        if any(name.startswith(FEATURE_PREFIX) for name in frame.tensors):
            tensors = {
                k.removeprefix(FEATURE_PREFIX): v for k, v in frame.tensors.items() if k.startswith(FEATURE_PREFIX)
            }
            feature = _hidden_field(Frame(frame.header, tensors), codec, min_tokens=0)
            if feature.shape != hidden.shape:
                raise BadTensor(
                    f"the feature's shape {tuple(feature.shape)} is not the hidden state's {tuple(hidden.shape)}"
                )
        return cls(
            session_id=str_field(h, "session_id", max_len=MAX_ID_LEN),
            seq=int_field(h, "seq"),
            hidden=hidden,
            cloud_ms=number_field(h, "cloud_ms"),
            codec=codec,
            feature=feature,
            queue_ms=number_field(h, "queue_ms", optional=True) or 0.0,
        )


@dataclass(frozen=True)
class CloseSession:
    """Edge -> cloud: free a session's cache."""

    TYPE: ClassVar[str] = "close_session"
    session_id: str

    def to_wire(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        return {"session_id": self.session_id}, {}

    @classmethod
    def from_wire(cls, frame: Frame) -> CloseSession:
        return cls(session_id=str_field(frame.header, "session_id", max_len=MAX_ID_LEN))


@dataclass(frozen=True)
class SessionClosed:
    """Cloud -> edge: the session is gone."""

    TYPE: ClassVar[str] = "session_closed"
    session_id: str

    def to_wire(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        return {"session_id": self.session_id}, {}

    @classmethod
    def from_wire(cls, frame: Frame) -> SessionClosed:
        return cls(session_id=str_field(frame.header, "session_id", max_len=MAX_ID_LEN))


@dataclass(frozen=True)
class Error:
    """Either direction: a typed refusal. ``code`` names a ProtocolError subclass."""

    TYPE: ClassVar[str] = "error"
    code: str
    message: str
    session_id: str | None = None
    seq: int | None = None
    fatal: bool = field(default=False)  # the sender closes the connection after this
    retry_after_s: float | None = None  # when the request may succeed if sent again, seconds (capacity)

    def to_wire(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        return {
            "code": self.code,
            "message": self.message,
            "session_id": self.session_id,
            "seq": self.seq,
            "fatal": self.fatal,
            "retry_after_s": self.retry_after_s,
        }, {}

    @classmethod
    def from_wire(cls, frame: Frame) -> Error:
        h = frame.header
        return cls(
            code=str_field(h, "code", max_len=64),
            message=str_field(h, "message", max_len=MAX_ERROR_CHARS),
            session_id=str_field(h, "session_id", optional=True, max_len=MAX_ID_LEN),
            seq=int_field(h, "seq", optional=True),
            fatal=bool(h.get("fatal", False)),
            retry_after_s=number_field(h, "retry_after_s", optional=True, upper=MAX_RETRY_AFTER_S),
        )


Message = Hello | Welcome | OpenSession | SessionOpened | Step | StepResult | CloseSession | SessionClosed | Error
_TYPES: dict[str, Any] = {
    cls.TYPE: cls
    for cls in (Hello, Welcome, OpenSession, SessionOpened, Step, StepResult, CloseSession, SessionClosed, Error)
}


def check_parents(parents: torch.Tensor) -> None:
    """Each query token's parent must be -1 (the committed prefix) or an earlier token of the step."""
    q = parents.shape[0]
    if q == 1:  # a decode step, the common case: read the one value instead of three tensor operations
        bad = int(parents[0]) != -1
    else:
        bad = bool(((parents < -1) | (parents >= torch.arange(q, dtype=parents.dtype))).any())
    if bad:
        raise PositionOutOfRange("every parent must be -1 or the index of an earlier query token")


def encode_message(message: Message) -> bytes:
    """Serialize a typed message into one frame."""
    header, tensors = message.to_wire()
    return encode_frame({"type": message.TYPE, **header}, tensors)


def decode_message(data: bytes, *, max_bytes: int | None = None) -> Message:
    """Parse one frame into a typed message, validating every field."""
    frame = decode_frame(data, max_bytes=max_bytes)
    kind = frame.header.get("type")
    cls = _TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise MalformedFrame(f"unknown message type {kind!r}")
    message: Message = cls.from_wire(frame)
    return message
