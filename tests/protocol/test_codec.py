"""Hidden-state wire codecs: literal frames, error bounds, sizes, and every refusal of a bad payload."""

from __future__ import annotations

import dataclasses
import struct
from typing import Any

import pytest
import torch

from splitspec.exceptions import BadEncoding, BadTensor, HandshakeMismatch, MalformedFrame
from splitspec.protocol.codec import (
    INT8_BLOCK,
    WIRE_CODECS,
    check_codec,
    decode_hidden,
    encode_hidden,
    wire_bytes_per_token,
)
from splitspec.protocol.frames import MAGIC, PROTOCOL_VERSION, encode_frame, peek_header
from splitspec.protocol.messages import Hello, Step, StepResult, Welcome, decode_message, encode_message
from splitspec.protocol.state import ServerConnection, TrunkIdentity
from splitspec.protocol.trunk_fingerprint import TrunkFingerprint

# one token, H = 10: the 8 largest magnitudes travel as bfloat16, the last two channels in one block
# whose max |x| is 127 * 2^-8, so the scale is exactly 2^-8 (bfloat16 0x3B80) and both decode exactly
HIDDEN = [100.0, -200.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 127 / 256, -0.25]
INT8_STEP_HEADER = (
    b'{"type":"step","session_id":"s","seq":7,"codec":"int8","tensors":['
    b'{"name":"hidden","dtype":"int8","shape":[1,1,10],"nbytes":10},'
    b'{"name":"hidden_scale","dtype":"bfloat16","shape":[1,1,1],"nbytes":2},'
    b'{"name":"hidden_outlier_index","dtype":"int16","shape":[1,1,8],"nbytes":16},'
    b'{"name":"hidden_outlier_value","dtype":"bfloat16","shape":[1,1,8],"nbytes":16},'
    b'{"name":"positions","dtype":"int32","shape":[1],"nbytes":4},'
    b'{"name":"parents","dtype":"int32","shape":[1],"nbytes":4}]}'
)
INT8_STEP_PAYLOAD = (
    b"\x00" * 8 + b"\x7f\xc0"  # int8: the outliers' slots are 0; 127 and -64 (times 2^-8)
    b"\x80\x3b"  # the block's scale, 2^-8 in bfloat16
    b"\x01\x00\x00\x00\x07\x00\x06\x00\x05\x00\x04\x00\x03\x00\x02\x00"  # outlier channels, largest first
    b"\x48\xc3\xc8\x42\x00\x41\xe0\x40\xc0\x40\xa0\x40\x80\x40\x40\x40"  # -200, 100, 8, 7, 6, 5, 4, 3
    b"\x05\x00\x00\x00"  # position 5
    b"\xff\xff\xff\xff"  # parent -1
)


def literal(header: bytes, payload: bytes = b"") -> bytes:
    return MAGIC + struct.pack(">HI", PROTOCOL_VERSION, len(header)) + header + payload


def int8_step() -> Step:
    hidden = torch.tensor([[HIDDEN]])  # (1, 1, 10)
    return Step(
        "s", 7, hidden, torch.tensor([5], dtype=torch.int32), torch.tensor([-1], dtype=torch.int32), None, "int8"
    )


def test_int8_step_is_exactly_the_documented_layout() -> None:
    assert PROTOCOL_VERSION == 2
    assert encode_message(int8_step()) == literal(INT8_STEP_HEADER, INT8_STEP_PAYLOAD)


def test_literal_int8_step_decodes_exactly() -> None:
    step = decode_message(literal(INT8_STEP_HEADER, INT8_STEP_PAYLOAD))
    assert isinstance(step, Step)
    assert step.codec == "int8"
    assert step.hidden.dtype == torch.float32
    assert step.hidden.tolist() == [[HIDDEN]]
    assert step.positions.tolist() == [5]


