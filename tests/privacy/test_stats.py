"""Statistics of the privacy audit checked against known values."""

from __future__ import annotations

import numpy as np
import pytest

from splitspec.privacy.audit import holm
from splitspec.privacy.outcomes import pack_hits, unpack_hits
from splitspec.privacy.stats import (
    cluster_bootstrap_diff,
    mcnemar_exact,
    mcnemar_exact_table,
    mcnemar_table,
    paired_difference,
    wilson_interval,
)


def test_wilson_known_value() -> None:
    lo, hi = wilson_interval(8, 10)
    assert (round(lo, 3), round(hi, 3)) == (0.490, 0.943)


def test_wilson_edges() -> None:
    lo, hi = wilson_interval(0, 10)
    assert lo == 0.0
    assert hi == pytest.approx(0.2775, abs=1e-4)
    lo, hi = wilson_interval(10, 10)
    assert hi == 1.0
    assert lo == pytest.approx(0.7225, abs=1e-4)
    assert wilson_interval(0, 0) == (0.0, 1.0)
    with pytest.raises(ValueError, match="successes <= n"):
        wilson_interval(11, 10)


def test_exact_mcnemar_known_tables() -> None:
    # b = 6, c = 16: p = 2 * P(Binom(22, 1/2) <= 6) = 0.0524787...
    r = mcnemar_exact_table(np.array([[59, 6], [16, 80]]))
    assert (r.only_a, r.only_b, r.discordant) == (6, 16, 22)
    assert r.p_value == pytest.approx(0.052478790283203125, rel=1e-12)
    assert mcnemar_exact_table(np.array([[5, 0], [9, 5]])).p_value == pytest.approx(2 * 0.5**9)
    assert mcnemar_exact_table(np.array([[10, 3], [3, 10]])).p_value == 1.0
    assert mcnemar_exact_table(np.array([[7, 0], [0, 3]])).p_value == 1.0  # no discordant pairs


def test_exact_mcnemar_matches_statsmodels() -> None:
    sm = pytest.importorskip("statsmodels.stats.contingency_tables")
    rng = np.random.default_rng(0)
    for _ in range(20):
        a = rng.random(200) < 0.4
        b = rng.random(200) < rng.uniform(0.2, 0.6)
        table = mcnemar_table(a, b)
        assert mcnemar_exact(a, b).p_value == pytest.approx(sm.mcnemar(table, exact=True).pvalue, rel=1e-9)


def test_mcnemar_table_counts_pairs() -> None:
    a = np.array([1, 1, 0, 0, 1], dtype=bool)
    b = np.array([1, 0, 1, 0, 0], dtype=bool)
    assert mcnemar_table(a, b).tolist() == [[1, 2], [1, 1]]
    with pytest.raises(ValueError, match="same shape"):
        mcnemar_table(a, b[:3])


def test_cluster_bootstrap() -> None:
    rng = np.random.default_rng(1)
    clusters = np.repeat(np.arange(20), 50)
    a = rng.random(1000) < 0.6
    ci = cluster_bootstrap_diff(a, a, clusters)
    assert (ci.diff, ci.low, ci.high, ci.clusters) == (0.0, 0.0, 0.0, 20)
    b = a.copy()
    b[:500] = False  # a beats b on the first 10 documents only
    ci = cluster_bootstrap_diff(a, b, clusters, resamples=1000, seed=3)
    assert ci.diff == pytest.approx(a.mean() - b.mean())
    assert 0.0 < ci.low < ci.diff < ci.high
    # Clustering widens the interval compared with resampling tokens independently.
    token_ci = cluster_bootstrap_diff(a, b, np.arange(1000), resamples=1000, seed=3)
    assert ci.high - ci.low > token_ci.high - token_ci.low


def test_holm() -> None:
    assert holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert holm([0.5]) == [0.5]


def test_packed_hits_round_trip() -> None:
    hits = np.random.default_rng(0).random((3, 7)) < 0.4  # 21 tokens: not a whole number of bytes
    text = pack_hits(hits)
    np.testing.assert_array_equal(unpack_hits(text, 21), hits.ravel())
    with pytest.raises(ValueError, match="21 tokens"):
        unpack_hits(pack_hits(hits[:, :2]), 21)  # 6 tokens' bytes read as 21


def test_paired_difference_pools_runs() -> None:
    clusters = np.repeat(np.arange(5), 20)  # 5 documents of 20 tokens, the same indices in both runs
    a1 = np.ones(100, dtype=bool)
    b1 = np.arange(100) % 4 == 0  # B recovers 25 %
    a2 = np.arange(100) % 2 == 0
    b2 = np.arange(100) % 2 == 0  # run 2: no difference
    res = paired_difference([a1, a2], [b1, b2], [clusters, clusters], resamples=500)
    assert res.diff == pytest.approx((100 + 50 - 25 - 50) / 200)
    assert (res.only_a, res.only_b, res.n, res.runs) == (75, 0, 200, 2)
    assert res.clusters == 10  # a document of run 1 and one of run 2 are different clusters
    assert 0 < res.low <= res.diff <= res.high < 1
    assert res.mcnemar_p == pytest.approx(mcnemar_exact_table(np.array([[75, 75], [0, 50]])).p_value)
    assert res.mcnemar_p < 1e-10
    same = paired_difference([a2], [a2], [clusters], resamples=100)
    assert (same.diff, same.low, same.high, same.mcnemar_p) == (0.0, 0.0, 0.0, 1.0)
    with pytest.raises(ValueError, match="same number"):
        paired_difference([a1], [b1, b2], [clusters])
