"""Federated wire messages: round trips, validation of peer input, handshake checks, no I/O imports."""

from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from splitspec.exceptions import (
    AuthenticationFailed,
    BadMagic,
    BadTensor,
    HandshakeMismatch,
    MalformedFrame,
    MessageTooLarge,
    UnsupportedVersion,
)
from splitspec.federated.codec import decode_topk, encode_topk
from splitspec.federated.topk import TopKPolicy, select_topk
from splitspec.protocol.fed import (
    SCORES_HEADER_SIZE,
    FedHello,
    FedScore,
    FedScores,
    FedWelcome,
    WorkerIdentity,
    check_fed_hello,
    decode_fed,
    encode_fed,
)
from splitspec.protocol.frames import decode_frame, encode_frame
from splitspec.protocol.messages import Error


def _score(**overrides: object) -> FedScore:
    fields: dict[str, object] = dict(
        seq=3, keep=10, tokens=torch.tensor([5, 6, 7], dtype=torch.int32), num_scored=3, temperature=0.8, k=4
    )
    fields.update(overrides)
    return FedScore(**fields)  # type: ignore[arg-type]


def test_round_trips() -> None:
    hello = FedHello(vocab_size=96, tokenizer_fingerprint="abcd", auth_token="s3cret")
    assert decode_fed(encode_fed(hello)) == hello
    welcome = FedWelcome("w/1", "ff", 96, "abcd", 1 << 20, 4096, 2048)
    assert decode_fed(encode_fed(welcome)) == welcome
    score = decode_fed(encode_fed(_score()))
    assert isinstance(score, FedScore)
    assert score.tokens.tolist() == [5, 6, 7]
    assert score.k == 4
    p = torch.softmax(torch.randn(3, 96), -1)
    stream = encode_topk(p, select_topk(p, TopKPolicy(k=5)))
    reply = FedScores(3, 3, 96, stream, 1.5, full=p)
    data = encode_fed(reply)
    assert len(data) == SCORES_HEADER_SIZE + len(stream) + 3 * 96 * 4
    back = decode_fed(data)
    assert isinstance(back, FedScores)
    assert back.full is not None
    assert torch.equal(back.full, p)
    assert back.worker_ms == 1.5
    assert back.stream == stream
    topk = decode_topk(back.stream, 3, 96)
    assert topk.counts.tolist() == [5, 5, 5]
    assert decode_fed(encode_fed(FedScores(3, 3, 96, stream, 1.5))) == FedScores(3, 3, 96, stream, 1.5)
    err = Error(code="handshake_mismatch", message="no", fatal=True)
    assert decode_fed(encode_fed(err)) == err


@pytest.mark.parametrize(
    ("overrides", "error"),
    [
        ({"num_scored": 4}, BadTensor),
        ({"k": None}, MalformedFrame),  # neither k nor target_epsilon
        ({"target_epsilon": 0.1}, MalformedFrame),  # both
        ({"temperature": float("nan")}, MalformedFrame),
        ({"temperature": -1.0}, MalformedFrame),
        ({"prob_codec": "int8"}, MalformedFrame),
        ({"epsilon_scope": "global"}, MalformedFrame),
        ({"quant_budget": 0.0}, MalformedFrame),
        ({"quant_budget": 0.9}, MalformedFrame),
        ({"audit": "yes"}, MalformedFrame),
        ({"keep": -1}, MalformedFrame),
        ({"seq": 2**32}, MalformedFrame),  # #12 item 6: used to fail packing the reply after the compute
        ({"k": None, "target_epsilon": 1.0}, MalformedFrame),  # #12 item 6: passed here, failed the policy
        ({"tokens": torch.tensor([5, 6, 7], dtype=torch.int64)}, BadTensor),
        ({"tokens": torch.zeros(0, dtype=torch.int32), "num_scored": 1}, BadTensor),
    ],
)
def test_bad_score_is_refused(overrides: dict[str, object], error: type[Exception]) -> None:
    raw = {"temperature", "quant_budget", "audit"} & overrides.keys()
    data = encode_fed(_score(**overrides)) if not raw else _raw_score(overrides)
    with pytest.raises(error):
        decode_fed(data)


def _raw_score(overrides: dict[str, object]) -> bytes:
    header, tensors = _score().to_wire()
    header.update(overrides)
    return encode_frame({"type": "fed_score", **header}, tensors)


