"""Federated wire messages: round trips, validation of peer input, handshake checks, no I/O imports."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from splitspec.exceptions import AuthenticationFailed, BadTensor, HandshakeMismatch, MalformedFrame
from splitspec.federated.topk import TopKPolicy, decode_topk, encode_topk, select_topk, stream_to_words, words_to_stream
from splitspec.protocol.fed import (
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
    assert isinstance(score, FedScore) and score.tokens.tolist() == [5, 6, 7] and score.k == 4
    p = torch.softmax(torch.randn(3, 96), -1)
    stream, probs = encode_topk(select_topk(p, TopKPolicy(k=5)))
    reply = FedScores(3, 3, 96, len(stream), stream_to_words(stream), probs, 1.5, full=p)
    back = decode_fed(encode_fed(reply))
    assert isinstance(back, FedScores) and back.full is not None and torch.equal(back.full, p)
    topk = decode_topk(words_to_stream(back.stream, back.stream_bytes), back.probs, 3, 96)
    assert topk.counts.tolist() == [5, 5, 5]
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
        ({"keep": -1}, MalformedFrame),
        ({"tokens": torch.tensor([5, 6, 7], dtype=torch.int64)}, BadTensor),
        ({"tokens": torch.zeros(0, dtype=torch.int32), "num_scored": 1}, BadTensor),
    ],
)
def test_bad_score_is_refused(overrides: dict[str, object], error: type[Exception]) -> None:
    data = encode_fed(_score(**overrides)) if "temperature" not in overrides else _raw_score(overrides)
    with pytest.raises(error):
        decode_fed(data)


def _raw_score(overrides: dict[str, object]) -> bytes:
    header, tensors = _score().to_wire()
    header.update(overrides)
    return encode_frame({"type": "fed_score", **header}, tensors)


def test_bad_scores_reply_is_refused() -> None:
    header = {"type": "fed_scores", "seq": 1, "positions": 2, "vocab_size": 10, "stream_bytes": 3, "worker_ms": 1}
    ok = {"stream": torch.zeros(1, dtype=torch.int32), "probs": torch.zeros(2, dtype=torch.float16)}
    decode_fed(encode_frame(header, ok))
    with pytest.raises(BadTensor):
        decode_fed(encode_frame(header, {**ok, "probs": torch.zeros(2, dtype=torch.int32)}))
    with pytest.raises(BadTensor):
        decode_fed(encode_frame(header, {**ok, "full": torch.zeros(3, 10)}))
    with pytest.raises(MalformedFrame):
        decode_fed(encode_frame({**header, "type": "pickle"}, ok))


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

    import splitspec.federated.topk
    import splitspec.protocol.fed

    for module in (splitspec.protocol.fed, splitspec.federated.topk):
        source = Path(str(module.__file__)).read_text()
        for node in ast.walk(ast.parse(source)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            assert not {n.split(".")[0] for n in names} & {"asyncio", "websockets", "transformers"}, names
    code = (
        "import sys, splitspec.protocol.fed, splitspec.federated.topk; "
        "print(','.join(m for m in ('websockets', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == ""
