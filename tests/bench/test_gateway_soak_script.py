"""benchmarks/gateway_soak.py, short: 60 s of 8 streams through ``splitspec serve`` while the trunk
server is SIGKILLed and restarted once. Every request completes with the fault-free text or gets a
typed 503/429, none hangs, and the gateway's memory and descriptors stay flat (the script's own
verdict, exit status 0)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.bench.scripts import run_script


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_short_soak_with_one_trunk_kill(tmp_path: Path) -> None:
    args = ["--seconds", "60", "--kills", "1", "--cuts", "0", "--streams", "8", "--out", str(tmp_path)]
    run_script("gateway_soak.py", args)
    results = json.loads((tmp_path / "gateway_soak.json").read_text())
    counts = results["verdict"]["counts"]
    assert counts.get("ok", 0) >= 8  # the load really ran, through the kill
    assert set(counts) <= {"ok", "typed-503", "typed-429"}
    assert "trunk SIGKILLed" in (tmp_path / "gateway_soak.log").read_text()
    assert "trunk restarted" in (tmp_path / "gateway_soak.log").read_text()