def test_literal_bf16_reply_and_codec_less_raw_step() -> None:
    header = (
        b'{"type":"step_result","session_id":"s","seq":2,"cloud_ms":1.5,"codec":"bf16","tensors":['
        b'{"name":"hidden","dtype":"bfloat16","shape":[1,1,2],"nbytes":4}]}'
    )
    reply = decode_message(literal(header, b"\x80\x3f\x00\xc0"))  # 1.0, -2.0
    assert isinstance(reply, StepResult)
    assert (reply.codec, reply.hidden.dtype, reply.hidden.tolist()) == ("bf16", torch.bfloat16, [[[1.0, -2.0]]])
    assert encode_message(StepResult("s", 2, torch.tensor([[[1.0, -2.0]]]), 1.5, "bf16")) == literal(
        header, b"\x80\x3f\x00\xc0"
    )
    raw = (  # a step that names no codec is raw
        b'{"type":"step","session_id":"s","seq":1,"tensors":['
        b'{"name":"hidden","dtype":"float32","shape":[1,1,1],"nbytes":4},'
        b'{"name":"positions","dtype":"int32","shape":[1],"nbytes":4},'
        b'{"name":"parents","dtype":"int32","shape":[1],"nbytes":4}]}'
    )
    step = decode_message(literal(raw, b"\x00\x00\x80\x3f" + b"\x00" * 4 + b"\xff" * 4))
    assert isinstance(step, Step)
    assert (step.codec, step.hidden.tolist()) == ("raw", [[[1.0]]])


