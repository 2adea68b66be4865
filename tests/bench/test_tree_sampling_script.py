"""benchmarks/tree_sampling.py: each shape at its best budget, and a tiny run of the head's shapes writes its report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.bench.scripts import load_script, run_script


def test_each_shape_is_taken_at_its_own_best_budget_per_rtt() -> None:
    script = load_script("tree_sampling.py", "tree_sampling")

    def at(budget: int, chain: float, tree: float) -> dict[str, object]:
        figures = {f"tok_s_at_{r:g}ms": (chain if r < 100 else chain / 2) for r in script.RTTS_MS}
        trees = {f"tok_s_at_{r:g}ms": (tree if r < 100 else tree / 2) for r in script.RTTS_MS}
        return {"budget": budget, "overall": {"chain": figures, "tree": trees}}

    best = script.best([at(4, 40.0, 30.0), at(16, 20.0, 50.0)], ["chain", "tree"])
    row = best["20"]
    assert (row["chain"]["budget"], row["tree"]["budget"]) == (4, 16)  # not the same budget
    assert row["tree/chain"] == pytest.approx(50.0 / 40.0)
    assert best["150"]["tree/chain"] == pytest.approx(25.0 / 20.0)


def test_a_tiny_head_run_writes_its_report(tmp_path: Path) -> None:
    args = ["--drafter", "head", "--budgets", "3", "--tokens", "4", "--repeats", "1", "--out", str(tmp_path)]
    run_script("tree_sampling.py", args)
    result = json.loads((tmp_path / "tree_sampling.json").read_text())
    assert set(result["settings"]["shapes"]) == {"chain", "tree", "tree-2"}
    assert result["results"][0]["budget"] == 3
    assert set(result["best"]["80"]) >= {"chain", "tree", "tree/chain", "tree-2/chain"}
    assert "best tree / best chain" in (tmp_path / "tree_sampling.md").read_text()
