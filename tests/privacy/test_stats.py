"""Statistics of the privacy audit checked against known values."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from scipy import stats as sps

from splitspec.privacy.audit import AuditConfig
from splitspec.privacy.audit_stats import analyse, holm
from splitspec.privacy.corpus import Windows
from splitspec.privacy.outcomes import AuditData, SeriesKey, pack_hits, unpack_hits
from splitspec.privacy.stats import (
    cluster_bootstrap_diff,
    cluster_sign_flip_p,
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
    # The same five documents in both runs, named as such: five clusters, each resampled with both its runs.
    named = np.array([f"doc{i}" for i in clusters])
    pooled = paired_difference([a1, a2], [b1, b2], [named, named], resamples=500, same_across_runs=True)
    assert (pooled.diff, pooled.clusters) == (res.diff, 5)
    # Two identical runs over the same documents are no more evidence than one: the interval does not narrow.
    a, b, docs = doc_outcomes(DOC_DIFFS)
    names = np.array([f"doc{i}" for i in docs])
    one_run = paired_difference([a], [b], [names], resamples=500, seed=4)
    twice = paired_difference([a, a], [b, b], [names, names], resamples=500, seed=4, same_across_runs=True)
    assert one_run.low < one_run.high
    assert (twice.low, twice.high) == pytest.approx((one_run.low, one_run.high))
    apart = paired_difference([a, a], [b, b], [names, names], resamples=500, seed=4)  # each run its own clusters
    assert apart.clusters == 2 * len(DOC_DIFFS)
    assert apart.high - apart.low < 0.8 * (one_run.high - one_run.low)  # what pooling as independent overstated
    same = paired_difference([a2], [a2], [clusters], resamples=100)
    assert (same.diff, same.low, same.high, same.mcnemar_p) == (0.0, 0.0, 0.0, 1.0)
    with pytest.raises(ValueError, match="same number"):
        paired_difference([a1], [b1, b2], [clusters])


# Per-document differences in hits of the shipped audit's stock nn-embed input test, depth 1 against 2: 13 test
# documents, one of which goes strongly the other way. Tokens as independent units call it p ~ 1e-11.
DOC_DIFFS = [8, 20, 7, 4, 6, 4, 0, 0, 16, 25, 3, 10, -26]
DOC_TOKENS = 64


def doc_outcomes(diffs: list[int], tokens: int = DOC_TOKENS) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(a, b, clusters) over len(diffs) documents of ``tokens`` tokens: a - b hits per document = diffs[i]."""
    a = np.zeros((len(diffs), tokens), dtype=bool)
    b = np.zeros_like(a)
    for i, d in enumerate(diffs):
        a[i, : 20 + max(d, 0)] = True
        b[i, : 20 + max(-d, 0)] = True
    clusters = np.repeat(np.arange(len(diffs)), tokens)
    return a.ravel(), b.ravel(), clusters


def scipy_sign_flip_p(d: np.ndarray) -> float:
    def total(x: np.ndarray, axis: int) -> np.ndarray:
        return np.asarray(np.sum(x, axis=axis))

    res = sps.permutation_test((d,), total, permutation_type="samples", vectorized=True, n_resamples=100_000)
    return float(res.pvalue)


def test_sign_flip_counts_documents_not_tokens() -> None:
    a, b, clusters = doc_outcomes(DOC_DIFFS)
    assert mcnemar_exact(a, b).p_value < 1e-9  # the token-level test calls it certain
    p = cluster_sign_flip_p(a, b, clusters)
    assert p == pytest.approx(scipy_sign_flip_p(np.array(DOC_DIFFS, dtype=float)), rel=1e-12)  # exact: 2^13 flips
    assert 0.1 < p < 0.12
    # More documents than the exact enumeration covers: random flips, close to the exact value.
    many = DOC_DIFFS * 2
    a2, b2, c2 = doc_outcomes(many)
    p2 = cluster_sign_flip_p(a2, b2, c2, resamples=20_000, seed=1)
    assert p2 == pytest.approx(scipy_sign_flip_p(np.array(many, dtype=float)), abs=0.01)
    assert p2 < p  # the same pattern over twice the documents is stronger evidence
    # No difference at all, and one document: nothing to reject.
    assert cluster_sign_flip_p(a, a, clusters) == 1.0
    one = clusters == 0
    assert cluster_sign_flip_p(a[one], b[one], clusters[one]) == 1.0


