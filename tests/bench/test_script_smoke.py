"""The benchmark scripts that have no test of their own run end to end at a toy size.

A benchmark runs rarely, so what breaks it goes unseen until a session needs its figures: mypy (``make types``)
catches a renamed or retyped function, not a dictionary key that moved (``netem_accuracy.py`` read
``run_environment()['timestamp_utc']`` long after it became ``started_utc``), a model called as another library's
(``specfed_eval.py`` called splitspec's ``FullModel`` as a transformers model) or a check that a machine's
defaults defeat (``echo_logprobs_bench.py``'s 1e-4 agreement failed where ``--dtype auto`` computes the demo
models in float16). Each script here runs in its own interpreter at the smallest size it accepts, a few seconds,
and must exit 0 and write its report with the commit it measured.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.bench.scripts import run_script

pytestmark = pytest.mark.slow  # each test runs a script in a subprocess

# script -> its toy-size arguments (each writes <name>.json and <name>.md under --out, or REPORTS[name]'s)
SCRIPTS: dict[str, list[str]] = {
    "controller_cost": ["--repeats", "1", "--calls", "20"],
    "cpu_dtype": ["--rounds", "1", "--repeats", "1"],
    "draft_cost": ["--repeats", "1"],
    "draft_lockstep": ["--repeats", "1", "--steps", "3"],
    "draft_window": ["--tokens", "1100", "--docs", "1", "--repeats", "1", "--steps", "3"],
    "echo_logprobs_bench": ["--repeats", "1", "--tokens", "100", "--rtt-ms", "5"],
    "head_window": ["--windows", "16", "--answer", "8"],
    "privacy_transforms": ["--windows", "4"],
    "sibling_proposals": ["--tokens", "20", "--draws", "1"],
    "specfed_eval": ["--docs", "1", "--windows", "1", "--length", "32", "--domains", "prose"],
    "specfed_wan": ["--prompts", "1", "--new-tokens", "4", "--rtt-ms", "5"],
    "tail_logits": ["--repeats", "1", "--calls", "2"],
}
REPORTS = {"privacy_transforms": "transforms"}


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_a_benchmark_runs_at_a_toy_size_and_writes_its_report(name: str, tmp_path: Path) -> None:
    run_script(f"{name}.py", [*SCRIPTS[name], "--out", str(tmp_path)], timeout=300)
    stem = REPORTS.get(name, name)
    report = json.loads((tmp_path / f"{stem}.json").read_text())
    commit = report["commit"] if "commit" in report else report["environment"]["commit"]
    assert re.match(r"[0-9a-f]{40}", commit), commit  # the measurement names its code (+dirty in a work tree)
    assert (tmp_path / f"{stem}.md").read_text().strip()


def test_the_emulator_accuracy_check_runs_and_writes_its_report(tmp_path: Path) -> None:
    out = tmp_path / "netem_accuracy"  # the script's --out is a path without its suffix
    args = ["--pings", "5", "--rtt-ms", "5", "--bytes", "100000", "--out", str(out)]
    run_script("netem_accuracy.py", args, timeout=300)
    report = json.loads(out.with_suffix(".json").read_text())
    assert [row["setting_ms"] for row in report["rtt"]] == [5.0]
    assert "WAN emulator accuracy" in out.with_suffix(".md").read_text()
