"""How a server answers a request it cannot serve (sans-I/O).

Every splitspec server (the trunk server, the SpecFed worker) follows one policy when a peer's
frame fails:

* a :class:`~splitspec.exceptions.ProtocolError` (the peer sent something we refuse) becomes an
  :class:`~splitspec.protocol.messages.Error` with the exception's wire code; it is *fatal* (the
  server closes the connection after sending it) when it is an authentication or handshake
  failure, or when the connection has not completed its handshake yet;
* any other exception is a bug of ours: it is reported as ``server_error``; past the handshake
  it is never fatal, so one failed step does not cost the peer its session.

The reply echoes the request's ``seq`` and ``session_id`` when the request was decoded far
enough to have them, or, for a frame that could not be decoded (too large, a bad tensor), when its
header names them: a multiplexing peer matches the refusal to the step it refuses by those, and a
refusal naming nothing would reach some other request instead. Its message is cut to
:data:`MAX_ECHO_CHARS` characters: an error's text may quote what the peer sent, and a reply must
stay readable by a peer's decoder. Logging and encoding stay with the caller (each server has its
own message family and log wording).
"""

from __future__ import annotations

from splitspec.exceptions import AuthenticationFailed, CapacityExceeded, HandshakeMismatch, ProtocolError, ServerError
from splitspec.protocol.frames import peek_header
from splitspec.protocol.messages import MAX_ERROR_CHARS, Error

__all__ = ["MAX_ECHO_CHARS", "internal_error", "is_fatal", "refusal", "truncated"]

MAX_ECHO_CHARS = min(1024, MAX_ERROR_CHARS)  # longest error text a server sends or logs, characters


def truncated(text: str, limit: int = MAX_ECHO_CHARS) -> str:
    """``text`` cut to ``limit`` characters, saying how much was cut."""
    if len(text) <= limit:
        return text
    note = f"... ({len(text) - limit} more characters)"
    return text[: limit - len(note)] + note


def is_fatal(exc: ProtocolError, *, ready: bool) -> bool:
    """Whether refusing ``exc`` must also close the connection (``ready``: handshake completed)."""
    return isinstance(exc, (AuthenticationFailed, HandshakeMismatch)) or not ready


def _echo(request: object | None, frame: bytes | None) -> tuple[str | None, int | None]:
    """The request's ``session_id`` and ``seq``, when it has well-typed ones; a request that could not be
    decoded (None) has those its ``frame``'s header names, when the header itself can be read."""
    if request is None and frame is not None:
        try:
            header = peek_header(frame)  # the header alone: no payload byte is read
        except ProtocolError:
            header = {}
        session_id, seq = header.get("session_id"), header.get("seq")
    else:
        session_id, seq = getattr(request, "session_id", None), getattr(request, "seq", None)
    return (
        session_id if isinstance(session_id, str) else None,
        seq if isinstance(seq, int) and not isinstance(seq, bool) else None,
    )


def refusal(exc: ProtocolError, request: object | None, *, ready: bool, frame: bytes | None = None) -> Error:
    """The Error reply refusing ``request`` (None when it could not be decoded: then ``frame``, the bytes
    received, gives the ids to echo) because of ``exc``."""
    session_id, seq = _echo(request, frame)
    return Error(
        code=exc.code,
        message=truncated(str(exc)),
        session_id=session_id,
        seq=seq,
        fatal=is_fatal(exc, ready=ready),
        retry_after_s=exc.retry_after_s if isinstance(exc, CapacityExceeded) else None,
    )


def internal_error(exc: BaseException, request: object | None, *, ready: bool, frame: bytes | None = None) -> Error:
    """The ``server_error`` reply for a failure of our own while serving ``request`` (``frame`` as for
    :func:`refusal`): never fatal past the handshake (one failed step does not cost a session), always
    fatal before it."""
    session_id, seq = _echo(request, frame)
    error = ServerError(truncated(f"{type(exc).__name__}: {exc}"))
    return Error(code=error.code, message=str(error), session_id=session_id, seq=seq, fatal=not ready)
