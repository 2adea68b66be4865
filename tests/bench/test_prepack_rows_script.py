"""benchmarks/prepack_rows.py, tiny: its two variants compute the same products, and a fresh process
calling every row count builds fewer shapes padded than exact (the run writes its report)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from splitspec.models.prepack import prepack_available
from tests.bench.scripts import load_script, run_script

pytestmark = pytest.mark.skipif(not prepack_available(), reason="this torch build lacks oneDNN's packed linear")


@torch.inference_mode()
def test_the_exact_variant_is_the_operator_on_the_rows_as_they_are() -> None:
    script = load_script("prepack_rows.py", "prepack_rows")
    lin = script.linears()[0]
    x = torch.randn(1, 19, lin.in_features)  # 19 rows: padded to 20 by PackedLinear
    torch.testing.assert_close(script.exact_forward(lin, x), lin(x), rtol=1e-5, atol=1e-5)


def test_a_tiny_run_writes_its_report(tmp_path: Path) -> None:
    # timed at six row counts, two of them padded: the default's 18 (up to 300 rows) took 7 s to time, these 0.7 s;
    # the memory children (fresh processes) still call every count 1..24
    args = ["--repeats", "1", "--memory-rows", "24", "--rows", "1", "4", "8", "16", "17", "33", "--out", str(tmp_path)]
    run_script("prepack_rows.py", args)
    results = json.loads((tmp_path / "prepack_rows.json").read_text())
    assert results["shapes"] == {"padded": 16 + 4, "exact": 24}  # 17..24 pad to 18, 20, 22, 24
    timed = [(t["rows"], t["padded_to"]) for t in results["times"]]
    assert timed == [(1, 1), (4, 4), (8, 8), (16, 16), (17, 18), (33, 36)]
    assert all(len(results["memory"][kind]) == 1 for kind in ("padded", "exact"))  # a child each
    assert all(t["padded_ms"] > 0 and t["exact_ms"] > 0 for t in results["times"])
    assert (tmp_path / "prepack_rows.md").read_text().startswith("# Prepacked linears")
    assert (tmp_path / "prepack_rows.png").stat().st_size > 0
