"""Issue #12 items 3, 5 and 7: malformed input maps to the documented ProtocolError tree, auth is
checked from a Hello's header alone, and error replies stay readable by the peer's decoder."""

from __future__ import annotations

import struct

import pytest
import torch

from splitspec.exceptions import AuthenticationFailed, BadTensor, MalformedFrame, UnexpectedMessage
from splitspec.protocol.fed import FedHello, WorkerIdentity, check_fed_hello, decode_fed
from splitspec.protocol.frames import MAGIC, PROTOCOL_VERSION, encode_frame
from splitspec.protocol.messages import Error, Hello, decode_message, encode_message
from splitspec.protocol.replies import MAX_ECHO_CHARS, internal_error, refusal
from splitspec.protocol.state import ServerConnection, TrunkIdentity

IDENTITY = TrunkIdentity(fingerprint="abc", layer_start=2, layer_end=4, dtype="float32", hidden_size=8)
HELLO = Hello(fingerprint="abc", layer_start=2, layer_end=4, dtype="float32", hidden_size=8, auth_token="t")


def _raw_frame(header: bytes) -> bytes:
    return struct.pack(">4sHI", MAGIC, PROTOCOL_VERSION, len(header)) + header


@pytest.mark.parametrize(
    "header",
    [
        b"[" * 5000 + b"]" * 5000,  # RecursionError inside json
        b'{"type": "hello", "layer_start": ' + b"7" * 5000 + b"}",  # int of > 4,300 digits: ValueError
        b'{"type": "step_result", "cloud_ms": NaN}',
        b'{"type": "step_result", "cloud_ms": Infinity}',
    ],
)
def test_malformed_headers_are_protocol_errors(header: bytes) -> None:
    for decode in (decode_message, decode_fed):
        with pytest.raises(MalformedFrame):
            decode(_raw_frame(header))


@pytest.mark.parametrize(
    "fields",
    [
        {"client": "\ud800"},  # a lone surrogate, legal in JSON, not encodable in UTF-8
        {"layer_start": 2**64},
    ],
)
def test_out_of_range_fields_are_malformed(fields: dict[str, object]) -> None:
    header, _ = HELLO.to_wire()
    with pytest.raises(MalformedFrame):
        decode_message(encode_frame({"type": "hello", **header, **fields}))


def test_a_lone_surrogate_token_is_an_authentication_failure() -> None:
    header, _ = HELLO.to_wire()
    conn = ServerConnection(IDENTITY, auth_token="t")
    with pytest.raises(AuthenticationFailed):
        conn.admit(encode_frame({"type": "hello", **header, "auth_token": "\ud800"}))
    with pytest.raises(AuthenticationFailed):
        check_fed_hello(
            FedHello(vocab_size=4, tokenizer_fingerprint="x", auth_token="\udfff"), WorkerIdentity(4, "x"), "t"
        )


def test_nan_cloud_ms_is_refused_by_the_client_decoder() -> None:
    frame = encode_frame({"type": "step_result", "session_id": "s", "seq": 1, "cloud_ms": float("nan")})
    with pytest.raises(MalformedFrame):
        decode_message(frame)


def test_auth_is_checked_from_the_header_before_any_tensor_is_decoded() -> None:
    """A Hello with a wrong secret is refused by the gate, from its header (item 3)."""
    header, _ = HELLO.to_wire()
    big = {"junk": torch.zeros(1 << 16)}
    conn = ServerConnection(IDENTITY, auth_token="t")
    with pytest.raises(AuthenticationFailed):
        conn.admit(encode_frame({"type": "hello", **header, "auth_token": "wrong"}, big))
    with pytest.raises(AuthenticationFailed):
        conn.admit(encode_frame({"type": "hello", **header, "auth_token": None}))
    with pytest.raises(UnexpectedMessage, match="carries no tensors"):
        conn.admit(encode_frame({"type": "hello", **header}, big))
    conn.admit(encode_message(HELLO))  # the right secret, no tensors: admitted


@pytest.mark.parametrize("make", [refusal, internal_error])
def test_error_replies_echoing_long_input_stay_readable(make: object) -> None:
    """A refusal quoting 100,000 characters of attacker input is cut so the client decodes it (item 7)."""
    exc = BadTensor("x" * 100_000)
    error = make(exc, None, ready=True)  # type: ignore[operator]
    assert len(error.message) <= MAX_ECHO_CHARS
    assert "more characters" in error.message
    back = decode_message(encode_message(error))
    assert isinstance(back, Error)
    assert back.message == error.message
