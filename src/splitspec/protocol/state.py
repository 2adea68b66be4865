"""Server-side connection state machine (sans-I/O), shared by every splitspec server.

:class:`HandshakeGate` decides, from a frame's header alone, whether the frame may be decoded at
all: before a successful hello (the trunk's :class:`Hello`, the worker's ``FedHello``) nothing but
a hello is read, and its shared secret is checked from its header before the frame is decoded, so
a client without the secret is refused before a single tensor byte is parsed; after it, a second
hello is refused. :class:`ServerConnection` is the trunk server's gate
with the identity its Hello must match, and the wire codec the Hello chose (one the trunk accepts;
with the raw codec, which carries the compute dtype as is, both sides must compute in one dtype).
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from splitspec.exceptions import (
    AuthenticationFailed,
    BadEncoding,
    HandshakeMismatch,
    UnexpectedMessage,
)
from splitspec.protocol.codec import WIRE_CODECS, check_codec
from splitspec.protocol.frames import peek_header
from splitspec.protocol.messages import AUTO_DTYPE, Hello


@dataclass(frozen=True)
class TrunkIdentity:
    """What a trunk server is: the edge's Hello must match every field."""

    fingerprint: str  # model fingerprint, see models.checkpoint.fingerprint
    layer_start: int  # first trunk layer (inclusive)
    layer_end: int  # last trunk layer (exclusive)
    dtype: str  # compute dtype name (the raw codec's wire dtype)
    hidden_size: int  # elements per hidden state
    wire_codecs: tuple[str, ...] = WIRE_CODECS  # the hidden-state codecs the trunk accepts (protocol.codec)


def check_secret(presented: object, expected: str | None) -> None:
    """Refuse a hello without the shared secret ``expected`` (constant-time compare); None: no secret set.

    ``presented`` is whatever the peer's header holds, of any type (a lone surrogate included).
    """
    if expected is not None and not (
        isinstance(presented, str)
        and hmac.compare_digest(presented.encode("utf-8", "surrogatepass"), expected.encode())
    ):
        raise AuthenticationFailed("missing or wrong shared secret")


class HandshakeGate:
    """One connection's handshake state: unauthenticated until a matching hello of ``hello_type``."""

    def __init__(self, hello_type: str, auth_token: str | None) -> None:
        self.hello_type = hello_type
        self._auth_token = auth_token
        self.ready = False

    def admit(self, data: bytes) -> None:
        """Refuse a frame before decoding it if the connection is not through its handshake yet.

        Once the handshake is done there is nothing to check here, so the hot path parses each
        header only once (in the decoder); a second Hello is refused by :meth:`accept_hello`.
        """
        if self.ready:
            return
        header = peek_header(data)
        kind = header.get("type")
        if kind != self.hello_type:
            if self._auth_token is not None:
                raise AuthenticationFailed(f"authenticate with a {self.hello_type} before anything else")
            raise UnexpectedMessage(f"expected a {self.hello_type} first, got {kind!r:.80}")
        check_secret(header.get("auth_token"), self._auth_token)  # from the header: nothing decoded yet
        if header.get("tensors"):
            raise UnexpectedMessage(f"a {self.hello_type} carries no tensors")

    def begin_hello(self, presented_token: str | None) -> None:
        """First checks of a decoded hello: not a second one, and the right shared secret."""
        if self.ready:
            raise UnexpectedMessage("this connection has already completed its handshake")
        check_secret(presented_token, self._auth_token)

    def open(self) -> None:
        """The hello passed every check: frames of every type are decoded from now on."""
        self.ready = True


class ServerConnection(HandshakeGate):
    """The trunk server's gate: the edge's Hello must also match the trunk's identity."""

    def __init__(self, identity: TrunkIdentity, auth_token: str | None) -> None:
        super().__init__(Hello.TYPE, auth_token)
        self.identity = identity
        self.wire_codec: str | None = None  # the accepted Hello's codec, which every step must use

    def accept_hello(self, hello: Hello) -> None:
        """Check auth and the pinned identity; raise a typed error on any mismatch.

        A Hello whose dtype is ``auto`` accepts the trunk's (the Welcome states it); any other must equal it
        when the wire codec is raw (bf16 and int8 carry their own dtype: the compute dtypes may differ).
        """
        self.begin_hello(hello.auth_token)
        ident = self.identity
        check_codec(hello.wire_codec, ident.wire_codecs)
        pinned = [
            ("fingerprint", hello.fingerprint, ident.fingerprint),
            ("layer_start", hello.layer_start, ident.layer_start),
            ("layer_end", hello.layer_end, ident.layer_end),
            ("hidden_size", hello.hidden_size, ident.hidden_size),
        ]
        if hello.wire_codec == "raw":  # another codec carries its own dtype: the compute dtypes may differ
            pinned.append(("dtype", ident.dtype if hello.dtype == AUTO_DTYPE else hello.dtype, ident.dtype))
        mismatches = [
            f"{name}: edge expects {theirs!r}, trunk is {ours!r}" for name, theirs, ours in pinned if theirs != ours
        ]
        if mismatches:
            raise HandshakeMismatch("; ".join(mismatches))
        self.wire_codec = hello.wire_codec
        self.open()

    def check_step_codec(self, codec: str) -> None:
        """A step must carry its hidden state in the codec its connection's Hello chose."""
        if codec != self.wire_codec:
            raise BadEncoding(f"step hidden state in the {codec!r} codec, this connection chose {self.wire_codec!r}")
