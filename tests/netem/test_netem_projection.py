"""Projection model: refits of the paper's published tables, the step-time fit, break-even and
cost arithmetic on hand-computed values."""

from __future__ import annotations

import numpy as np
import pytest

from splitspec.netem.projection import (
    break_even_acceptance,
    cost_per_million_tokens,
    fit_projection,
    fit_step_time,
    overhead_from_throughput,
    projected_tok_s,
    speculation_speedup,
)

# arXiv 2602.16760 Section 6.3, "Projected throughput at target RTTs".
RTT = [20.0, 40.0, 60.0, 80.0, 100.0, 120.0, 150.0]
SEQ_7B = [15.9, 12.1, 9.7, 8.1, 7.0, 6.1, 5.2]
LA_7B = [18.6, 13.6, 10.7, 8.8, 7.5, 6.5, 5.4]
SEQ_12B = [15.1, 11.6, 9.4, 7.9, 6.8, 6.0, 5.1]
LA_12B = [15.2, 11.6, 9.4, 8.0, 6.9, 6.1, 5.2]


@pytest.mark.parametrize(
    ("column", "f_ms", "acceptance"),
    [
        (SEQ_7B, 43.0, 1.000),
        (LA_7B, 32.8, 0.991),
        (SEQ_12B, 46.3, 0.998),
        (LA_12B, 48.6, 1.029),
    ],
    ids=["7B-seq", "7B-lookahead", "12B-seq", "12B-lookahead"],
)
def test_refit_published_columns(column: list[float], f_ms: float, acceptance: float) -> None:
    fit = fit_projection(RTT, column)
    assert fit.overhead_ms == pytest.approx(f_ms, abs=0.1)  # well inside the ±0.5 ms brief
    assert fit.acceptance == pytest.approx(acceptance, abs=0.005)
    assert fit.r_squared > 0.999
    assert fit.rmse_tok_s < 0.1  # the table is rounded to 0.1 tok/s
    assert fit.max_abs_error_tok_s < 0.25  # 12B lookahead: 0.20 at 20 ms
    assert fit.n_points == 7
    # The fit reproduces the column it came from.
    for rtt, tps in zip(RTT, column, strict=True):
        assert fit.tok_s(rtt) == pytest.approx(tps, abs=0.25)


def test_refit_lookahead_anomaly() -> None:
    """The 7B lookahead column implies *less* overhead than sequential; the 12B one more."""
    assert fit_projection(RTT, LA_7B).overhead_ms < fit_projection(RTT, SEQ_7B).overhead_ms - 9.0
    assert fit_projection(RTT, LA_12B).overhead_ms > fit_projection(RTT, SEQ_12B).overhead_ms


def test_fit_exact_synthetic_data() -> None:
    rtt = np.array([5.0, 30.0, 90.0, 200.0])
    tps = 1000.0 * 1.3 / (rtt + 55.0)
    fit = fit_projection(rtt, tps)
    assert fit.overhead_ms == pytest.approx(55.0, rel=1e-9)
    assert fit.acceptance == pytest.approx(1.3, rel=1e-9)
    assert fit.r_squared == pytest.approx(1.0)
    assert fit.step_ms(100.0) == pytest.approx(155.0)


@pytest.mark.parametrize(
    ("rtt", "tps"),
    [([80.0], [8.0]), ([80.0, 80.0], [8.0, 8.1]), ([20.0, 40.0], [8.0]), ([20.0, 40.0], [0.0, 1.0])],
)
def test_fit_rejects_degenerate_input(rtt: list[float], tps: list[float]) -> None:
    with pytest.raises(ValueError, match=r"distinct RTT|differ in length|must be > 0"):
        fit_projection(rtt, tps)


def test_projection_and_inversion_hand_values() -> None:
    assert projected_tok_s(80.0, 45.0) == pytest.approx(8.0)  # 1000 / 125
    assert projected_tok_s(80.0, 45.0, 1.25) == pytest.approx(10.0)
    assert overhead_from_throughput(80.0, 8.0) == pytest.approx(45.0)
    assert overhead_from_throughput(80.0, 10.0, 1.25) == pytest.approx(45.0)
    with pytest.raises(ValueError, match="RTT \\+ overhead must be > 0"):
        projected_tok_s(-50.0, 10.0)


