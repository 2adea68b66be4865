"""Property-based fuzzing of every decoder (seconds in CI; ``benchmarks/fuzz.py`` runs >= 10^6 inputs).

Whatever the bytes, each decoder returns a typed value or raises a documented
:class:`~splitspec.exceptions.ProtocolError`; nothing else escapes (issue #12).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from splitspec.exceptions import ProtocolError
from splitspec.federated.codec import decode_topk, encode_topk
from splitspec.federated.topk import TopKPolicy, select_topk
from splitspec.protocol.fed import FedScore, FedScores, decode_fed, encode_fed
from splitspec.protocol.frames import decode_frame
from splitspec.protocol.messages import Hello, Step, decode_message, encode_message
from splitspec.protocol.state import ServerConnection, TrunkIdentity

_LAW = torch.softmax(torch.randn(3, 40, generator=torch.Generator().manual_seed(1)) * 2, -1)
_STREAM = encode_topk(_LAW, select_topk(_LAW, TopKPolicy(k=5)))
SEEDS = [
    encode_message(Hello(fingerprint="f", layer_start=2, layer_end=4, dtype="float32", hidden_size=8, auth_token="t")),
    encode_message(
        Step("s", 1, torch.zeros(1, 2, 8), torch.arange(2, dtype=torch.int32), torch.tensor([-1, 0], dtype=torch.int32))
    ),
    encode_fed(
        FedScore(seq=1, keep=0, tokens=torch.tensor([1, 2], dtype=torch.int32), num_scored=2, temperature=1.0, k=4)
    ),
    FedScores(seq=1, positions=3, vocab_size=40, stream=_STREAM, worker_ms=1.0).to_bytes(),
    _STREAM,
]
DECODERS: dict[str, Callable[[bytes], object]] = {
    "frame": decode_frame,
    "message": decode_message,
    "fed": decode_fed,
    "codec": lambda data: decode_topk(data, 3, 40, max_k=8),
    "gate": ServerConnection(TrunkIdentity("f", 2, 4, "float32", 8), "t").admit,
}


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    """A seed with a few bytes replaced, inserted or cut."""
    data = bytearray(draw(st.sampled_from(SEEDS)))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.integers(0, 2))
        at = draw(st.integers(0, len(data)))
        if op == 0 and at < len(data):
            data[at] = draw(st.integers(0, 255))
        elif op == 1:
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
        else:
            del data[at:]
    return bytes(data)


@pytest.mark.parametrize("name", sorted(DECODERS))
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.one_of(st.binary(max_size=300), mutated()))
def test_decoders_raise_only_protocol_errors(name: str, data: bytes) -> None:
    with contextlib.suppress(ProtocolError):  # anything else fails the test
        DECODERS[name](data)