def test_one_document_has_no_bootstrap_interval() -> None:
    a, b, clusters = doc_outcomes([12])
    ci = cluster_bootstrap_diff(a, b, clusters)
    assert ci.diff == pytest.approx(12 / DOC_TOKENS)
    assert (ci.clusters, ci.resamples) == (1, 0)
    assert np.isnan(ci.low)
    assert np.isnan(ci.high)


def synthetic_audit(diffs: list[int]) -> AuditData:
    """Two depths of one attacker whose top-1 hits differ per test document by ``diffs``."""
    a, b, _ = doc_outcomes(diffs)
    n = len(diffs)
    windows = Windows(
        np.zeros((n, DOC_TOKENS + 1), dtype=np.int64),
        np.arange(n, dtype=np.int64),
        tuple(f"doc{i}" for i in range(n)),
        np.zeros(n, dtype=np.int64),
    )
    data = AuditData(windows, np.zeros((n, DOC_TOKENS), dtype=np.int64), vocab_size=100)
    data.ranks[SeriesKey("stock", "mlp", "input", 1)] = a.reshape(n, DOC_TOKENS).astype(np.int8)
    data.ranks[SeriesKey("stock", "mlp", "input", 2)] = b.reshape(n, DOC_TOKENS).astype(np.int8)
    data.ranks[SeriesKey("stock", "mlp", "input", 3)] = b.reshape(n, DOC_TOKENS).astype(np.int8)  # as depth 2
    return data


def test_audit_significance_rests_on_documents(tmp_path: Path) -> None:
    config = AuditConfig(model_dir=tmp_path, out_dir=tmp_path, depths=(1, 2, 3), bootstrap=500)
    tests = analyse(synthetic_audit(DOC_DIFFS), config)["tests"]
    key = [(t["family"], t["metric"], t["a"].split("|")[3], t["b"].split("|")[3]) for t in tests]
    assert key == [
        ("adjacent depths", "top1", "1", "2"),
        ("adjacent depths", "top5", "1", "2"),
        ("adjacent depths", "top1", "2", "3"),
        ("adjacent depths", "top5", "2", "3"),
        ("shallowest vs deepest", "top1", "1", "3"),
        ("shallowest vs deepest", "top5", "1", "3"),
    ]
    for t in (tests[0], tests[1], tests[4], tests[5]):
        assert t["p_exact_mcnemar"] < 1e-9
        assert 0.1 < t["p_documents"] < 0.12
        assert t["bootstrap95"][0] < 0 < t["bootstrap95"][1]
        assert t["significant"] is False
    for t in tests[2:4]:
        assert t["p_documents"] == t["p_holm"] == 1.0  # no difference at all
    # Holm within each question: the two adjacent-depth tests of a metric; shallowest vs deepest alone.
    assert tests[0]["p_holm"] == pytest.approx(2 * tests[0]["p_documents"])
    assert tests[4]["p_holm"] == tests[4]["p_documents"]
    # One document: no interval and no evidence, whatever the token counts say.
    one = analyse(synthetic_audit([30]), config)["tests"][0]
    assert one["p_exact_mcnemar"] < 1e-8
    assert (one["bootstrap95"], one["p_documents"], one["significant"]) == (None, 1.0, False)


def test_sign_flip_is_exact_up_to_sixteen_documents() -> None:
    """16 documents: all 2^16 flips are counted (the docs say so), so p equals the exact permutation p."""
    diffs = [*DOC_DIFFS, 5, -3, 9]
    assert len(diffs) == 16
    a, b, clusters = doc_outcomes(diffs)
    exact = scipy_sign_flip_p(np.array(diffs, dtype=float))  # scipy enumerates: 2^16 <= its 100000 resamples
    assert cluster_sign_flip_p(a, b, clusters) == pytest.approx(exact, rel=1e-12)
    assert cluster_sign_flip_p(a, b, clusters, seed=7) == cluster_sign_flip_p(a, b, clusters, seed=0)  # no draws
