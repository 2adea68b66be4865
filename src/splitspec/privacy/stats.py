"""Statistics for the privacy audit: intervals and paired tests on per-token outcomes.

* :func:`wilson_interval` - Wilson score interval of a binomial proportion (no normal-approx
  collapse at 0 or 1, sane at small n).
* :func:`mcnemar_exact` - exact (binomial) McNemar test on paired 0/1 outcomes: the right test
  when the *same* test tokens are attacked at two split depths.
* :func:`cluster_bootstrap_diff` - percentile CI of a difference of two paired recovery rates,
  resampling whole documents (tokens of one document are not independent).
* :func:`cluster_sign_flip_p` - the paired test with documents as the unit: each document's
  difference keeps or flips its sign (exact over every flip for up to 16 documents). McNemar's
  test counts tokens as independent, so its p-value is descriptive only; this one is the test.
* :func:`paired_difference` - both of the above on outcomes pooled over several runs (seeds), each
  run's documents its own clusters: the paired comparison of two defences.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats as sps

Z95 = 1.959963984540054  # two-sided 95% normal quantile
EXACT_SIGN_FLIP_DOCUMENTS = 16  # up to this many documents the sign-flip p counts every flip (2^16 = 65536)


def wilson_interval(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval for ``successes`` out of ``n`` (returns (0, 1) when n == 0)."""
    if n < 0 or not 0 <= successes <= n:
        raise ValueError(f"need 0 <= successes <= n, got {successes}/{n}")
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    denom = 1.0 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    lo = 0.0 if successes == 0 else max(0.0, float(centre - half))
    hi = 1.0 if successes == n else min(1.0, float(centre + half))
    return lo, hi


@dataclass(frozen=True)
class McNemarResult:
    """Exact McNemar test on a paired 2x2 table."""

    both: int  # tokens recovered under A and under B
    only_a: int  # recovered under A only (discordant)
    only_b: int  # recovered under B only (discordant)
    neither: int  # recovered under neither
    p_value: float  # two-sided exact binomial p on the discordant pairs

    @property
    def discordant(self) -> int:
        return self.only_a + self.only_b


