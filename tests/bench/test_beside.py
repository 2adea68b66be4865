"""A benchmark's measurement runs on this checkout's code and on a baseline commit's, repeats interleaved."""

from __future__ import annotations

import subprocess
from pathlib import Path

from splitspec.bench.beside import measure_beside

SCRIPT = """
import json, sys
import marker  # from the src on PYTHONPATH: the checkout's or the baseline worktree's
assert sys.argv[1] == "--measure"
json.dump({"value": marker.VALUE, "scale": float(sys.argv[3])}, open(sys.argv[2], "w"))
"""


def _git(repo: Path, *args: str) -> str:
    cmd = ["git", "-c", "user.email=t@example.invalid", "-c", "user.name=t", *args]
    return subprocess.run(cmd, cwd=repo, check=True, capture_output=True, text=True).stdout.strip()


def test_each_side_runs_its_own_code_and_the_worktree_goes(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / "src").mkdir(parents=True)
    _git(repo, "init", "-q")
    (repo / "src" / "marker.py").write_text("VALUE = 1.0\n")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "one")
    first = _git(repo, "rev-parse", "HEAD")
    (repo / "src" / "marker.py").write_text("VALUE = 2.0\n")  # this checkout: not committed
    script = tmp_path / "measure.py"
    script.write_text(SCRIPT)
    runs = measure_beside(script, repo, repeats=3, baseline=first, args=["7"])
    assert runs == {"this": [{"value": 2.0, "scale": 7.0}] * 3, "before": [{"value": 1.0, "scale": 7.0}] * 3}
    assert "baseline" not in _git(repo, "worktree", "list")  # removed again
    alone = measure_beside(script, repo, repeats=2, args=["1"])
    assert alone == {"this": [{"value": 2.0, "scale": 1.0}] * 2, "before": []}
