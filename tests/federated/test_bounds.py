"""Property tests of the SpecFed bounds over random laws, weights and K."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from splitspec.federated.codec import decode_topk, encode_topk
from splitspec.federated.topk import TopKPolicy, bound_report, round_budget_k, select_topk


@st.composite
def cases(draw: st.DrawFn) -> tuple[list[torch.Tensor], list[float], list[int], torch.Tensor, str, str]:
    vocab = draw(st.integers(2, 64))
    workers = draw(st.integers(1, 4))
    seed = draw(st.integers(0, 2**31 - 1))
    sharpness = draw(st.floats(0.1, 8.0))
    g = torch.Generator().manual_seed(seed)
    laws = [torch.softmax(torch.randn(3, vocab, generator=g) * sharpness, -1) for _ in range(workers)]
    weights = draw(st.lists(st.floats(0.01, 10.0), min_size=workers, max_size=workers))
    ks = draw(st.lists(st.integers(1, vocab), min_size=workers, max_size=workers))
    draft = torch.softmax(torch.randn(3, vocab, generator=g) * sharpness, -1)
    method = draw(st.sampled_from(["renorm", "residual"]))
    codec = draw(st.sampled_from(["quantized", "float16", "float32"]))
    return laws, weights, ks, draft, method, codec


@settings(max_examples=150, deadline=None)
@given(cases())
def test_aggregation_bias_and_acceptance_drift_bounds(
    case: tuple[list[torch.Tensor], list[float], list[int], torch.Tensor, str, str],
) -> None:
    laws, weights, ks, draft, method, codec = case
    topks = []
    for law, k in zip(laws, ks, strict=True):
        stream = encode_topk(law, select_topk(law, TopKPolicy(k=k)), codec)  # type: ignore[arg-type]
        topks.append(decode_topk(stream, law.shape[0], law.shape[1]))
    report = bound_report(laws, topks, weights, method, draft=draft)  # type: ignore[arg-type]
    assert report.violations() == []
    tol = report.tolerance
    assert bool((report.per_worker_delta <= 2 * report.per_worker_epsilon + tol).all())  # ‖p_i − p̂_i‖₁ ≤ 2ε_i
    assert bool((report.delta <= report.bound + tol).all())  # Δ ≤ 2Σ w_i ε_i
    drift = report.drift
    assert drift is not None
    assert bool((drift <= 0.5 * report.delta + tol).all())
    assert bool((drift <= report.weighted_epsilon + tol).all())  # hence |α − α̂| ≤ Σ w_i ε_i
    # ... also with the ε the workers reported (an upper bound on the exact one)
    assert report.per_worker_reported is not None
    reported = (torch.tensor(weights).double() / sum(weights))[:, None].float() * report.per_worker_reported
    assert bool((report.delta <= 2 * reported.sum(0) + tol).all())
    if codec == "float32":  # no quantization: the paper's bound with the bare tail mass, Δ ≤ 2Σ w_i τ_i
        assert bool((report.delta <= 2 * report.weighted_tail + tol).all())


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 300), st.floats(0.0, 0.5), st.integers(0, 10_000))
def test_adaptive_k_meets_its_target(vocab: int, target: float, seed: int) -> None:
    law = torch.softmax(torch.randn(4, vocab, generator=torch.Generator().manual_seed(seed)) * 3, -1)
    topk = select_topk(law, TopKPolicy(target_epsilon=target, max_k=vocab))
    assert bool((topk.residual_mass() <= target + 1e-5).all())
    smaller = select_topk(law, TopKPolicy(k=1))
    assert bool((topk.counts >= smaller.counts).all())
    # minimality: one fewer token would miss the target
    for row, k in enumerate(topk.counts.tolist()):
        if k > 1:
            top = law[row].double().sort(descending=True).values
            assert 1 - float(top[: k - 1].sum()) > target - 1e-9


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 300), st.integers(1, 40), st.integers(0, 10_000))
def test_round_budget_never_keeps_more_than_fixed_k_at_the_same_mean_epsilon(vocab: int, k: int, seed: int) -> None:
    law = torch.softmax(torch.randn(5, vocab, generator=torch.Generator().manual_seed(seed)) * 3, -1)
    fixed = select_topk(law, TopKPolicy(k=k))
    mean_eps = max(0.0, float((1 - law.double().topk(min(k, vocab), -1).values.sum(-1)).mean()))
    counts = round_budget_k(law, mean_eps, vocab)
    assert int(counts.sum()) <= int(fixed.counts.sum())
    budget = select_topk(law, TopKPolicy(target_epsilon=mean_eps, scope="round", max_k=vocab))
    assert float(budget.residual_mass().double().mean()) <= mean_eps + 1e-5
