"""Top-K selection (fixed, adaptive per position and per round), reconstruction: exact small cases."""

from __future__ import annotations

import pytest
import torch

from splitspec.decoding.sampling import probabilities
from splitspec.exceptions import ConfigError
from splitspec.federated.topk import (
    RECONSTRUCTIONS,
    TopK,
    TopKPolicy,
    acceptance_rate,
    adaptive_k,
    aggregate,
    bound_report,
    distribution_error,
    l1,
    nucleus,
    reconstruct,
    round_budget_k,
    select_topk,
)


def test_renorm_of_a_two_token_law_with_k1() -> None:
    p = torch.tensor([[0.9, 0.1]])
    topk = select_topk(p, TopKPolicy(k=1))
    assert topk.ids.tolist() == [0]
    assert topk.residual_mass().tolist() == pytest.approx([0.1])
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


@pytest.mark.parametrize("method", RECONSTRUCTIONS)
def test_a_position_with_no_mass_reconstructs_uniform(method: str) -> None:
    """A peer may send K = |V| probabilities of 0 (its ε of 1 allows it): no information, so uniform; residual
    divided by a total of 0 and gave NaN."""
    topk = TopK(
        vocab_size=4,
        counts=torch.tensor([4, 1]),
        ids=torch.tensor([0, 1, 2, 3, 2]),
        probs=torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0]),
    )
    r = reconstruct(topk, method)  # type: ignore[arg-type]
    assert r[0].tolist() == [0.25] * 4
    assert r[1].tolist() == [0.0, 0.0, 1.0, 0.0]


def test_k_equal_to_vocab_is_lossless() -> None:
    p = torch.softmax(torch.randn(3, 50), -1)
    for method in RECONSTRUCTIONS:
        r = reconstruct(select_topk(p, TopKPolicy(k=50)), method)
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


def test_round_budget_takes_the_globally_largest_probabilities() -> None:
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.9, 0.04, 0.03, 0.03]])
    # mean residual <= 0.2 -> kept mass >= 1.6: each row's top (1.4), then 0.3 (row 0) reaches 1.7
    assert round_budget_k(p, 0.2, 4).tolist() == [2, 1]
    # <= 0.06: 1.88 needed: 1.4 + 0.3 + 0.2 = 1.9 -> row 0 takes 3, row 1 still 1
    assert round_budget_k(p, 0.06, 4).tolist() == [3, 1]
    exact = torch.tensor([[0.5, 0.25, 0.25, 0.0], [0.5, 0.25, 0.125, 0.125]], dtype=torch.float64)
    assert round_budget_k(exact, 0.0, 4).tolist() == [3, 4]  # ε = 0 keeps every non-zero token, no zero one
    assert round_budget_k(p, 0.9, 4).tolist() == [1, 1]  # the top token is always kept
    assert round_budget_k(p, 0.0, 2).tolist() == [2, 2]  # capped at max_k
    topk = select_topk(p, TopKPolicy(target_epsilon=0.2, scope="round"))
    assert topk.counts.tolist() == [2, 1]
    assert topk.ids.tolist() == [0, 1, 0]
    with pytest.raises(ConfigError):
        TopKPolicy(target_epsilon=0.2, scope="everywhere")  # type: ignore[arg-type]


def test_bound_report_flags_violations() -> None:
    p = torch.tensor([[0.9, 0.1]])
    topk = select_topk(p, TopKPolicy(k=1))
    report = bound_report([p], [topk], [1.0], "renorm", draft=torch.tensor([[0.5, 0.5]]))
    assert report.violations() == []
    assert float(report.delta[0]) == pytest.approx(0.2)
    assert float(report.bound[0]) == pytest.approx(0.2)
    # a worker that sends the wrong token and claims ε = 0 is caught by the audit
    lying = TopK(2, torch.tensor([1]), torch.tensor([1]), torch.tensor([0.9]), epsilon=torch.tensor([0.0]))
    bad = bound_report([p], [lying], [1.0], "renorm")
    assert [v for v in bad.violations() if "reported ε" in v]
    assert float(bad.per_worker_epsilon[0, 0]) == pytest.approx(1.7)


def test_a_nan_law_violates_the_bounds() -> None:
    """Every check compared with ``>``, false for NaN: a NaN law gave Δ NaN and no violation."""
    p = torch.tensor([[0.9, 0.1]])
    topk = select_topk(p, TopKPolicy(k=1))
    nan = torch.full_like(p, float("nan"))
    report = bound_report([nan], [topk], [1.0], "renorm", draft=torch.tensor([[0.5, 0.5]]))
    assert report.delta.isnan().all()
    violations = report.violations()
    assert [v for v in violations if "‖p_i − p̂_i‖₁" in v]
    assert [v for v in violations if "Δ =" in v]
    assert [v for v in violations if "|α − α̂|" in v]


def test_distribution_error_names_what_is_not_a_law() -> None:
    good = torch.tensor([[0.25, 0.75], [1.0, 0.0]])
    assert distribution_error(good, 1e-3) is None
    assert "not finite" in str(distribution_error(torch.tensor([[float("nan"), 1.0]]), 1e-3))
    assert "not finite" in str(distribution_error(torch.tensor([[float("inf"), 0.0]]), 1e-3))
    assert "negative" in str(distribution_error(torch.tensor([[-0.5, 1.5]]), 1e-3))
    assert "sum" in str(distribution_error(torch.tensor([[0.5, 0.4]]), 1e-3))
