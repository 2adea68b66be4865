"""The exception tree of splitspec.

Every error raised on purpose by splitspec derives from :class:`SplitspecError`::

    SplitspecError
    ├── ConfigError                 bad local configuration (split plan, checkpoint dir, CLI values)
    │   ├── CheckpointError         a checkpoint directory is missing files or tensors
    │   │   └── ModelNotFound       a --model id is not in the local Hugging Face cache (never downloaded)
    │   ├── DeviceUnavailable       the requested device (cuda, cuda:N, mps) is not on this machine
    │   └── InvalidGrammar          a JSON schema or grammar the grammar engine cannot compile
    ├── ProtocolError               a peer sent something we refuse; carries a wire ``code``
    │   ├── MalformedFrame          not a frame: too short, bad header JSON, trailing bytes
    │   ├── BadMagic                wrong magic bytes
    │   ├── UnsupportedVersion      protocol version we do not speak
    │   ├── BadDtype                tensor dtype outside the whitelist
    │   ├── BadTensor               shape / byte length / hidden size / field mismatch
    │   │   └── BadEncoding         a wire codec's payload is inconsistent: a missing or misshapen codec
    │   │                           tensor, a non-finite scale, an outlier index out of range or repeated
    │   ├── PositionOutOfRange      position ids or parents inconsistent with the session
    │   ├── MessageTooLarge         frame above the negotiated cap
    │   ├── UnexpectedMessage       a message type not allowed in the current state
    │   ├── HandshakeMismatch       model fingerprint, layer range, dtype or wire codec differ
    │   │   └── TrunkMismatch       the cloud's trunk content fingerprint is not the expected one
    │   ├── AuthenticationFailed    missing or wrong shared secret
    │   ├── UnknownSession          session id unknown, expired, or owned by another connection
    │   ├── TooManySessions         the server's max-sessions limit is reached
    │   │   └── SessionQuotaExceeded    this connection (or its address) holds its maximum of sessions
    │   ├── CapacityExceeded        the trunk's KV memory budget is full; may carry a retry-after hint
    │   └── ServerError             the server failed while computing (its bug, not ours)
    └── TransportError              the connection could not be made or was lost

A :class:`ProtocolError` travels over the wire as an ``Error`` message holding its ``code``;
:func:`error_from_code` turns the code back into the same class on the other side, so both ends
raise the same type.
"""

from __future__ import annotations


class SplitspecError(Exception):
    """Base class of every error splitspec raises on purpose."""


class ConfigError(SplitspecError):
    """A local configuration value is invalid (split plan, paths, CLI arguments)."""


class CheckpointError(ConfigError):
    """A checkpoint directory lacks a file or a tensor that the requested role needs."""


class ModelNotFound(CheckpointError):
    """A model id (``org/name[@revision]``) names no directory and no snapshot in the local Hugging Face cache."""


class DeviceUnavailable(ConfigError):
    """A device was requested (``--device cuda``, ``cuda:N``, ``mps``) that this machine does not have."""


class InvalidGrammar(ConfigError):
    """A JSON schema, Lark grammar or tool definition that llguidance refuses to compile."""


class CompileFailed(ConfigError):
    """``--compile``: torch.compile of the fixed-shape decode step failed (no silent eager fallback)."""


class TransportError(SplitspecError):
    """The connection to a peer could not be established or was lost."""


class ProtocolError(SplitspecError):
    """A peer sent a message we refuse. ``code`` is the stable wire identifier."""

    code = "protocol_error"


class MalformedFrame(ProtocolError):
    code = "malformed_frame"


class BadMagic(ProtocolError):
    code = "bad_magic"


class UnsupportedVersion(ProtocolError):
    code = "unsupported_version"


class BadDtype(ProtocolError):
    code = "bad_dtype"


class BadTensor(ProtocolError):
    code = "bad_tensor"


class BadEncoding(BadTensor):
    """A hidden state's codec payload (protocol.codec) does not decode: tensors, scales or indices."""

    code = "bad_encoding"


class PositionOutOfRange(ProtocolError):
    code = "position_out_of_range"


class MessageTooLarge(ProtocolError):
    code = "message_too_large"


class UnexpectedMessage(ProtocolError):
    code = "unexpected_message"


class HandshakeMismatch(ProtocolError):
    code = "handshake_mismatch"


class TrunkMismatch(HandshakeMismatch):
    """The trunk the cloud serves (its content fingerprint) is not the one the edge expects."""

    code = "trunk_mismatch"


class AuthenticationFailed(ProtocolError):
    code = "authentication_failed"


class UnknownSession(ProtocolError):
    code = "unknown_session"


class TooManySessions(ProtocolError):
    code = "too_many_sessions"


class SessionQuotaExceeded(TooManySessions):
    code = "session_quota_exceeded"


class CapacityExceeded(ProtocolError):
    """The trunk's KV budget has no room for a step. ``retry_after_s``: when to try again (seconds),
    or None when the step can never fit (the session alone would exceed the whole budget)."""

    code = "capacity"

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ServerError(ProtocolError):
    code = "server_error"


_BY_CODE: dict[str, type[ProtocolError]] = {
    cls.code: cls
    for cls in (
        ProtocolError,
        MalformedFrame,
        BadMagic,
        UnsupportedVersion,
        BadDtype,
        BadTensor,
        BadEncoding,
        PositionOutOfRange,
        MessageTooLarge,
        UnexpectedMessage,
        HandshakeMismatch,
        TrunkMismatch,
        AuthenticationFailed,
        UnknownSession,
        TooManySessions,
        SessionQuotaExceeded,
        CapacityExceeded,
        ServerError,
    )
}


def error_from_code(code: str, message: str, retry_after_s: float | None = None) -> ProtocolError:
    """Rebuild the typed error a peer reported; unknown codes become a plain ProtocolError.

    ``retry_after_s`` (the Error's hint) is kept by the errors that carry one (:class:`CapacityExceeded`).
    """
    cls = _BY_CODE.get(code, ProtocolError)
    if cls is CapacityExceeded:
        return CapacityExceeded(message, retry_after_s)
    return cls(message)