def test_scores_reply_literal_bytes() -> None:
    reply = FedScores(seq=7, positions=5, vocab_size=8192, stream=b"\xab\xcd", worker_ms=12.3456)
    assert encode_fed(reply) == (
        b"SPFS"  # magic
        + b"\x00\x02"  # federated protocol version 2
        + b"\x00\x00\x00\x07"  # seq
        + b"\x00\x05"  # positions
        + b"\x00\x00\x20\x00"  # vocabulary 8192
        + (12346).to_bytes(4, "big")  # worker time in µs
        + b"\x00"  # flags: no full laws
        + b"\x00\x00\x00\x02"  # stream length
        + b"\xab\xcd"
    )
    assert SCORES_HEADER_SIZE == 25


def _scores(**fields: int | bytes) -> bytes:
    values: dict[str, int | bytes] = dict(
        magic=b"SPFS", version=2, seq=1, positions=2, vocab=10, us=5, flags=0, length=3, body=b"abc"
    )
    values.update(fields)
    body = values.pop("body")
    head = struct.pack(">4sHIHIIBI", *values.values())
    assert isinstance(body, bytes)
    return head + body


@pytest.mark.parametrize(
    ("data", "error"),
    [
        (b"SPFS\x00\x02", MalformedFrame),  # shorter than the header
        (_scores(version=1), UnsupportedVersion),
        (_scores(positions=0), MalformedFrame),
        (_scores(vocab=0), MalformedFrame),
        (_scores(flags=2), MalformedFrame),
        (_scores(length=4), BadTensor),  # missing stream byte
        (_scores(body=b"abcd"), BadTensor),  # trailing byte
        (_scores(flags=1), BadTensor),  # audit flag without the 2 x 10 float32 laws
        (_scores(magic=b"SPLX"), BadMagic),  # not SPFS: parsed as a JSON frame, refused
    ],
)
def test_bad_scores_reply_is_refused(data: bytes, error: type[Exception]) -> None:
    decode_fed(_scores())  # the untouched one parses
    with pytest.raises(error):
        decode_fed(data)


def test_other_frames_are_checked_too() -> None:
    with pytest.raises(BadMagic):
        FedScores.from_bytes(_scores(magic=b"SPLT"))  # direct use still checks the magic
    with pytest.raises(MalformedFrame, match="unknown federated message type"):
        decode_fed(encode_frame({"type": "pickle"}))


def test_scores_reply_size_cap() -> None:
    data = _scores(flags=1, body=b"abc" + bytes(2 * 10 * 4))
    assert isinstance(decode_fed(data), FedScores)
    with pytest.raises(MessageTooLarge):
        decode_fed(data, max_bytes=len(data) - 1)


def test_handshake_checks() -> None:
    ident = WorkerIdentity(vocab_size=96, tokenizer_fingerprint="abcd")
    check_fed_hello(FedHello(96, "abcd"), ident, None)
    with pytest.raises(HandshakeMismatch, match="vocab_size"):
        check_fed_hello(FedHello(128, "abcd"), ident, None)
    with pytest.raises(HandshakeMismatch, match="tokenizer"):
        check_fed_hello(FedHello(96, "zzzz"), ident, None)
    with pytest.raises(AuthenticationFailed):
        check_fed_hello(FedHello(96, "abcd", auth_token="wrong"), ident, "right")
    check_fed_hello(FedHello(96, "abcd", auth_token="right"), ident, "right")


def test_frame_decoding_of_fed_messages_uses_the_shared_frame() -> None:
    frame = decode_frame(encode_fed(FedHello(96, "abcd")))
    assert frame.header["type"] == "fed_hello"


def test_protocol_fed_and_topk_import_no_io() -> None:
    """protocol.fed imports no asyncio/websockets/transformers (statically: torch itself pulls in
    asyncio); at run time neither it nor federated.topk loads websockets or transformers."""
    import ast

    import splitspec.federated.codec
    import splitspec.federated.topk
    import splitspec.protocol.fed

    for module in (splitspec.protocol.fed, splitspec.federated.topk, splitspec.federated.codec):
        source = Path(str(module.__file__)).read_text()
        for node in ast.walk(ast.parse(source)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            assert not {n.split(".")[0] for n in names} & {"asyncio", "websockets", "transformers"}, names
    code = (
        "import sys, splitspec.protocol.fed, splitspec.federated.topk, splitspec.federated.codec; "
        "print(','.join(m for m in ('websockets', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == ""