def test_break_even_hand_values() -> None:
    assert break_even_acceptance(80.0, 60.0, 40.0) == pytest.approx(140.0 / 120.0)
    assert break_even_acceptance(20.0, 60.0, 40.0) == pytest.approx(80.0 / 60.0)
    # a* rises as the link gets faster.
    assert break_even_acceptance(5.0, 60.0, 40.0) > break_even_acceptance(150.0, 60.0, 40.0)
    assert speculation_speedup(80.0, 1.4, 60.0, 40.0) == pytest.approx(1.4 * 120.0 / 140.0)
    assert speculation_speedup(80.0, 140.0 / 120.0, 60.0, 40.0) == pytest.approx(1.0)


def test_break_even_paper_ablation() -> None:
    """Section 6.4 at 78 ms: sequential 8.3 tok/s; n=5 lookahead 8.9 tok/s at 1.23 tokens/step."""
    f_seq = overhead_from_throughput(78.0, 8.3)
    f_n5 = overhead_from_throughput(78.0, 8.9, 1.23)
    assert f_seq == pytest.approx(42.48, abs=0.01)
    assert f_n5 == pytest.approx(60.20, abs=0.01)
    assert break_even_acceptance(78.0, f_n5, f_seq) == pytest.approx(1.147, abs=0.001)


def test_cost_hand_values() -> None:
    assert cost_per_million_tokens(3.6, 1.0) == pytest.approx(1000.0)  # 3600 tokens per $3.60
    assert cost_per_million_tokens(1.35, 8.8) == pytest.approx(42.61, abs=0.01)
    assert cost_per_million_tokens(0.59, 15.0) == pytest.approx(10.93, abs=0.01)
    with pytest.raises(ValueError, match="tok_s must be > 0"):
        cost_per_million_tokens(1.0, 0.0)


def test_step_time_fit_recovers_rtt_and_overhead() -> None:
    rng = np.random.default_rng(7)
    true_rtt, f0, f1 = 80.0, 20.0, 1.5
    pings = true_rtt + rng.normal(0.0, 1.0, 200)
    ks = np.repeat([1, 2, 4, 8, 16], 40)
    steps = true_rtt + f0 + f1 * ks + rng.normal(0.0, 2.0, ks.size)
    steps[::17] += 60.0  # occasional stalls: the medians must shrug them off
    fit = fit_step_time(pings, ks, steps)
    assert fit.rtt_ms == pytest.approx(true_rtt, abs=0.5)
    assert fit.f0_ms == pytest.approx(f0, abs=1.5)
    assert fit.f1_ms_per_token == pytest.approx(f1, abs=0.15)
    assert fit.query_tokens == (1, 2, 4, 8, 16)
    assert fit.n_steps == 200
    assert fit.n_pings == 200
    assert fit.residual_rms_ms < 2.0
    assert fit.overhead_ms(4) == pytest.approx(f0 + 4 * f1, abs=1.5)
    assert fit.overhead_ms(6, interpolate=True) == pytest.approx(f0 + 6 * f1, abs=2.0)
    assert fit.step_ms(8) == pytest.approx(true_rtt + f0 + 8 * f1, abs=2.0)
    assert fit.step_ms(8, rtt_ms=20.0) == pytest.approx(20.0 + f0 + 8 * f1, abs=2.0)
    expected = (true_rtt + f0 + 8 * f1) / (true_rtt + f0 + f1)
    assert fit.break_even(8) == pytest.approx(expected, abs=0.02)


def test_step_time_fit_nonlinear_overhead_interpolates() -> None:
    ks = np.array([1, 4, 16] * 5)
    f = {1: 10.0, 4: 12.0, 16: 40.0}
    steps = np.array([50.0 + f[int(k)] for k in ks])
    fit = fit_step_time([50.0] * 5, ks, steps)
    assert fit.overhead_points_ms == pytest.approx((10.0, 12.0, 40.0))
    assert fit.overhead_ms(4, interpolate=True) == pytest.approx(12.0)
    assert fit.overhead_ms(10, interpolate=True) == pytest.approx(26.0)
    assert fit.residual_rms_ms > 1.0  # the straight line cannot follow the knee


def test_step_time_fit_single_k_and_validation() -> None:
    fit = fit_step_time([30.0, 31.0, 29.0], [1, 1, 1], [75.0, 76.0, 74.0])
    assert fit.rtt_ms == pytest.approx(30.0)
    assert fit.f0_ms == pytest.approx(45.0)
    assert fit.f1_ms_per_token == 0.0
    with pytest.raises(ValueError, match="at least one ping"):
        fit_step_time([], [1], [10.0])
    with pytest.raises(ValueError, match="positive integers"):
        fit_step_time([1.0], [0], [10.0])
    with pytest.raises(ValueError, match="equal length"):
        fit_step_time([1.0], [1, 2], [10.0])
