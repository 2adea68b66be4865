"""The benchmark scripts run at a toy size by ``test_script_smoke.py`` and ``test_script_smoke_more.py``: their
arguments, and the run and checks each gets. Two files, half the scripts each (alternate names), so that the
suite's two workers (``--dist loadfile``: a file per worker) share them."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

from tests.bench.scripts import run_script

# script -> its toy-size arguments (each writes <name>.json and <name>.md under --out, or REPORTS[name]'s)
# fmt: off
SCRIPTS: dict[str, list[str]] = {
    "abuse": ["--hostile", "2", "--hog", "2", "--repeats", "1", "--tokens", "4", "--handshake-timeout", "1",
              "--settle-s", "0.25", "--close-slack-s", "5"],
    "auto_floor": ["--repeats", "1", "--rtt-ms", "20", "--answers", "16", "--long-tokens", "300"],
    "batched_attention": ["--baseline", "HEAD", "--repeats", "1", "--calls", "2", "--contexts", "16"],
    "controller_cost": ["--repeats", "1", "--calls", "20"],
    "cpu_dtype": ["--rounds", "1", "--repeats", "1"],
    "draft_cost": ["--repeats", "1", "--calls", "2", "--contexts", "96", "300"],
    "draft_lockstep": ["--repeats", "1", "--steps", "3"],
    "draft_under_load": ["--repeats", "1", "--streams", "2", "--seconds", "2", "--warm-s", "1", "--rtt-ms", "5",
                         "--max-tokens", "16"],
    "draft_window": ["--tokens", "1100", "--docs", "1", "--repeats", "1", "--steps", "3"],
    "eagle_matrix": ["--repeats", "1", "--rtts", "5", "--temperatures", "0", "--modes", "off,ngram",
                     "--answer-tokens", "16"],
    "echo_logprobs_bench": ["--repeats", "1", "--tokens", "100", "--rtt-ms", "5"],
    "head_window": ["--windows", "16", "--answer", "8"],
    "privacy_transforms": ["--windows", "4"],
    "quant_load": ["--repeats", "1", "--layers", "5", "--hidden", "256"],
    "serve_bench": ["--repeats", "1", "--max-tokens", "4", "--rtt-ms", "5", "--bandwidth-mbit", "0"],
    "sampling_fields_bench": ["--repeats", "1", "--max-tokens", "6", "--rtt-ms", "5"],
    "sibling_proposals": ["--tokens", "20", "--draws", "1"],
    "specfed_eval": ["--docs", "1", "--windows", "1", "--length", "8", "--domains", "prose"],
    "specfed_wan": ["--prompts", "1", "--new-tokens", "4", "--rtt-ms", "5"],
    "split_overhead": ["--repeats", "1", "--new-tokens", "4", "--trips", "5"],
    "structured_bench": ["--repeats", "1", "--max-tokens", "8", "--rtt-ms", "5"],
    "tail_logits": ["--repeats", "1", "--calls", "2"],
}
# fmt: on
REPORTS = {"privacy_transforms": "transforms", "sampling_fields_bench": "sampling_fields"}
# exit 1 says a target gate failed: quant_load's weight-memory gates hold for its 16-layer default, not for a
# 1-layer trunk whose fixed costs dominate
RETURNCODES = {"quant_load": (0, 1)}


def halves() -> tuple[list[str], list[str]]:
    """The scripts in two halves of about equal run time: alternate names of the sorted list."""
    names = sorted(SCRIPTS)
    return names[::2], names[1::2]


def run_at_toy_size(name: str, tmp_path: Path) -> None:
    """``benchmarks/<name>.py`` at its toy size must exit as expected and write its report, naming its commit, and a
    reproduce command that a shell splits back into the arguments it ran with (the output folder's name has a space)."""
    out = tmp_path / "toy run"
    args = [*SCRIPTS[name], "--out", str(out)]
    run_script(f"{name}.py", args, timeout=300, returncodes=RETURNCODES.get(name, (0,)))
    stem = REPORTS.get(name, name)
    report = json.loads((out / f"{stem}.json").read_text())
    commit = report["commit"] if "commit" in report else report["environment"]["commit"]
    assert re.match(r"[0-9a-f]{40}", commit), commit  # the measurement names its code (+dirty in a work tree)
    command = report.get("command", report.get("environment", {}).get("command"))
    if command is not None:  # a command naming --out is the arguments it ran with; others list the settings alone
        words = shlex.split(command)
        assert words[:2] == ["python", f"benchmarks/{name}.py"]
        assert "--out" not in words or words[2:] == args
    assert (out / f"{stem}.md").read_text().strip()
