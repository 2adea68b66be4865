"""Top-K selection, compact encoding, reconstruction: exact small cases and the wire format."""

from __future__ import annotations

import pytest
import torch

from splitspec.decoding.sampling import probabilities
from splitspec.exceptions import BadTensor, ConfigError
from splitspec.federated.topk import (
    TopK,
    TopKPolicy,
    acceptance_rate,
    adaptive_k,
    aggregate,
    bound_report,
    decode_topk,
    encode_topk,
    l1,
    nucleus,
    payload_bytes,
    reconstruct,
    select_topk,
    stream_to_words,
    words_to_stream,
)


def test_renorm_of_a_two_token_law_with_k1() -> None:
    p = torch.tensor([[0.9, 0.1]])
    topk = select_topk(p, TopKPolicy(k=1))
    assert topk.ids.tolist() == [0] and topk.residual_mass().tolist() == pytest.approx([0.1])
    r = reconstruct(topk, "renorm")
    assert r.tolist() == [[1.0, 0.0]]
    assert float(l1(p, r)[0]) == pytest.approx(0.2)  # Δ = 2ε: the bound is tight for renorm


def test_residual_spreads_the_rest_uniformly() -> None:
    p = torch.tensor([[0.6, 0.05, 0.3, 0.05]])
    topk = select_topk(p, TopKPolicy(k=2))
    assert topk.ids.tolist() == [0, 2]
    r = reconstruct(topk, "residual")
    assert r[0].tolist() == pytest.approx([0.6, 0.05, 0.3, 0.05])  # the rest was uniform: exact
    p2 = torch.tensor([[0.6, 0.1, 0.3, 0.0]])
    r2 = reconstruct(select_topk(p2, TopKPolicy(k=2)), "residual")
    assert r2[0].tolist() == pytest.approx([0.6, 0.05, 0.3, 0.05])
    assert float(l1(p2, r2)[0]) == pytest.approx(0.1)  # ≤ 2ε = 0.2


def test_k_equal_to_vocab_is_lossless() -> None:
    p = torch.softmax(torch.randn(3, 50), -1)
    for method in ("renorm", "residual"):
        r = reconstruct(select_topk(p, TopKPolicy(k=50)), method)  # type: ignore[arg-type]
        assert torch.allclose(r, p, atol=1e-6)


def test_aggregate_and_acceptance() -> None:
    a, b = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 1.0]])
    assert aggregate([a, b], [3, 1]).tolist() == [[0.75, 0.25]]
    assert float(acceptance_rate(torch.tensor([[0.75, 0.25]]), torch.tensor([[0.5, 0.5]]))[0]) == pytest.approx(0.75)
    with pytest.raises(ConfigError):
        aggregate([a, b], [0, 0])


def test_adaptive_k_is_the_smallest_meeting_the_target() -> None:
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.97, 0.01, 0.01, 0.01]])
    assert adaptive_k(p, 0.2, 10).tolist() == [2, 1]
    assert adaptive_k(p, 0.0, 10).tolist() == [4, 4]
    assert adaptive_k(p, 0.0, 3).tolist() == [3, 3]  # capped
    topk = select_topk(p, TopKPolicy(target_epsilon=0.1))
    assert topk.counts.tolist() == [3, 1]
    assert bool((topk.residual_mass() <= 0.1 + 1e-6).all())


def test_nucleus_matches_the_logit_transform() -> None:
    logits = torch.randn(4, 30) * 3
    p = torch.softmax(logits, -1)
    assert torch.allclose(nucleus(p, 0.8), probabilities(logits, 1.0, 0.8), atol=1e-6)


@pytest.mark.parametrize("vocab", [96, 1000, 32000])
@pytest.mark.parametrize("k", [1, 10, 320])
def test_round_trip_and_byte_size(vocab: int, k: int) -> None:
    torch.manual_seed(vocab + k)
    p = torch.softmax(torch.randn(5, vocab) * 2, -1)
    topk = select_topk(p, TopKPolicy(k=k))
    kk = min(k, vocab)
    stream, probs = encode_topk(topk)
    words = stream_to_words(stream)
    back = decode_topk(words_to_stream(words, len(stream)), probs, 5, vocab)
    assert torch.equal(back.ids, topk.ids) and torch.equal(back.counts, topk.counts)
    assert torch.allclose(back.probs, topk.probs, rtol=2**-10, atol=2**-24)
    # counts: 1-2 bytes per position; ids: 1 byte per gap <= 128, 2 bytes up to 16384, 3 above
    gaps_bound = 5 * kk * (1 if vocab <= 128 else 2 if vocab <= 16384 else 3)
    assert len(stream) <= 5 * 2 + gaps_bound
    assert probs.dtype == torch.float16 and probs.numel() == 5 * kk
    assert payload_bytes(stream, probs) == len(words) * 4 + 2 * 5 * kk
    assert payload_bytes(stream, probs) < 5 * vocab * 4  # smaller than the dense float32 law


