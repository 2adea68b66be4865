"""A quick benchmark of a tiny checkpoint: report files, keys, rows and token identity."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import splitspec
from splitspec.bench.harness import RUNS_FILE
from splitspec.cli import main as bench_main
from splitspec.run_info import read_jsonl_gz

EXPECTED_SPLIT_KEYS = {
    "mode",
    "rtt_ms",
    "measured_rtt_ms",
    "decode_tok_s",
    "e2e_tok_s",
    "ratio_vs_hf_generate",
    "accepted_per_step",
    "bytes_up_per_step",
    "bytes_down_per_step",
    "step_ms",
    "token_match",
}


def test_quick_bench_writes_report(tmp_path: Path, make_checkpoint: Callable[..., Path]) -> None:
    model = make_checkpoint("llama")
    scenario = tmp_path / "tiny.toml"
    scenario.write_text(
        f'name = "tiny"\nmodel = "{model}"\nrtt_ms = [0, 20]\nrepeats = 2\nmax_new_tokens = 24\n'
        "pings = 3\n[prompts]\nper_set = 2\nprompt_tokens = 12\n"
    )
    out = tmp_path / "out"
    assert bench_main(["bench", str(scenario), "--out", str(out), "--quick", "--no-progress"]) == 0

    summary = json.loads((out / "summary.json").read_text())
    assert summary["scenario"]["name"] == "tiny_quick"
    assert summary["scenario"]["repeats"] == 1
    assert summary["scenario"]["max_new_tokens"] == 16
    assert [p["prompt_id"] for p in summary["prompts"]] == ["code0", "prose0", "structured0"]
    assert set(summary["baselines"]) == {"hf_generate", "hf_prompt_lookup", "local_loop"}
    assert summary["baselines"]["local_loop"]["token_match"] == [3, 3]
    split = summary["split"]
    assert [(g["mode"], g["rtt_ms"]) for g in split] == [("sequential", 0.0), ("sequential", 20.0)]
    for g in split:
        assert set(g) >= EXPECTED_SPLIT_KEYS
        assert g["token_match"] == [3, 3]  # split greedy == transformers generate, every prompt
        assert g["accepted_per_step"] == 1.0
        assert g["decode_tok_s"] > 0
        assert g["bytes_up_per_step"] > 0
        assert g["bytes_down_per_step"] > 0
        assert set(g["step_ms"]) == {"network_ms", "edge_ms", "cloud_ms", "serialize_ms", "step_ms"}
    assert split[1]["measured_rtt_ms"] >= 19.5
    assert split[1]["step_ms"]["network_ms"] >= 19.5
    assert split[0]["decode_tok_s"] > split[1]["decode_tok_s"]
    fit = summary["fits"]["sequential"]
    assert fit["overhead_ms"] > 0
    assert fit["n_points"] == 2
    assert len(summary["split_by_set"]) == 6

    runs = {r["run_id"]: r for r in read_jsonl_gz(out / RUNS_FILE)}
    assert len(runs) == 3 * 3 + 3 * 2  # baselines + split runs
    assert not (out / "runs").exists()  # one file per benchmark, not one per run
    assert {r["commit"] for r in runs.values()} == {summary["environment"]["commit"]}
    assert {r["splitspec"] for r in runs.values()} == {splitspec.__version__}
    run = runs["r0_sequential_rtt20_prose0"]
    assert run["new_tokens"] == 16
    assert len(run["token_ids"]) == 16
    assert [s["kind"] for s in run["steps"]] == ["prefill"] + ["decode"] * 15
    assert run["matches_hf_generate"] is True

    md = (out / "summary.md").read_text()
    assert "| split sequential | 0 |" in md
    assert "| split sequential | 20 |" in md
    assert "hf_generate (local)" in md
    assert "hf_prompt_lookup (local)" in md
    assert "local_loop (local)" in md
    for png in ("tok_s_vs_rtt.png", "step_breakdown.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_scenario_exit_status(tmp_path: Path) -> None:
    scenario = tmp_path / "bad.toml"
    scenario.write_text('name = "bad"\nrtt_ms = "fast"\n')
    assert bench_main(["bench", str(scenario), "--out", str(tmp_path / "o")]) == 2
    assert not (tmp_path / "o").exists()