def massive(q: int, h: int, seed: int = 0) -> torch.Tensor:
    """(1, q, h) normal values with two channels 300x larger in every token, like an LLM's residual stream."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, q, h, generator=gen)
    x[..., 1] *= 300.0
    x[..., h // 2] *= -300.0
    return x


@pytest.mark.parametrize("h", [256, 40, 17, 8, 3])  # whole blocks, a padded last block, H <= the outliers
def test_int8_error_is_bounded_per_block_and_outliers_keep_bfloat16_precision(h: int) -> None:
    x = massive(5, h)
    wire = encode_hidden("int8", x)
    out = decode_hidden("int8", wire)
    assert out.shape == x.shape
    assert out.dtype == torch.float32
    index = wire["hidden_outlier_index"].long()
    is_outlier = torch.zeros_like(x, dtype=torch.bool).scatter_(-1, index, True)
    assert torch.equal(out[is_outlier], x[is_outlier].to(torch.bfloat16).float())  # as bfloat16, not quantized
    assert bool((x.abs()[is_outlier].view(1, 5, -1).amin(-1) >= x.abs().masked_fill(is_outlier, 0).amax(-1)).all())
    scale = wire["hidden_scale"].float().repeat_interleave(INT8_BLOCK, dim=-1)[..., :h]  # (1, q, H)
    err = (out - x).abs()[~is_outlier]
    assert bool((err <= scale[~is_outlier] * 0.5 + 1e-6).all())  # rounding to the nearest step
    if h >= 2 * INT8_BLOCK:  # the massive channels cost their blocks nothing: the steps stay small
        assert float(scale.max()) < 0.05


def test_int8_of_zeros_and_of_no_tokens() -> None:
    assert torch.equal(decode_hidden("int8", encode_hidden("int8", torch.zeros(1, 2, 64))), torch.zeros(1, 2, 64))
    empty = decode_hidden("int8", encode_hidden("int8", torch.zeros(1, 0, 64)))
    assert empty.shape == (1, 0, 64)


@pytest.mark.parametrize("codec", WIRE_CODECS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bytes_per_token_is_what_a_step_carries(codec: str, dtype: torch.dtype) -> None:
    q = 9
    hidden = torch.randn(1, q, 96, dtype=dtype)
    positions, parents = torch.arange(q, dtype=torch.int32), torch.arange(-1, q - 1, dtype=torch.int32)
    data = encode_message(Step("s", 1, hidden, positions, parents, None, codec))
    (header_len,) = struct.unpack_from(">I", data, 6)
    payload = len(data) - 10 - header_len
    assert payload == q * (wire_bytes_per_token(codec, 96, dtype) + 8)  # + the int32 position and parent
    assert wire_bytes_per_token("int8", 4096, dtype) == 4096 + 512 + 32  # 1.125 H + 32


def int8_tensors(**changes: Any) -> dict[str, torch.Tensor]:
    tensors = encode_hidden("int8", massive(2, 64))
    tensors.update(changes)
    return tensors


def with_index(row: list[int]) -> dict[str, torch.Tensor]:
    index = encode_hidden("int8", massive(2, 64))["hidden_outlier_index"].clone()
    index[0, 1] = torch.tensor(row, dtype=torch.int16)
    return int8_tensors(hidden_outlier_index=index)


def with_scale(value: float) -> dict[str, torch.Tensor]:
    scale = encode_hidden("int8", massive(2, 64))["hidden_scale"].clone()
    scale[0, 1, 1] = value
    return int8_tensors(hidden_scale=scale)


@pytest.mark.parametrize(
    ("codec", "tensors", "match"),
    [
        ("int8", with_index([64, 1, 2, 3, 4, 5, 6, 7]), r"indices must lie in \[0, 64\)"),  # index out of range
        ("int8", with_index([-1, 1, 2, 3, 4, 5, 6, 7]), r"indices must lie in \[0, 64\)"),
        ("int8", with_index([9, 1, 2, 3, 4, 5, 6, 9]), "repeat within a token"),
        ("int8", with_scale(float("nan")), "scales must be finite"),  # a NaN scale
        ("int8", with_scale(float("inf")), "scales must be finite"),
        ("int8", with_scale(-1.0), "non-negative"),
        (
            "int8",
            int8_tensors(hidden_outlier_value=torch.full((1, 2, 8), float("nan"), dtype=torch.bfloat16)),
            "finite",
        ),
        ("int8", int8_tensors(hidden_scale=torch.ones(1, 2, 1, dtype=torch.bfloat16)), r"shape \(1, 2, 4\)"),  # short
        ("int8", int8_tensors(hidden_scale=torch.ones(1, 2, 4)), "must be torch.bfloat16"),
        ("int8", int8_tensors(hidden=torch.zeros(1, 2, 64)), "must be torch.int8"),
        ("int8", int8_tensors(hidden_outlier_index=torch.zeros(1, 2, 7, dtype=torch.int16)), r"shape \(1, 2, 8\)"),
        ("int8", {"hidden": torch.zeros(1, 2, 64, dtype=torch.int8)}, "needs tensor 'hidden_scale'"),
        ("bf16", {"hidden": torch.zeros(1, 2, 64)}, "carries bfloat16"),
    ],
)
def test_malformed_payloads_are_refused(codec: str, tensors: dict[str, torch.Tensor], match: str) -> None:
    with pytest.raises(BadEncoding, match=match):
        decode_hidden(codec, tensors)


def test_raw_hidden_must_be_a_float_tensor() -> None:
    with pytest.raises(BadTensor, match="float tensor"):
        decode_hidden("raw", {"hidden": torch.zeros(1, 2, 4, dtype=torch.int32)})


def step_frame(header: dict[str, object], tensors: dict[str, torch.Tensor]) -> bytes:
    positions = {"positions": torch.zeros(2, dtype=torch.int32), "parents": torch.tensor([-1, 0], dtype=torch.int32)}
    return encode_frame({"type": "step", "session_id": "s", "seq": 1, **header}, {**tensors, **positions})


@pytest.mark.parametrize(
    ("data", "error"),
    [
        (step_frame({"codec": "int4"}, {"hidden": torch.zeros(1, 2, 8)}), MalformedFrame),  # an unknown codec
        (step_frame({"codec": 8}, {"hidden": torch.zeros(1, 2, 8)}), MalformedFrame),
        (step_frame({"codec": "int8"}, with_index([64, 1, 2, 3, 4, 5, 6, 7])), BadEncoding),
        (step_frame({"codec": "int8"}, with_scale(float("nan"))), BadEncoding),
        (encode_message(int8_step())[:-9], MalformedFrame),  # a short buffer: bytes missing
    ],
)
def test_bad_codec_frames_are_refused_by_the_decoder(data: bytes, error: type[Exception]) -> None:
    with pytest.raises(error):
        decode_message(data)


HELLO = Hello(fingerprint="abc", layer_start=2, layer_end=4, dtype="float32", hidden_size=8, wire_codec="int8")
TRUNK = TrunkFingerprint(2, 4, "bfloat16", "0123456789abcdef" * 2)


def test_hello_and_welcome_carry_the_codecs() -> None:
    assert decode_message(encode_message(HELLO)) == HELLO
    welcome = Welcome("x", 10, 4, 1.0, TRUNK, "float32", wire_codec="bf16", wire_codecs=("raw", "bf16"))
    assert decode_message(encode_message(welcome)) == welcome
    header, _ = HELLO.to_wire()
    del header["wire_codec"]
    with pytest.raises(MalformedFrame, match="wire_codec"):
        decode_message(encode_frame({"type": "hello", **header}))
    header, _ = welcome.to_wire()
    for bad in ([], ["raw", "zip"], "raw", None):
        with pytest.raises(MalformedFrame, match="wire_codecs"):
            decode_message(encode_frame({"type": "welcome", **header, "wire_codecs": bad}))


def identity(codecs: tuple[str, ...] = WIRE_CODECS, dtype: str = "bfloat16") -> TrunkIdentity:
    return TrunkIdentity(fingerprint="abc", layer_start=2, layer_end=4, dtype=dtype, hidden_size=8, wire_codecs=codecs)


def test_the_trunk_refuses_a_codec_it_does_not_accept_naming_both() -> None:
    conn = ServerConnection(identity(("raw", "bf16")), None)
    with pytest.raises(HandshakeMismatch, match="wire codec: edge sends 'int8', trunk accepts raw, bf16"):
        conn.accept_hello(HELLO)
    assert not conn.ready
    with pytest.raises(HandshakeMismatch, match="edge sends 'bf16', trunk accepts int8"):
        check_codec("bf16", ("int8",))


def test_compute_dtypes_may_differ_except_on_the_raw_wire() -> None:
    conn = ServerConnection(identity(), None)
    conn.accept_hello(HELLO)  # a float32 edge, a bfloat16 trunk: the int8 wire carries its own types
    assert conn.ready
    assert conn.wire_codec == "int8"
    conn.check_step_codec("int8")
    with pytest.raises(BadEncoding, match="step hidden state in the 'raw' codec, this connection chose 'int8'"):
        conn.check_step_codec("raw")
    raw = ServerConnection(identity(), None)
    with pytest.raises(HandshakeMismatch, match="dtype: edge expects 'float32', trunk is 'bfloat16'"):
        raw.accept_hello(dataclasses.replace(HELLO, wire_codec="raw"))
    ServerConnection(identity(dtype="float32"), None).accept_hello(dataclasses.replace(HELLO, wire_codec="raw"))
    ServerConnection(identity(), None).accept_hello(dataclasses.replace(HELLO, wire_codec="raw", dtype="auto"))


def test_every_codec_round_trips_a_step_and_its_reply() -> None:
    hidden = massive(3, 64)
    for codec in WIRE_CODECS:
        step = Step(
            "s", 1, hidden, torch.arange(3, dtype=torch.int32), torch.arange(-1, 2, dtype=torch.int32), None, codec
        )
        back = decode_message(encode_message(step))
        assert isinstance(back, Step)
        assert back.codec == codec
        tolerance = {"raw": 0.0, "bf16": 2**-8, "int8": 0.05}[codec]
        assert float(((back.hidden.float() - hidden).abs() / hidden.abs().clamp_min(1.0)).max()) <= tolerance
        reply = decode_message(encode_message(StepResult("s", 1, hidden, 0.5, codec)))
        assert isinstance(reply, StepResult)
        assert reply.codec == codec
        assert peek_header(encode_message(step))["codec"] == codec
