"""The benchmark scripts that have no test of their own run end to end at a toy size.

A benchmark runs rarely, so what breaks it goes unseen until a session needs its figures: mypy (``make types``)
catches a renamed or retyped function, not a dictionary key that moved (``netem_accuracy.py`` read
``run_environment()['timestamp_utc']`` long after it became ``started_utc``), a model called as another library's
(``specfed_eval.py`` called splitspec's ``FullModel`` as a transformers model) or a check that a machine's
defaults defeat (``echo_logprobs_bench.py``'s 1e-4 agreement failed where ``--dtype auto`` computes the demo
models in float16). Each script here runs in its own interpreter at the smallest size it accepts, a few seconds
to about twenty, and must exit 0 and write its report with the commit it measured (``tests/bench/smoke.py``
lists them; this file runs half of them, ``test_script_smoke_more.py`` the other half). Not here: ``guidellm_run.py``
(it needs guidellm installed apart; ``tests/serve/test_client_fields.py`` sends guidellm's requests) and the
scripts with a test of their own.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.bench.scripts import run_script
from tests.bench.smoke import halves, run_at_toy_size

pytestmark = pytest.mark.slow  # each test runs a script in a subprocess


@pytest.mark.parametrize("name", halves()[0])
def test_a_benchmark_runs_at_a_toy_size_and_writes_its_report(name: str, tmp_path: Path) -> None:
    run_at_toy_size(name, tmp_path)


def test_the_emulator_accuracy_check_runs_and_writes_its_report(tmp_path: Path) -> None:
    out = tmp_path / "netem_accuracy"  # the script's --out is a path without its suffix
    args = ["--pings", "5", "--rtt-ms", "5", "--bytes", "100000", "--out", str(out)]
    run_script("netem_accuracy.py", args, timeout=300)
    report = json.loads(out.with_suffix(".json").read_text())
    assert [row["setting_ms"] for row in report["rtt"]] == [5.0]
    assert "WAN emulator accuracy" in out.with_suffix(".md").read_text()


def test_the_privacy_audit_runs_at_a_toy_size_and_copies_its_report_where_told(tmp_path: Path) -> None:
    out = tmp_path / "privacy"  # not benchmarks/results/privacy/, the script's default
    toy = ["--depths", "1", "--max-tokens", "640", "--max-test-tokens", "192", "--window", "32"]
    toy += ["--epochs", "1", "--seq-epochs", "1", "--diverge-steps", "3"]
    run_script("privacy_audit.py", ["--out", str(out), *toy], timeout=300)
    report = json.loads((out / "report.json").read_text())
    assert report["depths"] == [1]
    assert re.match(r"[0-9a-f]{40}", report["environment"]["commit"])
    assert json.loads((out / "edge_d1.json").read_text())  # the diverged edge's fingerprint and perplexities
    assert {"report.md", "recovery_vs_depth.png", "outcomes.csv.gz"} <= {p.name for p in out.iterdir()}