def test_dense_k_costs_one_byte_per_id() -> None:
    p = torch.softmax(torch.randn(2, 500), -1)
    stream, _ = encode_topk(select_topk(p, TopKPolicy(k=500)))
    assert len(stream) == 2 * 2 + 2 * 500  # K = 500 needs 2 varint bytes; every gap is 0 -> 1 byte


def test_float32_codec_is_exact() -> None:
    p = torch.softmax(torch.randn(3, 200), -1)
    topk = select_topk(p, TopKPolicy(k=7))
    stream, probs = encode_topk(topk, "float32")
    assert torch.equal(decode_topk(stream, probs, 3, 200).probs, topk.probs)


def _valid() -> tuple[bytes, torch.Tensor]:
    topk = TopK(vocab_size=10, counts=torch.tensor([2]), ids=torch.tensor([3, 7]), probs=torch.tensor([0.5, 0.25]))
    return encode_topk(topk)


@pytest.mark.parametrize(
    ("stream", "probs", "positions", "vocab", "match"),
    [
        (b"\x02\x03\x80", torch.tensor([0.5, 0.25]), 1, 10, "ends inside"),  # truncated varint
        (b"\x02\x03\x83\x00", torch.tensor([0.5, 0.25]), 1, 10, "non-canonical"),
        (b"\x02\x83\x80\x80\x80\x01", torch.tensor([0.5, 0.25]), 1, 10, "longer than"),
        (b"\x00", torch.tensor([]), 1, 10, "every K"),  # K = 0
        (b"\x02\x03", torch.tensor([0.5, 0.25]), 1, 10, "holds 1 ids"),
        (b"\x02\x03\x06", torch.tensor([0.5, 0.25]), 1, 10, "outside the vocabulary"),  # 3, 3+6+1 = 10
        (b"\x02\x03\x03", torch.tensor([0.5]), 1, 10, "probabilities must be"),
        (b"\x02\x03\x03", torch.tensor([0.5, float("nan")]), 1, 10, "finite"),
        (b"\x02\x03\x03", torch.tensor([0.9, 0.9]), 1, 10, "sum above 1"),
        (b"\x02\x03\x03", torch.tensor([0.5, -0.1]), 1, 10, "finite and in"),
        (b"", torch.tensor([]), 1, 10, "empty"),
    ],
)
def test_decode_refuses_bad_streams(stream: bytes, probs: torch.Tensor, positions: int, vocab: int, match: str) -> None:
    with pytest.raises(BadTensor, match=match):
        decode_topk(stream, probs, positions, vocab)


def test_valid_stream_decodes_and_padding_is_checked() -> None:
    stream, probs = _valid()
    assert stream == b"\x02\x03\x03"
    assert decode_topk(stream, probs, 1, 10).ids.tolist() == [3, 7]
    words = stream_to_words(stream)
    with pytest.raises(BadTensor):
        words_to_stream(words, 8)
    dirty = words.clone()
    dirty.view(torch.uint8)[3] = 1
    with pytest.raises(BadTensor, match="padding"):
        words_to_stream(dirty, 3)


def test_bound_report_flags_violations() -> None:
    p = torch.tensor([[0.9, 0.1]])
    topk = select_topk(p, TopKPolicy(k=1))
    report = bound_report([p], [topk], [1.0], "renorm", draft=torch.tensor([[0.5, 0.5]]))
    assert report.violations() == []
    assert float(report.delta[0]) == pytest.approx(0.2) and float(report.bound[0]) == pytest.approx(0.2)
    lying = TopK(vocab_size=2, counts=torch.tensor([1]), ids=torch.tensor([1]), probs=torch.tensor([0.9]))
    bad = bound_report([p], [lying], [1.0], "renorm")
    assert bad.violations() == [] or all("worker" in v or "position" in v for v in bad.violations())
