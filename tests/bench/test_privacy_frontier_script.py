"""benchmarks/privacy_frontier.py: points measured with a larger attacker-train set get their own section.

The frontier's tables pool seeds at one attacker-train size; a point re-measured with more attacker-train tokens
must neither replace the reference point of its (model, seed, setting) nor mix into the pooled rows, and the
report compares the two sizes on the same test tokens. Tiny hand-made points (32 test tokens in 4 documents)
with known per-token hits make every figure checkable by hand.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from splitspec.privacy.frontier import TIERS
from splitspec.privacy.outcomes import pack_hits
from splitspec.privacy.stats import wilson_interval
from tests.bench.scripts import load_script

N = 32  # test tokens: 4 windows of 8, one document each
DOCS = [0, 1, 2, 3]


@pytest.fixture(scope="module")
def frontier() -> ModuleType:
    return load_script("privacy_frontier.py", "privacy_frontier_script")


def first(k: int) -> np.ndarray:
    """Hits on the first ``k`` test tokens."""
    return np.arange(N) < k


def rates(hits: np.ndarray) -> dict[str, Any]:
    s = int(hits.sum())
    return {"rate": s / N, "wilson95": list(wilson_interval(s, N)), "successes": s, "n": N}


def point(setting: str, seed: int, per_tier: int, hits: dict[str, dict[str, np.ndarray]]) -> dict[str, Any]:
    """A point in the run's format: per side, each attacker's top-1 hits (``t1-…``, ``t2-…``, ``t3-…``)."""
    sides: dict[str, Any] = {}
    for side, by_attacker in hits.items():
        best = {}
        for tier in TIERS:
            allowed = TIERS[: TIERS.index(tier) + 1]
            names = [a for a in by_attacker if a.split("-")[0].upper() in allowed]
            name = max(names, key=lambda a: int(by_attacker[a].sum()))
            best[tier] = {"attacker": name, **rates(by_attacker[name])}
        sides[side] = {
            "attackers": {a: {"top1": rates(h), "top5": rates(h)} for a, h in by_attacker.items()},
            "best": best,
        }
    return {
        "model": "models/tiny",
        "model_name": "tiny",
        "depth": 2,
        "seed": seed,
        "setting": setting,
        "sides": sides,
        "outcomes": {
            "n": N,
            "window_docs": DOCS,
            "sides": {side: {a: pack_hits(h) for a, h in by.items()} for side, by in hits.items()},
        },
        "tokens": {"public": per_tier, "traffic": per_tier, "test": N},
        "frequency_floor": {"top1": {"successes": 1, "n": N}},
        "ppl_stock": 80.0,
        "ppl": 80.0 if setting == "stock" else 85.0,
        "ppl_cost": 0.0 if setting == "stock" else 85.0 / 80.0 - 1.0,
        "commit": "test",
    }


def stock(seed: int, per_tier: int, k_in: int, k_out: int) -> dict[str, Any]:
    return point("stock", seed, per_tier, {"input": {"t1-search": first(k_in)}, "output": {"t1-bigru": first(k_out)}})


def defended(seed: int, per_tier: int, k_in: int, k_out: int, k_t3: int) -> dict[str, Any]:
    return point(
        "adv=0.1",
        seed,
        per_tier,
        {
            "input": {"t1-search": first(k_in), "t2-align": first(k_in - 2), "t3-bigru": first(k_t3)},
            "output": {"t1-bigru": first(k_out), "t2-align": first(k_out), "t3-bigru": first(k_t3)},
        },
    )


@pytest.fixture
def points() -> list[dict[str, Any]]:
    # 24k per tier: seeds 0 and 2 (the reference size: most points); 48k per tier: seed 2 only
    return [
        stock(0, 24_000, 12, 10),
        defended(0, 24_000, 6, 4, 6),
        stock(2, 24_000, 16, 12),
        defended(2, 24_000, 8, 6, 9),
        stock(2, 48_000, 24, 20),
        defended(2, 48_000, 20, 10, 14),
    ]


def write_points(out: Path, points: list[dict[str, Any]]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for tag, size in (("small", 24_000), ("large", 48_000)):
        lines = [json.dumps(p) for p in points if p["tokens"]["public"] == size]
        (out / f"points-tiny-{tag}.jsonl").write_text("\n".join(lines) + "\n")


def test_a_larger_attacker_set_is_another_point(
    frontier: ModuleType, points: list[dict[str, Any]], tmp_path: Path
) -> None:
    write_points(tmp_path, points)
    loaded = frontier.load_points(tmp_path)
    assert len(loaded) == 6  # the 48k points of seed 2 do not replace the 24k ones
    main, larger = frontier.by_train_size(loaded)
    assert {frontier.train_tokens(p) for p in main} == {48_000}
    assert [(p["seed"], p["setting"], frontier.train_tokens(p)) for p in larger] == [
        (2, "adv=0.1", 96_000),
        (2, "stock", 96_000),
    ]
    # a rerun at one size skips only that size's points
    done, stored = frontier.measured(tmp_path, 96_000)
    assert done == stored == {("tiny", 2, "stock"), ("tiny", 2, "adv=0.1")}
    done, _ = frontier.measured(tmp_path, 48_000)
    assert ("tiny", 0, "stock") in done


def test_train_size_rows_pair_the_same_seed_and_setting(frontier: ModuleType, points: list[dict[str, Any]]) -> None:
    rows = {(r["setting"], r["side"], r["tier"]): r for r in frontier.train_size_rows(points)}
    assert len(rows) == 2 * 2 * 3  # stock and adv=0.1 of seed 2, both sides, every tier
    r = rows[("adv=0.1", "input", "T1")]
    assert r["seeds"] == [2]
    assert r["tokens"] == [48_000, 96_000]
    assert [b["rate"] for b in r["best"]] == [8 / N, 20 / N]
    assert [b["attackers"] for b in r["best"]] == [["t1-search"], ["t1-search"]]
    assert r["larger_minus_reference"]["diff"] == pytest.approx(12 / N)
    assert (r["larger_minus_reference"]["only_a"], r["larger_minus_reference"]["only_b"]) == (12, 0)
    # the defence against the stock edge of its own size: -8/32 at 24k, -4/32 at 48k
    assert [m["diff"] for m in r["minus_stock"]] == pytest.approx([-8 / N, -4 / N])
    assert rows[("adv=0.1", "output", "T3")]["larger_minus_reference"]["diff"] == pytest.approx(5 / N)
    stock_row = rows[("stock", "output", "T1")]
    assert stock_row["larger_minus_reference"]["diff"] == pytest.approx(8 / N)
    assert stock_row["minus_stock"] == [None, None]
    # a point without per-token outcomes cannot be paired and is left out
    bare = [{k: v for k, v in p.items() if k != "outcomes"} if p["tokens"]["public"] == 48_000 else p for p in points]
    assert frontier.train_size_rows(bare) == []


def test_report_keeps_sizes_apart(frontier: ModuleType, points: list[dict[str, Any]], tmp_path: Path) -> None:
    write_points(tmp_path, points)
    frontier.write_report(tmp_path, {"commit": "test", "command": "test"})
    report = (tmp_path / "report.md").read_text()
    # the frontier tables pool seeds 0 and 2 at 24k only: stock (12 + 16) / 64 in, (10 + 12) / 64 out
    tables = report.split("### input side", 1)[1].split("### output side")
    assert "| stock | +0.0 % (+0.0, +0.0) | 43.8 [" in tables[0]
    assert "| stock | +0.0 % (+0.0, +0.0) | 34.4 [" in tables[1]
    assert "| **adv=0.1** (default) | stock | 0,2 | input |" in report
    assert "Attacker-train per seed: 24000 public tokens (T1), 24000 traffic tokens" in report
    section = report.split("### Attacker-train size: 24k vs 48k tokens per tier", 1)[1].split("###", 1)[0]
    assert "| adv=0.1 | 2 | input | T1 | 25.0 [" in section
    assert "t1-search | 62.5 [" in section
    assert "| +37.5 [" in section  # 48k - 24k, paired
    assert "| -25.0 [" in section
    assert "| -12.5 [" in section
    assert "| stock | 2 | output | T1-T3 |" in section
    assert "| stock | 2 | input | T2 |" not in section
    summary = json.loads((tmp_path / "frontier.json").read_text())
    assert len(summary["train_size"]) == 12
    assert {tuple(r["seeds"]) for r in summary["rows"]} == {(0, 2)}
    with gzip.open(tmp_path / "runs.jsonl.gz", "rt") as f:
        assert sum(1 for line in f if line.strip()) == 6  # every point kept, both sizes


def test_train_size_rows_pool_the_seeds(frontier: ModuleType, points: list[dict[str, Any]]) -> None:
    # seed 0 at 48k too: 4 points per size, the tie goes to the smaller size as the reference
    both = [*points, stock(0, 48_000, 14, 16), defended(0, 48_000, 12, 8, 7)]
    rows = frontier.train_size_rows(both)
    assert {tuple(r["seeds"]) for r in rows} == {(0,), (2,), (0, 2)}
    pooled = {(r["setting"], r["side"], r["tier"]): r for r in rows if r["seeds"] == [0, 2]}
    r = pooled[("adv=0.1", "input", "T1")]
    assert r["tokens"] == [48_000, 96_000]
    # seed 0: 6 -> 12 hits, seed 2: 8 -> 20, over 64 tokens
    assert [b["rate"] for b in r["best"]] == [14 / 64, 32 / 64]
    assert r["larger_minus_reference"]["diff"] == pytest.approx(18 / 64)
    assert r["larger_minus_reference"]["runs"] == 2
    # minus stock pooled per size: (6 + 8) - (12 + 16) at 24k, (12 + 20) - (14 + 24) at 48k
    assert [m["diff"] for m in r["minus_stock"]] == pytest.approx([-14 / 64, -6 / 64])
    assert pooled[("stock", "output", "T1")]["larger_minus_reference"]["diff"] == pytest.approx((6 + 8) / 64)
    report = frontier.render(both, {})
    assert "| adv=0.1 | 0,2 | input | T1 | 21.9 [" in report
    # the stock rows come first, then each seed before the pooled row
    order = [(r["setting"], tuple(r["seeds"])) for r in rows if r["side"] == "input" and r["tier"] == "T1"]
    assert order == [
        ("stock", (0,)),
        ("stock", (2,)),
        ("stock", (0, 2)),
        ("adv=0.1", (0,)),
        ("adv=0.1", (2,)),
        ("adv=0.1", (0, 2)),
    ]
