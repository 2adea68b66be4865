"""Server-side connection state machine (sans-I/O).

Decides, from a frame's header alone, whether the frame may be decoded at all: before a
successful :class:`Hello`, nothing but a Hello is read, so a client without the shared secret is
refused before a single tensor byte is parsed.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from splitspec.exceptions import (
    AuthenticationFailed,
    HandshakeMismatch,
    UnexpectedMessage,
)
from splitspec.protocol.frames import peek_type
from splitspec.protocol.messages import Hello


@dataclass(frozen=True)
class TrunkIdentity:
    """What a trunk server is: the edge's Hello must match every field."""

    fingerprint: str  # model fingerprint, see models.checkpoint.fingerprint
    layer_start: int  # first trunk layer (inclusive)
    layer_end: int  # last trunk layer (exclusive)
    dtype: str  # compute and wire dtype name
    hidden_size: int  # elements per hidden state


class ServerConnection:
    """Tracks one connection: unauthenticated until a matching Hello arrives."""

    def __init__(self, identity: TrunkIdentity, auth_token: str | None) -> None:
        self.identity = identity
        self._auth_token = auth_token
        self.ready = False

    def admit(self, data: bytes) -> None:
        """Refuse a frame before decoding it if the connection is not through its handshake yet.

        Once the handshake is done there is nothing to check here, so the hot path parses each
        header only once (in the decoder); a second Hello is refused by :meth:`accept_hello`.
        """
        if self.ready:
            return
        kind = peek_type(data)
        if kind != Hello.TYPE:
            if self._auth_token is not None:
                raise AuthenticationFailed("authenticate with a Hello before anything else")
            raise UnexpectedMessage(f"expected a Hello first, got {kind!r}")

    def accept_hello(self, hello: Hello) -> None:
        """Check auth and the pinned identity; raise a typed error on any mismatch."""
        if self.ready:
            raise UnexpectedMessage("this connection has already completed its handshake")
        if self._auth_token is not None and not (
            hello.auth_token is not None and hmac.compare_digest(hello.auth_token.encode(), self._auth_token.encode())
        ):
            raise AuthenticationFailed("missing or wrong shared secret")
        ident = self.identity
        mismatches = [
            f"{name}: edge expects {theirs!r}, trunk is {ours!r}"
            for name, theirs, ours in (
                ("fingerprint", hello.fingerprint, ident.fingerprint),
                ("layer_start", hello.layer_start, ident.layer_start),
                ("layer_end", hello.layer_end, ident.layer_end),
                ("dtype", hello.dtype, ident.dtype),
                ("hidden_size", hello.hidden_size, ident.hidden_size),
            )
            if theirs != ours
        ]
        if mismatches:
            raise HandshakeMismatch("; ".join(mismatches))
        self.ready = True
