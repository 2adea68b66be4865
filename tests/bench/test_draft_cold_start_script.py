"""benchmarks/draft_cold_start.py, short: on a CPU (no cold start) the draft model drafts in every answer, and the
run writes its report (the GPU check reads it: 0-1 proposals per answer there before the warm-up at load)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.bench.scripts import load_script, run_script


def test_a_short_run_drafts_in_every_answer_and_writes_its_report(tmp_path: Path) -> None:
    # 150 ms, not the script's 40: on a busy machine (CI runs two test workers) one stalled step once took 190 ms,
    # and at 40 ms the controller then priced a 3-token step at 3.3x a one-token one and stopped drafting for the
    # rest of the answer, as a GPU's cold start made it do; a longer round trip keeps drafting worth it past a stall
    # (since b71e135 the controller also measures such a step again after 4 one-token steps: the margin stays).
    # One torch thread: with the CPU's two, beside another busy worker, proposals stalled for up to 4 s and answers
    # took 4-20 s; on one they take 6-25 ms and an answer about 1.8 s
    args = ["--device", "cpu", "--clients", "1", "--answers", "2", "--rtt-ms", "150", "--threads", "1"]
    args += ["--out", str(tmp_path)]
    run_script("draft_cold_start.py", args, timeout=240)
    rows = json.loads((tmp_path / "draft_cold_start.json").read_text())["rows"]
    assert [(r["client"], r["answer"], r["tokens"]) for r in rows] == [(0, 0, 16), (0, 1, 16)]
    assert all(r["proposals"] >= 3 and len(r["proposal_ms"]) == r["proposals"] for r in rows), rows
    assert all(r["decode_steps"] < 16 for r in rows)  # drafts were accepted: fewer steps than tokens
    for r in rows:  # every decode step's compute, split into one-token and longer (speculative) steps
        assert len(r["one_token_step_compute_ms"]) + len(r["longer_step_compute_ms"]) == r["decode_steps"]
        assert r["longer_step_compute_ms"]
        assert min(r["longer_step_compute_ms"]) > 0
    assert (tmp_path / "draft_cold_start.md").read_text().startswith("# Draft model after a cold start")


def test_the_beside_report_pairs_each_repeat_and_each_answer() -> None:
    script = load_script("draft_cold_start.py", "draft_cold_start_for_test")
    rows = [{"client": 0, "answer": a, "proposals": p, "wall_ms": ms, "tokens": 16} for a, p, ms in ((0, 4, 800.0),
            (1, 7, 500.0))]  # fmt: skip
    this = script.flat(rows)
    assert this == {"0|0|proposals": 4.0, "0|0|wall_ms": 800.0, "0|0|tokens": 16.0, "0|1|proposals": 7.0,
                    "0|1|wall_ms": 500.0, "0|1|tokens": 16.0}  # fmt: skip
    before = {**this, "0|1|proposals": 1.0, "0|1|wall_ms": 800.0}
    results = {"commit": "abcdef0123", "baseline": "REF", "command": "python benchmarks/draft_cold_start.py",
               "runs": {"this": [this, this], "before": [before, before]}}  # fmt: skip
    report = script.beside_markdown(results)
    assert "this / REF: **1.23**" in report  # 32 tokens in 1.3 s against 1.6 s
    assert "| 0 | 1 | 7 | 1 | 500 | 800 | 0.62 |" in report
