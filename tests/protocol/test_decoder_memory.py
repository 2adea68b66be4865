"""Issue #12: every decoder's peak memory stays within 8x its input (traced by tracemalloc).

The hostile inputs are the cheapest bytes in Python objects: 3-byte ``[],`` / ``{},`` JSON values
(a 56-64-byte object each), one astral character widening a whole header string to 4 bytes a
character, and dense top-K streams whose decoded ids and values outweigh their codes.
"""

from __future__ import annotations

import struct
import tracemalloc
from collections.abc import Callable

import pytest
import torch

from splitspec.exceptions import MalformedFrame, SplitspecError
from splitspec.federated.codec import decode_topk, encode_topk
from splitspec.federated.topk import TopKPolicy, select_topk
from splitspec.protocol.fed import FedScores, decode_fed
from splitspec.protocol.frames import MAGIC, MAX_HEADER_BYTES, MAX_HEADER_VALUES, PROTOCOL_VERSION, decode_frame
from splitspec.protocol.messages import decode_message

LIMIT = 8.0  # peak traced bytes per input byte


def peak_per_byte(decode: Callable[[bytes], object], data: bytes) -> float:
    """Peak traced allocation while ``decode`` runs (refusals included), per input byte."""
    tracemalloc.start()
    try:
        decode(data)
    except SplitspecError:
        pass
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    return peak / len(data)


def frame(header: str, payload: bytes = b"") -> bytes:
    raw = header.encode()
    return struct.pack(">4sHI", MAGIC, PROTOCOL_VERSION, len(raw)) + raw + payload


def filled(item: str) -> str:
    """A header as close to the size cap as ``item``s allow."""
    return '{"a":[' + ",".join([item] * ((MAX_HEADER_BYTES - 20) // (len(item) + 1))) + "]}"


@pytest.mark.parametrize(
    "header",
    [
        filled("[]"),
        filled("{}"),
        filled('"ab"'),
        filled("257"),
        filled("1.5"),
        '{"a":' + "[" * 3000 + "]" * 3000 + "}",
        '{"a":"\\ud83d\\ude00' + "x" * (MAX_HEADER_BYTES - 30) + '"}',  # one astral char: a UCS-4 string
    ],
)
@pytest.mark.parametrize("decode", [decode_frame, decode_message, decode_fed])
def test_json_headers_cost_at_most_8x(header: str, decode: Callable[[bytes], object]) -> None:
    assert peak_per_byte(decode, frame(header)) <= LIMIT


def test_a_header_with_too_many_values_is_refused_before_parsing() -> None:
    within = '{"a":[' + ",".join(["0"] * (MAX_HEADER_VALUES - 2)) + "]}"
    with pytest.raises(MalformedFrame, match="payloads need"):  # parsed, then refused for its payload
        decode_frame(frame(within, b"x"))
    with pytest.raises(MalformedFrame, match="commas and brackets"):
        decode_frame(frame('{"a":[' + ",".join(["0"] * MAX_HEADER_VALUES) + "]}"))


def test_a_non_ascii_header_is_refused() -> None:
    raw = '{"type":"hello","client":"é"}'.encode()
    with pytest.raises(MalformedFrame, match="not ASCII"):
        decode_frame(struct.pack(">4sHI", MAGIC, PROTOCOL_VERSION, len(raw)) + raw)


def peak_bytes(decode: Callable[[], object]) -> int:
    tracemalloc.start()
    try:
        decode()
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    return peak


@pytest.mark.parametrize("codec", ["quantized", "float16", "float32"])
def test_dense_top_k_streams_cost_their_input_and_under_twice_their_output(codec: str) -> None:
    """A decoded entry is 12 bytes (int64 id, float32 value) whatever its code costs (down to a
    few bits): peak memory is the input plus < 2x that output; a float32 stream stays within 8x."""
    positions, vocab = 9, 8192
    laws = torch.softmax(torch.randn(positions, vocab, generator=torch.Generator().manual_seed(0)) * 3, -1)
    stream = encode_topk(laws, select_topk(laws, TopKPolicy(k=vocab)), codec)  # type: ignore[arg-type]
    entries = int(decode_topk(stream, positions, vocab).counts.sum())
    peak = peak_bytes(lambda: decode_topk(stream, positions, vocab))
    assert peak - len(stream) <= 24 * entries
    if codec == "float32":
        assert peak <= LIMIT * len(stream)


def test_audit_replies_are_copied_once() -> None:
    laws = torch.full((4, 4096), 1.0 / 4096)
    stream = encode_topk(laws, select_topk(laws, TopKPolicy(k=4)))
    reply = FedScores(1, 4, 4096, stream, 1.0, full=laws).to_bytes()
    assert peak_per_byte(decode_fed, reply) <= 1.2
