"""Typed messages: round trips, field validation, and the sans-I/O import rule."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from typing import Any

import pytest
import torch

from splitspec.exceptions import (
    AuthenticationFailed,
    BadTensor,
    HandshakeMismatch,
    MalformedFrame,
    PositionOutOfRange,
    UnexpectedMessage,
)
from splitspec.protocol.frames import encode_frame
from splitspec.protocol.messages import (
    CacheCommand,
    CloseSession,
    Error,
    Hello,
    OpenSession,
    SessionClosed,
    SessionOpened,
    Step,
    StepResult,
    Welcome,
    decode_message,
    encode_message,
)
from splitspec.protocol.state import ServerConnection, TrunkIdentity
from splitspec.protocol.trunk_fingerprint import TrunkFingerprint

HELLO = Hello(fingerprint="abc", layer_start=2, layer_end=4, dtype="float32", hidden_size=8, auth_token="t")


def step(q: int = 3, **kw: object) -> Step:
    args: dict[str, object] = {
        "session_id": "s1",
        "seq": 4,
        "hidden": torch.randn(1, q, 8),
        "positions": torch.arange(10, 10 + q, dtype=torch.int32),
        "parents": torch.arange(-1, q - 1, dtype=torch.int32),
    }
    args.update(kw)
    return Step(**args)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "message",
    [
        HELLO,
        Welcome(
            server="x",
            max_message_bytes=10,
            max_query_tokens=4,
            session_ttl_s=1.5,
            trunk=TrunkFingerprint(2, 6, "bfloat16", "0123456789abcdef" * 2),
            dtype="bfloat16",
        ),
        OpenSession(request_id=3),
        SessionOpened(request_id=3, session_id="abc"),
        CloseSession(session_id="abc"),
        SessionClosed(session_id="abc"),
        Error(code="bad_tensor", message="m", session_id="s", seq=2, fatal=True),
        Error(code="capacity", message="m", retry_after_s=1.5),
    ],
)
def test_round_trip_plain_messages(message: object) -> None:
    assert decode_message(encode_message(message)) == message  # type: ignore[arg-type]


def test_round_trip_step_with_cache_command() -> None:
    truncate_only = decode_message(encode_message(step(cache=CacheCommand(truncate_to=12))))
    assert isinstance(truncate_only, Step)
    assert truncate_only.cache == CacheCommand(truncate_to=12)
    original = step(cache=CacheCommand(truncate_to=12, keep_last=(0, 2)))
    out = decode_message(encode_message(original))
    assert isinstance(out, Step)
    assert out.cache == original.cache
    assert torch.equal(out.hidden, original.hidden)
    assert torch.equal(out.parents, original.parents)
    result = StepResult(session_id="s1", seq=4, hidden=original.hidden, cloud_ms=1.25)
    back = decode_message(encode_message(result))
    assert isinstance(back, StepResult)
    assert back.cloud_ms == 1.25
    assert back.queue_ms == 0.0  # none reported: absent on the wire, as from a trunk that predates the field
    queued = decode_message(encode_message(dataclasses.replace(result, queue_ms=3.5)))
    assert isinstance(queued, StepResult)
    assert queued.queue_ms == 3.5


@pytest.mark.parametrize("codec", ["raw", "bf16", "int8"])
def test_round_trip_a_step_asking_for_a_trunk_state_and_its_reply(codec: str) -> None:
    asking = decode_message(encode_message(step(codec=codec, return_layer=3)))
    assert isinstance(asking, Step)
    assert asking.return_layer == 3
    assert decode_message(encode_message(step())).return_layer is None  # type: ignore[union-attr]
    hidden, feature = torch.randn(1, 3, 8), torch.randn(1, 3, 8)
    reply = decode_message(encode_message(StepResult("s1", 4, hidden, 1.0, codec, feature)))
    assert isinstance(reply, StepResult)
    assert reply.feature is not None
    exact = codec == "raw"  # the others are lossy, within their codec's error
    torch.testing.assert_close(reply.feature.float(), feature, rtol=0 if exact else 0.05, atol=0 if exact else 0.05)
    torch.testing.assert_close(reply.hidden.float(), hidden, rtol=0 if exact else 0.05, atol=0 if exact else 0.05)
    assert not torch.equal(reply.hidden, reply.feature)  # not the same tensors twice
    plain = decode_message(encode_message(StepResult("s1", 4, hidden, 1.0, codec)))
    assert isinstance(plain, StepResult)
    assert plain.feature is None


def test_step_size_does_not_grow_with_context() -> None:
    near = encode_message(step(4, positions=torch.arange(100, 104, dtype=torch.int32)))
    far = encode_message(step(4, positions=torch.arange(10_000, 10_004, dtype=torch.int32)))
    assert len(near) == len(far)


def raw(header: dict[str, object], tensors: dict[str, torch.Tensor] | None = None) -> bytes:
    return encode_frame(header, tensors or {})


@pytest.mark.parametrize(
    ("data", "error"),
    [
        (raw({"type": "nope"}), MalformedFrame),
        (raw({"type": 3}), MalformedFrame),
        (raw({"type": "open_session", "request_id": -1}), MalformedFrame),
        (raw({"type": "open_session", "request_id": True}), MalformedFrame),
        (raw({"type": "session_opened", "request_id": 1, "session_id": "x" * 500}), MalformedFrame),
        (
            raw(
                {
                    "type": "welcome",
                    "server": "s",
                    "max_message_bytes": 1,
                    "max_query_tokens": 1,
                    "session_ttl_s": "soon",
                }
            ),
            MalformedFrame,
        ),
        (raw({"type": "step", "session_id": "s", "seq": 1}), BadTensor),
        (encode_message(step(parents=torch.tensor([-1, 1, 0], dtype=torch.int32))), PositionOutOfRange),
        (encode_message(step(parents=torch.tensor([-2, 0, 1], dtype=torch.int32))), PositionOutOfRange),
        (encode_message(step(1, parents=torch.tensor([0], dtype=torch.int32))), PositionOutOfRange),  # decode
        (encode_message(step(1, parents=torch.tensor([-2], dtype=torch.int32))), PositionOutOfRange),
        (encode_message(step(positions=torch.arange(3))), BadTensor),  # int64 positions
        (encode_message(step(positions=torch.arange(2, dtype=torch.int32))), BadTensor),
        (encode_message(step(hidden=torch.randn(2, 3, 8))), BadTensor),
        (encode_message(step(cache=CacheCommand(keep_last=(2, 1)))), MalformedFrame),
        (encode_message(step(cache=CacheCommand(keep_last=(-1, 2)))), MalformedFrame),
        (
            raw(
                {"type": "step", "session_id": "s", "seq": 1, "cache": [1]},
                {
                    "hidden": torch.zeros(1, 1, 8),
                    "positions": torch.zeros(1, dtype=torch.int32),
                    "parents": torch.tensor([-1], dtype=torch.int32),
                },
            ),
            MalformedFrame,
        ),
        (
            raw({"type": "step_result", "session_id": "s", "seq": 1, "cloud_ms": 1.0}, {"hidden": torch.zeros(1, 8)}),
            BadTensor,
        ),
        (encode_message(step(return_layer=0)), MalformedFrame),  # the state after no layer is the edge's input
        (
            raw(
                {"type": "step", "session_id": "s", "seq": 1, "return_layer": True},
                {
                    "hidden": torch.zeros(1, 1, 8),
                    "positions": torch.zeros(1, dtype=torch.int32),
                    "parents": torch.tensor([-1], dtype=torch.int32),
                },
            ),
            MalformedFrame,
        ),
        (  # a feature shaped unlike the hidden state
            raw(
                {"type": "step_result", "session_id": "s", "seq": 1, "cloud_ms": 1.0},
                {"hidden": torch.zeros(1, 2, 8), "feature.hidden": torch.zeros(1, 3, 8)},
            ),
            BadTensor,
        ),
        (  # a feature's tensors without its hidden state
            raw(
                {"type": "step_result", "session_id": "s", "seq": 1, "cloud_ms": 1.0},
                {"hidden": torch.zeros(1, 2, 8), "feature.scale": torch.zeros(1, 2, 1)},
            ),
            BadTensor,
        ),
    ],
)
def test_invalid_messages_are_refused(data: bytes, error: type[Exception]) -> None:
    with pytest.raises(error):
        decode_message(data)


IDENTITY = TrunkIdentity(fingerprint="abc", layer_start=2, layer_end=4, dtype="float32", hidden_size=8)


def test_server_state_refuses_everything_before_hello() -> None:
    conn = ServerConnection(IDENTITY, auth_token="t")
    with pytest.raises(AuthenticationFailed):
        conn.admit(encode_message(OpenSession(request_id=1)))
    anonymous = ServerConnection(IDENTITY, auth_token=None)
    with pytest.raises(UnexpectedMessage):
        anonymous.admit(encode_message(OpenSession(request_id=1)))
    conn.admit(encode_message(HELLO))
    conn.accept_hello(HELLO)
    conn.admit(encode_message(OpenSession(request_id=1)))
    with pytest.raises(UnexpectedMessage):  # a second handshake on the same connection
        conn.accept_hello(HELLO)


@pytest.mark.parametrize(
    ("field", "value", "error"),
    [
        ("auth_token", None, AuthenticationFailed),
        ("auth_token", "T", AuthenticationFailed),
        ("fingerprint", "abd", HandshakeMismatch),
        ("layer_start", 1, HandshakeMismatch),
        ("layer_end", 5, HandshakeMismatch),
        ("dtype", "float16", HandshakeMismatch),
        ("hidden_size", 16, HandshakeMismatch),
    ],
)
def test_hello_pins_identity_and_auth(field: str, value: Any, error: type[Exception]) -> None:
    import dataclasses

    conn = ServerConnection(IDENTITY, auth_token="t")
    with pytest.raises(error):
        conn.accept_hello(dataclasses.replace(HELLO, **{field: value}))
    assert not conn.ready


def test_an_auto_hello_takes_the_trunks_dtype_and_a_pinned_one_must_equal_it() -> None:
    import dataclasses

    for dtype in ("auto", "float32"):
        conn = ServerConnection(IDENTITY, auth_token="t")
        conn.accept_hello(dataclasses.replace(HELLO, dtype=dtype))
        assert conn.ready
    conn = ServerConnection(IDENTITY, auth_token="t")
    with pytest.raises(HandshakeMismatch, match="dtype: edge expects 'bfloat16', trunk is 'float32'"):
        conn.accept_hello(dataclasses.replace(HELLO, dtype="bfloat16"))


@pytest.mark.parametrize("dtype", ["auto", "float64", "int8", 16, None])
def test_a_welcome_states_one_of_the_wire_dtypes(dtype: object) -> None:
    """The trunk's dtype is what an auto edge computes in: only a wire dtype is taken."""
    welcome = Welcome("x", 10, 4, 1.5, TrunkFingerprint(2, 6, "bfloat16", "ab" * 16), "float16")
    header, _ = welcome.to_wire()
    assert decode_message(encode_message(welcome)) == welcome
    with pytest.raises(MalformedFrame):
        decode_message(encode_frame({"type": Welcome.TYPE, **header, "dtype": dtype}))


