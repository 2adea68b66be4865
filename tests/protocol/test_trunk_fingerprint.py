"""The trunk fingerprint on the wire: its text form, its validation in a Welcome, and the edge's verdict."""

from __future__ import annotations

import re

import pytest

from splitspec.exceptions import HandshakeMismatch, MalformedFrame, TrunkMismatch
from splitspec.protocol.frames import encode_frame
from splitspec.protocol.messages import Welcome, decode_message
from splitspec.protocol.trunk_fingerprint import TrunkFingerprint, check_trunk

DIGEST = "0123456789abcdef" * 2
OURS = TrunkFingerprint(2, 6, "bfloat16", DIGEST)


def welcome_bytes(trunk: object) -> bytes:
    """A Welcome frame whose trunk_fingerprint field holds ``trunk`` as written."""
    header, _ = Welcome("s", 100, 4, 1.0, OURS, "bfloat16").to_wire()
    return encode_frame({"type": Welcome.TYPE, **header, "trunk_fingerprint": trunk})


def test_text_form_round_trips_through_a_welcome() -> None:
    assert str(OURS) == f"2-6:bfloat16:{DIGEST}"
    assert TrunkFingerprint.parse(str(OURS)) == OURS
    decoded = decode_message(welcome_bytes(str(OURS)))
    assert isinstance(decoded, Welcome)
    assert decoded.trunk == OURS


@pytest.mark.parametrize(
    "text",
    [
        f"6-2:bfloat16:{DIGEST}",  # empty range
        f"2-6:bfloat16:{DIGEST[:-1]}",  # short digest
        f"2-6:BF16:{DIGEST}",  # not a dtype name as we write them
        f"2-6:bfloat16:{DIGEST}:extra",
        "",
        None,  # absent: a server older than the field
        42,
    ],
)
def test_malformed_fingerprint_in_a_welcome_is_refused(text: object) -> None:
    if isinstance(text, str):
        with pytest.raises(ValueError, match="START-END:DTYPE:DIGEST"):
            TrunkFingerprint.parse(text)
    with pytest.raises(MalformedFrame, match="trunk_fingerprint"):
        decode_message(welcome_bytes(text))


def test_the_same_trunk_passes() -> None:
    check_trunk(OURS, TrunkFingerprint.parse(str(OURS)), "the edge's copy")


@pytest.mark.parametrize(
    ("served", "what"),
    [
        (TrunkFingerprint(2, 6, "bfloat16", "f" * 32), "same layers 2..5 stored as bfloat16, but other weights"),
        (
            TrunkFingerprint(2, 6, "float32", "f" * 32),
            "the stored dtype differs (the edge's copy: bfloat16; cloud: float32)",
        ),
        (
            TrunkFingerprint(1, 6, "bfloat16", "f" * 32),
            "the layer range differs (the edge's copy: layers 2..5; cloud: layers 1..5)",
        ),
    ],
)
def test_a_mismatch_names_both_fingerprints_and_what_differs(served: TrunkFingerprint, what: str) -> None:
    with pytest.raises(TrunkMismatch) as info:
        check_trunk(OURS, served, "the edge's copy")
    message = str(info.value)
    assert what in message
    assert str(OURS) in message
    assert str(served) in message
    assert isinstance(info.value, HandshakeMismatch)  # a handshake failure: the edge does not retry it


@pytest.mark.parametrize(
    ("text", "quantization"),
    [
        (f"2-6:nf4(bfloat16):{DIGEST}", "nf4"),
        (f"2-6:bnb_nf4(bfloat16+float32+uint8):{DIGEST}", "bnb_nf4"),
        (f"2-6:ct_fp8(bfloat16+float8_e4m3fn):{DIGEST}", "ct_fp8"),
        (f"2-6:bfloat16:{DIGEST}", "none"),
    ],
)
def test_a_quantized_trunk_names_its_method_and_travels_in_a_welcome(text: str, quantization: str) -> None:
    trunk = TrunkFingerprint.parse(text)
    assert str(trunk) == text
    assert trunk.quantization == quantization
    decoded = decode_message(welcome_bytes(text))
    assert isinstance(decoded, Welcome)
    assert decoded.trunk == trunk


@pytest.mark.parametrize(
    "text",
    [
        f"2-6:nf4():{DIGEST}",  # no stored dtype
        f"2-6:nf4(bfloat16:{DIGEST}",  # unclosed
        f"2-6:(bfloat16):{DIGEST}",  # no method
        f"2-6:nf4(int8(bfloat16)):{DIGEST}",  # nested
        f"2-6:{'q' * 17}(bfloat16):{DIGEST}",  # method longer than 16
    ],
)
def test_malformed_quantized_fingerprints_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="START-END:DTYPE:DIGEST"):
        TrunkFingerprint.parse(text)
    with pytest.raises(MalformedFrame, match="trunk_fingerprint"):
        decode_message(welcome_bytes(text))


@pytest.mark.parametrize(
    ("served", "what"),
    [
        (
            TrunkFingerprint(2, 6, "nf4(bfloat16)", DIGEST),
            "the quantization differs (the edge's copy: none; cloud: nf4)",
        ),
        (
            TrunkFingerprint(2, 6, "int8(bfloat16)", DIGEST),
            "the quantization differs (the edge's copy: none; cloud: int8)",
        ),
    ],
)
def test_a_trunk_quantized_otherwise_is_refused_naming_the_method(served: TrunkFingerprint, what: str) -> None:
    with pytest.raises(TrunkMismatch, match=re.escape(what)):
        check_trunk(OURS, served, "the edge's copy")
