"""The other half of the benchmark scripts at a toy size (see ``test_script_smoke.py`` and ``smoke.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.bench.smoke import halves, run_at_toy_size

pytestmark = pytest.mark.slow  # each test runs a script in a subprocess


@pytest.mark.parametrize("name", halves()[1])
def test_a_benchmark_runs_at_a_toy_size_and_writes_its_report(name: str, tmp_path: Path) -> None:
    run_at_toy_size(name, tmp_path)