def test_protocol_package_is_sans_io() -> None:
    """No module of splitspec.protocol imports asyncio, websockets or transformers (torch itself
    pulls in asyncio, so the source is checked statically, and loading is checked at run time)."""
    import ast
    from pathlib import Path

    import splitspec.protocol

    forbidden = {"asyncio", "websockets", "transformers"}
    for path in Path(splitspec.protocol.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            assert not {n.split(".")[0] for n in names} & forbidden, f"{path.name} imports {names}"
    code = (
        "import sys, splitspec.protocol, splitspec.protocol.state\n"
        "print(','.join(m for m in ('websockets', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


@pytest.mark.parametrize(
    ("command", "length", "last_step", "expected"),
    [
        (CacheCommand(), 10, 4, 10),
        (CacheCommand(truncate_to=7), 10, 4, 7),
        (CacheCommand(keep_last=(0, 2)), 10, 4, 8),  # 6 committed before the step, 2 of its 4 kept
        (CacheCommand(truncate_to=7, keep_last=()), 10, 4, 7),  # after a truncate there is no last step
    ],
)
def test_cache_command_length_after(command: CacheCommand, length: int, last_step: int, expected: int) -> None:
    assert command.length_after(length, last_step) == expected


@pytest.mark.parametrize(
    ("command", "message"),
    [
        (CacheCommand(truncate_to=11), "cannot truncate a cache of 10 entries to 11"),
        (CacheCommand(keep_last=(4,)), "outside the last step of 4 tokens"),
        (CacheCommand(truncate_to=7, keep_last=(0,)), "outside the last step of 0 tokens"),
    ],
)
def test_impossible_cache_commands_are_refused(command: CacheCommand, message: str) -> None:
    with pytest.raises(PositionOutOfRange, match=message):
        command.length_after(10, 4)
