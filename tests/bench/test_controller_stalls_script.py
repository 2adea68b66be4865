"""benchmarks/controller_stalls.py, short: the simulated answers recover from a stall and the report is written."""

from __future__ import annotations

import json
from pathlib import Path

from tests.bench.scripts import run_script


def test_a_short_run_writes_its_report_and_drafts_after_a_stall(tmp_path: Path) -> None:
    run_script("controller_stalls.py", ["--seeds", "3", "--out", str(tmp_path)], timeout=240)
    results = json.loads((tmp_path / "controller_stalls.json").read_text())
    this = results["this"]
    assert results["before"] is None  # no baseline asked
    assert len(this) == 4 * 3 * 3 * 4 * 2  # RTTs x answers x alphas x stalls, tok/s and proposals
    for stall in ("step", "draft", "both"):  # a good drafter keeps drafting after a stall on its first proposal
        assert this[f"40|32|0.75|{stall}|proposals"] >= 5
        assert this[f"40|32|0.75|{stall}|tok_s"] > 0.8 * 32 / (32 / this["40|32|0.75|none|tok_s"] + 0.28)
    report = (tmp_path / "controller_stalls.md").read_text()
    assert report.startswith("# One stall and a short answer")
    assert report.count("\n| 40 | 32 | 0.75 |") == 4
    assert (tmp_path / "controller_stalls.png").stat().st_size > 0
