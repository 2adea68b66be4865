"""benchmarks/gateway_soak.py, short: 30 s of 4 streams of 16-token requests through ``splitspec serve`` while the
trunk server is SIGKILLed (at 15 s) and restarted once. Every request completes with the fault-free text or gets a
typed 503/429, none hangs, some request completes after the restart, and the gateway's memory and descriptors stay
flat (the script's own verdict, exit status 0).

The trunk's restart (a fresh ``splitspec cloud serve``) took 6-12 s on a busy 2-core machine, which leaves the
gateway some seconds of load after it; the requests in flight when the trunk dies wait for it (about 30 s before a
typed 503), so some complete after the restart even when it comes late."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.bench.scripts import run_script


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_short_soak_with_one_trunk_kill(tmp_path: Path) -> None:
    args = ["--seconds", "30", "--kills", "1", "--cuts", "0", "--streams", "4", "--max-tokens", "16"]
    args += ["--out", str(tmp_path)]
    run_script("gateway_soak.py", args)
    results = json.loads((tmp_path / "gateway_soak.json").read_text())
    verdict = results["verdict"]
    assert verdict["passed"], verdict["failures"]
    counts = verdict["counts"]
    assert counts.get("ok", 0) >= 8  # the load really ran, through the kill
    assert set(verdict["growth_after_warmup"]) == {"rss", "fds"}  # memory and descriptors were judged
    assert set(counts) <= {"ok", "typed-503", "typed-429"}
    assert "trunk SIGKILLed" in (tmp_path / "gateway_soak.log").read_text()
    assert "trunk restarted" in (tmp_path / "gateway_soak.log").read_text()
