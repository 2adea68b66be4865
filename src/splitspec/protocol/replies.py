"""How a server answers a request it cannot serve (sans-I/O).

Every splitspec server (the trunk server, the SpecFed worker) follows one policy when a peer's
frame fails:

* a :class:`~splitspec.exceptions.ProtocolError` (the peer sent something we refuse) becomes an
  :class:`~splitspec.protocol.messages.Error` with the exception's wire code; it is *fatal* (the
  server closes the connection after sending it) when it is an authentication or handshake
  failure, or when the connection has not completed its handshake yet;
* any other exception is a bug of ours: it is reported as ``server_error`` and is never fatal,
  so one failed step does not cost the peer its session.

The reply echoes the request's ``seq`` and ``session_id`` when the request was decoded far
enough to have them. Logging and encoding stay with the caller (each server has its own message
family and log wording).
"""

from __future__ import annotations

from splitspec.exceptions import AuthenticationFailed, HandshakeMismatch, ProtocolError, ServerError
from splitspec.protocol.messages import Error

__all__ = ["internal_error", "is_fatal", "refusal"]


def is_fatal(exc: ProtocolError, *, ready: bool) -> bool:
    """Whether refusing ``exc`` must also close the connection (``ready``: handshake completed)."""
    return isinstance(exc, (AuthenticationFailed, HandshakeMismatch)) or not ready


def _echo(request: object | None) -> tuple[str | None, int | None]:
    """The request's ``session_id`` and ``seq``, when it has well-typed ones."""
    session_id = getattr(request, "session_id", None)
    seq = getattr(request, "seq", None)
    return (
        session_id if isinstance(session_id, str) else None,
        seq if isinstance(seq, int) and not isinstance(seq, bool) else None,
    )


def refusal(exc: ProtocolError, request: object | None, *, ready: bool) -> Error:
    """The Error reply refusing ``request`` (None when it could not be decoded) because of ``exc``."""
    session_id, seq = _echo(request)
    return Error(code=exc.code, message=str(exc), session_id=session_id, seq=seq, fatal=is_fatal(exc, ready=ready))


def internal_error(exc: BaseException, request: object | None) -> Error:
    """The non-fatal ``server_error`` reply for a failure of our own while serving ``request``."""
    session_id, seq = _echo(request)
    error = ServerError(f"{type(exc).__name__}: {exc}")
    return Error(code=error.code, message=str(error), session_id=session_id, seq=seq, fatal=False)