def mcnemar_table(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """2x2 table [[both, only_a], [only_b, neither]] of two paired boolean outcome vectors."""
    a = np.asarray(a, dtype=bool)
    b = np.asarray(b, dtype=bool)
    if a.shape != b.shape:
        raise ValueError(f"paired outcomes must have the same shape, got {a.shape} and {b.shape}")
    return np.array(
        [[int(np.sum(a & b)), int(np.sum(a & ~b))], [int(np.sum(~a & b)), int(np.sum(~a & ~b))]], dtype=np.int64
    )


def mcnemar_exact_table(table: np.ndarray) -> McNemarResult:
    """Exact McNemar test of a 2x2 table [[both, only_a], [only_b, neither]].

    The p-value is the two-sided binomial test of min(b, c) out of b + c at 1/2, clipped to 1
    (the same convention as ``statsmodels.stats.contingency_tables.mcnemar(exact=True)``).
    """
    t = np.asarray(table, dtype=np.int64)
    if t.shape != (2, 2) or (t < 0).any():
        raise ValueError(f"need a non-negative 2x2 table, got {t.tolist()}")
    b, c = int(t[0, 1]), int(t[1, 0])
    n = b + c
    p = 1.0 if n == 0 else min(1.0, 2.0 * float(sps.binom.cdf(min(b, c), n, 0.5)))
    return McNemarResult(int(t[0, 0]), b, c, int(t[1, 1]), p)


def mcnemar_exact(a: np.ndarray, b: np.ndarray) -> McNemarResult:
    """Exact McNemar test of paired boolean outcomes ``a`` and ``b`` (same tokens, two conditions)."""
    return mcnemar_exact_table(mcnemar_table(a, b))


@dataclass(frozen=True)
class BootstrapCI:
    """Document-clustered bootstrap of mean(a) - mean(b)."""

    diff: float  # observed difference of recovery rates (a - b)
    low: float  # 2.5th percentile of the bootstrap distribution (NaN with one cluster: no interval)
    high: float  # 97.5th percentile (NaN with one cluster)
    clusters: int  # documents resampled
    resamples: int  # bootstrap replicates


def cluster_bootstrap_diff(
    a: np.ndarray, b: np.ndarray, clusters: np.ndarray, resamples: int = 2000, seed: int = 0
) -> BootstrapCI:
    """95% percentile CI for mean(a) - mean(b), resampling whole clusters (documents) with replacement.

    One cluster gives no interval (every resample is that cluster): ``low`` and ``high`` are NaN.
    """
    sum_a, sum_b, count = _cluster_sums(a, b, clusters)
    k = sum_a.size
    diff = float((sum_a.sum() - sum_b.sum()) / count.sum())
    if k < 2:
        return BootstrapCI(diff, float("nan"), float("nan"), k, 0)
    rng = np.random.default_rng(seed)
    draws = rng.multinomial(k, np.full(k, 1.0 / k), size=resamples).astype(np.float64)  # (R, k)
    diffs = (draws @ sum_a - draws @ sum_b) / np.maximum(draws @ count, 1.0)
    low, high = np.percentile(diffs, [2.5, 97.5])
    return BootstrapCI(diff, float(low), float(high), k, resamples)


def cluster_sign_flip_p(
    a: np.ndarray, b: np.ndarray, clusters: np.ndarray, resamples: int = 20_000, seed: int = 0
) -> float:
    """Two-sided p that A and B recover equally, with documents (``clusters``) as the independent unit.

    Under the null, swapping the labels A and B within a document changes nothing, so each
    document's difference d_c = hits_a - hits_b is as likely as -d_c. The statistic is the total
    |sum_c d_c|; p is the share of sign flips whose total is at least as large. Every one of the
    2^k flips is counted for up to ``EXACT_SIGN_FLIP_DOCUMENTS`` documents (or when 2^k <= ``resamples``),
    else ``resamples`` random flips ((hits + 1) / (resamples + 1), never 0). One document gives p = 1.
    """
    sum_a, sum_b, _ = _cluster_sums(a, b, clusters)
    d = sum_a - sum_b  # (k,) per-document difference in hits
    k = d.size
    observed = abs(float(d.sum()))
    tolerance = 1e-9 * max(1.0, observed)  # sums of integers in float64: exact, but be safe
    if k <= EXACT_SIGN_FLIP_DOCUMENTS or 2**k <= resamples:
        signs = 1.0 - 2.0 * ((np.arange(2**k)[:, None] >> np.arange(k)) & 1)  # (2^k, k) every flip
        totals = np.abs(signs @ d)
        return float(np.mean(totals >= observed - tolerance))
    rng = np.random.default_rng(seed)
    signs = rng.choice(np.array([-1.0, 1.0]), size=(resamples, k))  # (R, k)
    hits = int(np.sum(np.abs(signs @ d) >= observed - tolerance))
    return (hits + 1) / (resamples + 1)


def _cluster_sums(a: np.ndarray, b: np.ndarray, clusters: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-cluster sums of ``a`` and ``b`` and token counts, clusters in sorted order."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    clusters = np.asarray(clusters)
    if not (a.shape == b.shape == clusters.shape):
        raise ValueError("a, b and clusters must have the same shape")
    if a.size == 0:
        raise ValueError("no outcomes to compare")
    _, idx = np.unique(clusters, return_inverse=True)
    idx = idx.ravel()
    k = int(idx.max()) + 1
    sum_a = np.bincount(idx, weights=a.ravel(), minlength=k)
    sum_b = np.bincount(idx, weights=b.ravel(), minlength=k)
    count = np.bincount(idx, minlength=k).astype(np.float64)
    return sum_a, sum_b, count


@dataclass(frozen=True)
class PairedDifference:
    """Paired comparison of two conditions on the same tokens, pooled over runs."""

    diff: float  # recovery rate under A minus under B
    low: float  # document-clustered bootstrap 95% interval of diff
    high: float
    mcnemar_p: float  # exact McNemar p on the pooled discordant tokens
    only_a: int  # tokens recovered under A only
    only_b: int  # tokens recovered under B only
    n: int  # paired tokens
    clusters: int  # documents resampled (one per document, or per run and document: ``same_across_runs``)
    runs: int  # runs pooled (e.g. seeds)


def paired_difference(
    a: Sequence[np.ndarray],
    b: Sequence[np.ndarray],
    clusters: Sequence[np.ndarray],
    resamples: int = 2000,
    seed: int = 0,
    same_across_runs: bool = False,
) -> PairedDifference:
    """Pool paired 0/1 outcomes of conditions A and B over runs (``a[i]``, ``b[i]``, ``clusters[i]`` per run).

    With ``same_across_runs`` the cluster labels name documents across runs: a document tested in several runs
    (seeds) is one cluster, resampled with all its runs, since its outcomes in different runs are not
    independent. Without it (labels local to each run, e.g. indices into each run's own split) a document of
    run i and one of run j are different clusters, which overstates the evidence when the same text recurs.
    """
    if not (len(a) == len(b) == len(clusters)) or not a:
        raise ValueError("need the same number (>= 1) of runs for a, b and clusters")
    pooled_a = np.concatenate([np.asarray(x, dtype=bool).ravel() for x in a])
    pooled_b = np.concatenate([np.asarray(x, dtype=bool).ravel() for x in b])
    if same_across_runs:
        pooled_c = np.unique(np.concatenate([np.asarray(c).ravel() for c in clusters]), return_inverse=True)[1]
    else:
        ids = [np.unique(np.asarray(c), return_inverse=True)[1].ravel() for c in clusters]
        offsets = np.cumsum([0] + [int(i.max()) + 1 for i in ids[:-1]])
        pooled_c = np.concatenate([i + off for i, off in zip(ids, offsets, strict=True)])
    ci = cluster_bootstrap_diff(pooled_a, pooled_b, pooled_c, resamples, seed)
    test = mcnemar_exact(pooled_a, pooled_b)
    return PairedDifference(
        ci.diff, ci.low, ci.high, test.p_value, test.only_a, test.only_b, int(pooled_a.size), ci.clusters, len(a)
    )
