"""benchmarks/device_targets.py, short, on a CPU (the GPU check runs it on CUDA): every figure is written, and the
split, eager and with its decode steps compiled (capture only here), gives the whole model's greedy tokens.

One torch thread: with the CPU's two, on a machine another test worker keeps busy, the tiny model's steps waited at
each other's barriers (the run took 3x as long). The trunk figure's step is compiled by the eager backend (dynamo's
capture, as the split's): inductor's C++ build of it took 29 s of a 58 s run on a cold cache, for a figure the test
only checks is there (the suite's compile tests capture with eager too, unless given --compile-backend inductor)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.bench.scripts import run_script


def test_a_short_cpu_run_writes_every_figure_and_keeps_greedy_identity(tmp_path: Path) -> None:
    args = [
        *("--device", "cpu", "--dtype", "float32", "--shape", "tiny", "--repeats", "3", "--new-tokens", "8"),
        *("--trips", "20", "--steps", "5", "--context", "64", "--split-compile", "auto", "--compile-backend", "eager"),
        *("--trunk-compile-backend", "eager", "--threads", "1", "--out", str(tmp_path)),
    ]
    run_script("device_targets.py", args, timeout=400)
    results = json.loads((tmp_path / "device_targets.json").read_text())
    split = results["split_vs_whole"]
    assert len(split["split_tok_s"]) == len(split["compiled_split_tok_s"]) == 3
    assert split["greedy_tokens_identical"] == [True] * 6  # eager and compiled, every repeat
    assert split["compiled_ratio_median"] > 0
    assert results["framework_overhead"]["step_overhead_ms_median"] > 0
    trunk = results["trunk_vs_transformers"]
    assert set(trunk["ratio_median"]) == {"growable", "static", "compiled"}
    assert (trunk["compile_mode"], trunk["compile_backend"]) == ("default", "eager")  # compiled, by dynamo's capture
    report = (tmp_path / "device_targets.md").read_text()
    assert "split compiled / whole ratio" in report
    assert (tmp_path / "device_targets.png").stat().st_size > 0
