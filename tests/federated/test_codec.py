"""The top-K bit stream: literal bits, round trips, error accounting and every refusal path."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from splitspec.exceptions import BadTensor, ConfigError
from splitspec.federated.codec import (
    EPS_SCALE,
    ETA_FLOOR,
    _BitReader,
    _BitWriter,
    decode_topk,
    encode_topk,
    quantization_step,
)
from splitspec.federated.topk import TopKPolicy, bound_report, l1, reconstruct, select_topk

LAW = torch.tensor([[0.05, 0.05, 0.05, 0.5, 0.0, 0.05, 0.0, 0.25, 0.05, 0.0]], dtype=torch.float64)


def _bits(data: bytes) -> str:
    return "".join(f"{b:08b}" for b in data)


def test_literal_stream_of_a_small_case() -> None:
    """K = 2 of |V| = 10, ids {3, 7} with p = 0.5, 0.25 (tail τ = 0.25), quantized, ρ = 0.05."""
    topk = select_topk(LAW, TopKPolicy(k=2))
    stream = encode_topk(LAW, topk)
    # step: 2(ρτ + 2⁻¹⁶)/K = 0.012515 -> e = ⌈−4·log2⌉ = 26, s = 2^−6.5; q = 45, 23
    step = 2**-6.5
    eta = abs(45 * step - 0.5) + abs(23 * step - 0.25)
    assert math.ceil((0.25 + eta) * EPS_SCALE) == 16839
    expected = (
        "00"  # codec 0: quantized
        + "0001"  # K − 1 = 1 in bitlen(|V| − 1) = 4 bits
        + f"{16839:016b}"  # ⌈ε·65535⌉, ε = τ + η
        + "00010"  # id order r = 2 (gaps 3, 3 cost 3 bits each)
        + "111"
        + "111"  # EG_2(3): u = 7 in 3 bits, no leading zeros; twice
        + "00011010"  # e = 26
        + "00011"  # value order r' = 3 (q − 1 = 44, 22)
        + "00"
        + "110100"  # EG_3(44): u = 52, 6 bits after 2 zeros
        + "0"
        + "11110"  # EG_3(22): u = 30, 5 bits after 1 zero
    )
    expected += "0" * (-len(expected) % 8)
    assert _bits(stream) == expected
    assert stream == bytes.fromhex("05071c5f8d0cd1e0")
    back = decode_topk(stream, 1, 10)
    assert back.ids.tolist() == [3, 7]
    assert back.counts.tolist() == [1 + 1]
    assert back.probs.tolist() == pytest.approx([45 * step, 23 * step], rel=1e-6)
    assert back.epsilon is not None
    assert float(back.epsilon[0]) == pytest.approx(16839 / EPS_SCALE)


def test_exp_golomb_literal_codes() -> None:
    out = _BitWriter()
    out.exp_golomb(np.array([0, 1, 2, 3, 7]), 0)
    out.exp_golomb(np.array([0, 5]), 2)
    expected = "1" + "010" + "011" + "00100" + "0001000" + "100" + "0" + "1001"
    assert _bits(out.to_bytes()) == expected + "0" * (-len(expected) % 8)
    reader = _BitReader(out.to_bytes())
    assert reader.exp_golomb(5, 0, "a").tolist() == [0, 1, 2, 3, 7]
    assert reader.exp_golomb(2, 2, "b").tolist() == [0, 5]
    reader.finish()


@pytest.mark.parametrize("codec", ["quantized", "float16", "float32"])
@pytest.mark.parametrize(("vocab", "k"), [(2, 1), (96, 5), (1000, 1000), (8192, 82), (32000, 320)])
def test_round_trip_and_reported_epsilon(codec: str, vocab: int, k: int) -> None:
    g = torch.Generator().manual_seed(vocab + k)
    law = torch.softmax(torch.randn(5, vocab, generator=g) * 3, -1)
    topk = select_topk(law, TopKPolicy(k=k))
    back = decode_topk(encode_topk(law, topk, codec), 5, vocab)  # type: ignore[arg-type]
    sent = torch.zeros(5, vocab, dtype=torch.float64)
    sent[back.segment_index(), back.ids] = back.probs.double()
    exact = l1(law, sent)  # ‖p − p̃‖₁
    assert back.epsilon is not None
    assert bool((back.epsilon >= exact - 1e-6).all())  # an upper bound ...
    assert bool((back.epsilon <= exact + 2 / EPS_SCALE).all())  # ... that is tight
    kept = set(zip(back.segment_index().tolist(), back.ids.tolist(), strict=True))
    assert kept <= set(zip(topk.segment_index().tolist(), topk.ids.tolist(), strict=True))
    if codec == "float32":
        assert torch.equal(back.ids, topk.ids)
        assert torch.equal(back.probs, topk.probs)
    elif codec == "float16":
        assert torch.equal(back.ids, topk.ids)
        assert torch.allclose(back.probs, topk.probs, rtol=2**-10, atol=2**-24)
    else:  # quantization (dropped zeros included) stays inside its budget: ε <= τ + ρτ + 2⁻¹⁶
        tail = 1 - law.double().gather(1, law.topk(k, -1).indices).sum(-1)
        assert bool((exact <= (1 + 0.05) * tail + ETA_FLOOR + 1e-6).all())


def test_quantized_is_smaller_than_float16_and_dense_ids_cost_one_bit() -> None:
    g = torch.Generator().manual_seed(3)
    law = torch.softmax(torch.randn(5, 8192, generator=g) * 2.5, -1)
    topk = select_topk(law, TopKPolicy(k=82))
    quantized, f16 = encode_topk(law, topk, "quantized"), encode_topk(law, topk, "float16")
    assert len(quantized) < 0.75 * len(f16)
    dense = encode_topk(law, select_topk(law, TopKPolicy(k=8192)), "float16")
    # per position 13 + 16 + 5 header bits, 8192 one-bit id codes, 8192 raw float16 values
    assert len(dense) == math.ceil((2 + 5 * (13 + 16 + 5 + 8192 + 16 * 8192)) / 8)


def test_step_keeps_the_top_token_and_the_grid() -> None:
    e, s = quantization_step(tail=0.99, k=82, top=1e-4, rho=0.05)
    assert s <= 1e-4
    assert s == 2 ** (-e / 4)
    assert 2 ** (-(e - 1) / 4) > 1e-4
    e, s = quantization_step(tail=0.0, k=8192, top=0.9, rho=0.05)
    assert s <= 2 * ETA_FLOOR / 8192


@settings(max_examples=60, deadline=None)
@given(
    st.integers(2, 400),
    st.floats(0.001, 0.6),
    st.sampled_from(["quantized", "float16", "float32"]),
    st.sampled_from(["position", "round"]),
    st.integers(0, 10_000),
)
def test_adaptive_target_bounds_the_transmitted_epsilon(
    vocab: int, target: float, codec: str, scope: str, seed: int
) -> None:
    """Adaptive K selects on the residual mass τ <= target; the codec adds at most its own error."""
    law = torch.softmax(torch.randn(5, vocab, generator=torch.Generator().manual_seed(seed)) * 3, -1)
    policy = TopKPolicy(target_epsilon=target, max_k=vocab, scope=scope)  # type: ignore[arg-type]
    back = decode_topk(encode_topk(law, select_topk(law, policy), codec), 5, vocab)  # type: ignore[arg-type]
    assert back.epsilon is not None
    grid = 1 / EPS_SCALE + 1e-6  # ε travels ceiled to 1/65535
    allowed = {"quantized": (1 + 0.05) * target + ETA_FLOOR, "float16": target + 2**-11, "float32": target}[codec]
    eps = back.epsilon if scope == "position" else back.epsilon.double().mean()
    assert bool((eps <= allowed + grid).all())


@pytest.mark.parametrize("method", ["renorm", "residual"])
def test_bounds_hold_with_the_reported_epsilon(method: str) -> None:
    g = torch.Generator().manual_seed(5)
    laws = [torch.softmax(torch.randn(4, 300, generator=g) * s, -1) for s in (1.0, 4.0)]
    topks = [decode_topk(encode_topk(p, select_topk(p, TopKPolicy(k=7))), 4, 300) for p in laws]
    report = bound_report(laws, topks, [0.3, 0.7], method, draft=torch.softmax(torch.randn(4, 300, generator=g), -1))  # type: ignore[arg-type]
    assert report.violations() == []
    assert report.per_worker_reported is not None
    assert bool((report.per_worker_reported >= report.per_worker_epsilon - 1e-6).all())
    for p, t in zip(laws, topks, strict=True):
        assert bool((l1(p, reconstruct(t, method)) <= 2 * t.transmitted_epsilon() + 1e-5).all())  # type: ignore[arg-type]


def _stream(*fields: tuple[int, int]) -> bytes:
    out = _BitWriter()
    for value, width in fields:
        out.fixed(value, width)
    return out.to_bytes()


def _f32(x: float) -> int:
    return int(np.array([x], dtype=np.float32).view(np.uint32)[0])


# |V| = 10: K − 1 in 4 bits. One position with ids {3, 7} (EG_2 codes "111", "111") and float32 values.
_HEAD = [(2, 2), (1, 4), (EPS_SCALE // 4, 16), (2, 5), (7, 3), (7, 3)]
_VALUES = [(_f32(0.5), 32), (_f32(0.25), 32)]


@pytest.mark.parametrize(
    ("data", "positions", "match"),
    [
        (b"", 1, "ends inside the codec"),
        (_stream((3, 2)), 1, "unknown value codec"),
        (_stream((2, 2), (1, 4)), 1, "ends inside an epsilon"),
        (_stream((2, 2), (15, 4), (0, 16), (0, 5), *[(1, 1)] * 16), 1, "exceeds the vocabulary"),
        (_stream((2, 2), (0, 4), (0, 16), (0, 5), (0, 3), (15, 4)), 1, "outside the vocabulary"),  # EG_0: id 14
        (_stream((2, 2), (1, 4), (0, 16), (0, 5), (6, 5), (6, 5)), 1, "outside the vocabulary"),  # gaps 5, 5: id 11
        # gaps near 2**52 wrapped the running sum in int64, past the last id's check: EG_0 of 2**52 - 2 is
        # 51 zeros and 52 bits of 2**52 - 1
        (_stream((2, 2), (1, 4), (0, 16), (0, 5), *[(0, 51), ((1 << 52) - 1, 52)] * 2), 1, "outside the vocabulary"),
        (_stream((2, 2), (0, 4), (0, 16), (0, 5), (0, 60)), 1, "over-long code"),
        (_stream((2, 2), (0, 4), (0, 16), (0, 5), (1, 4)), 1, "ends inside the ids"),  # "0001" needs 3 more bits
        (_stream((2, 2), (9, 4), (0, 16), (5, 5)), 1, "ends inside the ids"),  # 10 codes of >= 6 bits: no room
        (_stream(*_HEAD, (_f32(0.5), 32)), 1, "ends inside the values"),
        (_stream(*_HEAD, *_VALUES), 2, "ends inside"),  # a second position is missing
        (_stream(*_HEAD, *_VALUES, (0, 8)), 1, "trailing bytes"),
        (_stream(*_HEAD, *_VALUES, (1, 2)), 1, "padding must be zero"),
        (_stream(*_HEAD, (_f32(float("nan")), 32), (_f32(0.25), 32)), 1, "finite"),
        (_stream(*_HEAD, (_f32(-0.5), 32), (_f32(0.25), 32)), 1, "finite and in"),
        (_stream(*_HEAD[:2], (0, 16), *_HEAD[3:], *_VALUES), 1, "inconsistent with ε"),  # claims ε = 0
        (_stream(*_HEAD, (_f32(0.9), 32), (_f32(0.9), 32)), 1, "inconsistent"),  # mass 1.8
    ],
)
def test_decode_refuses_bad_streams(data: bytes, positions: int, match: str) -> None:
    with pytest.raises(BadTensor, match=match):
        decode_topk(data, positions, 10)


def test_valid_hand_built_stream_decodes() -> None:
    back = decode_topk(_stream(*_HEAD, *_VALUES), 1, 10)
    assert back.ids.tolist() == [3, 7]
    assert back.probs.tolist() == [0.5, 0.25]


def test_bit_writer_refuses_fields_that_do_not_fit() -> None:
    with pytest.raises(ValueError, match="does not fit 4 bits"):
        _BitWriter().fixed(16, 4)
    with pytest.raises(ValueError, match="more than 52 bits"):
        _BitWriter().exp_golomb(np.array([1 << 53]), 0)


def test_encoder_refuses_bad_arguments() -> None:
    topk = select_topk(LAW, TopKPolicy(k=2))
    with pytest.raises(ConfigError):
        encode_topk(LAW, topk, "int8")  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        encode_topk(LAW, topk, rho=0.0)
    with pytest.raises(ValueError, match="do not match a top-K"):
        encode_topk(LAW.repeat(2, 1), topk)
    with pytest.raises(BadTensor):
        decode_topk(encode_topk(LAW, topk), 1, 0)


def test_demo_worker_laws_at_one_percent_fit_a_hundredth_of_dense_float16() -> None:
    """On the embedded demo worker and held-out code, K = 1 % costs < 1/100 of the float16 law per
    position, the 25-byte reply header of a γ = 4 round included (a regression guard on the codec)."""
    import splitspec
    from splitspec.decoding.local import LocalSequence
    from splitspec.federated.lm import load_model
    from splitspec.protocol.fed import SCORES_HEADER_SIZE

    assets = Path(splitspec.__file__).parent / "assets"
    loaded = load_model(assets / "models" / "worker")
    text = sorted((assets / "corpus" / "heldout" / "code").glob("*.txt"))[0].read_text()
    ids = list(loaded.tokenizer.encode(text))[:101]
    logits = LocalSequence(loaded.model).run(ids)  # (101, V) float32
    laws = torch.softmax(logits, -1)  # (101, 8192), T = 1
    vocab = laws.shape[1]
    sizes = []
    for start in range(0, 100, 5):
        rows = laws[start : start + 5]
        stream = encode_topk(rows, select_topk(rows, TopKPolicy(k=round(0.01 * vocab))))
        sizes.append((len(stream) + SCORES_HEADER_SIZE) / 5)
    assert max(sizes) < 2 * vocab / 100, sizes


@pytest.mark.parametrize("fill", [b"\x00", b"\xff", b"\x55", None])
def test_decoding_a_hostile_stream_holds_little_memory(fill: bytes | None) -> None:
    """Issue #12 item 1: a 256 KiB reply used to be expanded to int64 bits (+128 MB) before any
    check; now the decoder's peak stays within a small multiple of its input."""
    import tracemalloc

    size = 256 * 1024
    body = np.random.default_rng(0).bytes(size) if fill is None else fill * size
    data = _stream((2, 2), (9, 13), (0, 16), (0, 5)) + body  # float32 values, K = 10 of 8192
    tracemalloc.start()
    try:
        with pytest.raises(BadTensor):
            decode_topk(data, 64, 8192)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak <= 8 * len(data), peak


def test_a_count_above_what_the_request_allowed_is_refused() -> None:
    law = torch.softmax(torch.randn(2, 50, generator=torch.Generator().manual_seed(3)), -1)
    stream = encode_topk(law, select_topk(law, TopKPolicy(k=8)))
    assert decode_topk(stream, 2, 50, max_k=8).counts.tolist() == [8, 8]
    with pytest.raises(BadTensor, match="the 7 the request allowed"):
        decode_topk(stream, 2, 50, max_k=7)
