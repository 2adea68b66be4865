"""The privacy audit's statistics: per-series rates with Wilson intervals, and the paired tests.

Every test compares two series on the same test tokens: the difference with a document-clustered bootstrap
interval, its document-level sign-flip p (the basis of ``significant``), Holm-corrected within each question
(family and metric), and exact McNemar on tokens beside it as a description. :func:`analyse` is what
:func:`splitspec.privacy.audit.run_audit` and ``audit-retest`` run on the per-token outcomes.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict
from typing import Any, Protocol

import numpy as np

from splitspec.privacy import attackers as atk
from splitspec.privacy.outcomes import AuditData, SeriesKey
from splitspec.privacy.stats import cluster_bootstrap_diff, cluster_sign_flip_p, mcnemar_exact, wilson_interval

ALPHA = 0.05  # family-wise significance level (Holm)


class Resampling(Protocol):
    """What the tests read of an audit's configuration (:class:`splitspec.privacy.audit.AuditConfig` has it)."""

    @property
    def bootstrap(self) -> int:
        """Bootstrap resamples of the documents."""
        ...

    @property
    def seed(self) -> int:
        """The resampling's and the random sign flips' seed."""
        ...


def holm(p_values: list[float]) -> list[float]:
    """Holm step-down adjusted p-values (family-wise error control)."""
    m = len(p_values)
    order = np.argsort(p_values)
    adjusted = np.empty(m)
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p_values[i]))
        adjusted[i] = running
    return [float(a) for a in adjusted]


def analyse(data: AuditData, config: Resampling) -> dict[str, Any]:
    """Rates with Wilson intervals, and paired tests (depths, conditions, baseline)."""
    clusters = np.repeat(data.test.doc_index[:, None], data.targets.shape[1], axis=1).ravel()
    n = int(data.targets.size)
    series: list[dict[str, object]] = []
    for key, r in data.ranks.items():
        row: dict[str, object] = asdict(key)
        for k, hits in (("top1", r == 1), ("top5", r > 0)):
            s = int(hits.sum())
            lo, hi = wilson_interval(s, n)
            row[k] = {"successes": s, "n": n, "rate": s / n, "wilson95": [lo, hi]}
        series.append(row)
    vocab = data.vocab_size
    uniform = {"top1": atk.uniform_rate(vocab, 1), "top5": atk.uniform_rate(vocab, atk.TOPK)}

    tests: list[dict[str, object]] = []
    # Document-level sign-flip p of each test, in order, for Holm's correction. McNemar's exact p
    # (tokens as independent) is kept beside it as a description, not as the test.
    p_values: list[float] = []

    def compare(a: SeriesKey, b: SeriesKey, family: str) -> None:
        if a not in data.ranks or b not in data.ranks:
            return
        for k, fa, fb in (
            ("top1", data.ranks[a] == 1, data.ranks[b] == 1),
            ("top5", data.ranks[a] > 0, data.ranks[b] > 0),
        ):
            m = mcnemar_exact(fa.ravel(), fb.ravel())
            ci = cluster_bootstrap_diff(fa.ravel(), fb.ravel(), clusters, config.bootstrap, config.seed)
            p = cluster_sign_flip_p(fa.ravel(), fb.ravel(), clusters, seed=config.seed)
            tests.append(
                {
                    "family": family,
                    "metric": k,
                    "a": a.column,
                    "b": b.column,
                    "rate_a": float(fa.mean()),
                    "rate_b": float(fb.mean()),
                    "diff": ci.diff,
                    "bootstrap95": None if ci.clusters < 2 else [ci.low, ci.high],
                    "clusters": ci.clusters,
                    "only_a": m.only_a,
                    "only_b": m.only_b,
                    "p_exact_mcnemar": m.p_value,
                    "p_documents": p,
                }
            )
            p_values.append(p)

    keys = list(data.ranks)
    depths = sorted({k.depth for k in keys if k.depth > 0})
    groups = sorted({(k.condition, k.attacker, k.side) for k in keys if k.depth > 0})
    for cond, attacker, side in groups:
        present = [d for d in depths if SeriesKey(cond, attacker, side, d) in data.ranks]
        for d1, d2 in itertools.pairwise(present):
            compare(SeriesKey(cond, attacker, side, d1), SeriesKey(cond, attacker, side, d2), "adjacent depths")
        if len(present) > 2:
            compare(
                SeriesKey(cond, attacker, side, present[0]),
                SeriesKey(cond, attacker, side, present[-1]),
                "shallowest vs deepest",
            )
    for key in keys:
        if key.condition.startswith("diverged"):
            compare(SeriesKey("stock", key.attacker, key.side, key.depth), key, "stock vs diverged")
    base = SeriesKey("-", "freq", "-", 0)
    for key in keys:
        if key.depth > 0:
            compare(key, base, "attacker vs frequency prior")
    # Holm within each question (family and metric): with k test documents the smallest sign-flip p
    # is 2 / 2^k, so one correction over every test of every question could reject nothing at all.
    questions: dict[tuple[object, object], list[int]] = {}
    for i, t in enumerate(tests):
        questions.setdefault((t["family"], t["metric"]), []).append(i)
    for members in questions.values():
        for i, p in zip(members, holm([p_values[i] for i in members]), strict=True):
            tests[i]["p_holm"] = p
            tests[i]["significant"] = p < ALPHA
    return {"n_test_tokens": n, "uniform": uniform, "series": series, "tests": tests, "alpha": ALPHA, **data.extra}
