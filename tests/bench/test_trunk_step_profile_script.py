"""benchmarks/trunk_step_profile.py, short, on a CPU: both sides' steps are profiled and counted per step, and the
counts say the two do about the same work (the H200 run found 514 vs 522 kernel launches per step).

One torch thread: with the CPU's two, on a machine another test worker keeps busy, the run took 5-20 s instead of 2
(threads waiting at each other's barriers); the op counts do not depend on it."""

from __future__ import annotations

import json
from pathlib import Path

from tests.bench.scripts import run_script


def test_a_short_cpu_run_counts_each_sides_ops_per_step(tmp_path: Path) -> None:
    args = ["--device", "cpu", "--dtype", "float32", "--shape", "tiny", "--steps", "3", "--threads", "1"]
    args += ["--out", str(tmp_path)]
    run_script("trunk_step_profile.py", args, timeout=240)
    sides = json.loads((tmp_path / "summary.json").read_text())["sides"]
    assert set(sides) == {"ours", "transformers"}
    ours, theirs = (sides[s]["aten_ops_top_level_per_step"] for s in ("ours", "transformers"))
    assert ours > 0
    assert theirs > 0
    assert 0.8 < ours / theirs < 1.25, (ours, theirs)  # the same layers' work: within a quarter
    assert all(sides[s]["kernel_launches_per_step"] == 0 for s in sides)  # a CPU launches no kernels
    assert all(sides[s]["wall_ms_median"] > 0 for s in sides)
    for side in sides:
        assert "aten::mm" in (tmp_path / f"{side}_ops.txt").read_text()
    assert (tmp_path / "summary.md").read_text().startswith("# Trunk step profile")
