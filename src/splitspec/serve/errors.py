"""Errors as OpenAI returns them: ``{"error": {"message", "type", "param", "code"}}`` with a status.

:class:`ApiError` is raised anywhere in a request; :func:`api_error_for` maps splitspec's own
exceptions (a trunk that cannot be reached, a trunk that refuses) onto HTTP statuses.
"""

from __future__ import annotations

from typing import Any

from splitspec.exceptions import (
    AuthenticationFailed,
    CapacityExceeded,
    ConfigError,
    HandshakeMismatch,
    ProtocolError,
    SplitspecError,
    TooManySessions,
    TransportError,
    UnknownSession,
)

CONTEXT_EXCEEDED = "context_length_exceeded"  # the code of the 400 for a prompt and completion that do not fit


class ApiError(Exception):
    """A request failed; ``status`` is the HTTP status, the rest is OpenAI's error object."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.headers = headers or {}
        self.counted = False  # already in the errors metric (a failure inside a generation)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    """400: the request itself is wrong."""
    return ApiError(400, message, param=param, code=code)


def unsupported(param: str, detail: str = "") -> ApiError:
    """400 naming a parameter this server does not implement (never silently ignored)."""
    text = f"Unsupported parameter: '{param}' is not supported by splitspec serve{f' ({detail})' if detail else ''}."
    return ApiError(400, text, param=param, code="unsupported_parameter")


def server_busy(retry_after_s: int) -> ApiError:
    """429 with Retry-After: every session is generating and the queue wait ran out."""
    return ApiError(
        429,
        f"all sessions are busy; retry in {retry_after_s} s",
        type_="rate_limit_error",
        code="server_busy",
        headers={"Retry-After": str(retry_after_s)},
    )


def api_error_for(exc: SplitspecError) -> ApiError:
    """The HTTP error a splitspec exception stands for."""
    if isinstance(exc, TransportError | UnknownSession):
        return ApiError(503, f"the trunk server is unreachable: {exc}", "service_unavailable", code="trunk_unreachable")
    if isinstance(exc, TooManySessions | CapacityExceeded):
        return ApiError(503, f"the trunk server is full: {exc}", "service_unavailable", code="trunk_full")
    if isinstance(exc, AuthenticationFailed | HandshakeMismatch):
        return ApiError(502, f"the trunk server refused this edge: {exc}", "server_error", code="trunk_refused")
    if isinstance(exc, ProtocolError):
        return ApiError(502, f"the trunk server failed: {exc}", "server_error", code=exc.code)
    if isinstance(exc, ConfigError):
        return invalid(str(exc))
    return internal_error(exc)


def internal_error(exc: BaseException) -> ApiError:
    """500: a failure of this server's own (a bug, or an exception from torch), as OpenAI's error JSON."""
    return ApiError(500, f"{type(exc).__name__}: {exc}", "server_error", code="internal_error")
