"""A benchmark's measurement run on this checkout's code and on an older commit's, side by side.

A script's ``--measure JSON`` mode measures once, with whatever ``splitspec`` is on its path, and
writes a flat ``{case: figure}`` JSON. :func:`measure_beside` runs that mode in child processes:
on this checkout's ``src``, and with a baseline on a git worktree of the baseline commit (same
venv), repeats interleaved and the order alternated, so the machine's drift falls on both.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger(__name__)


def run_child(script: Path, src: Path, args: Sequence[str] = ()) -> dict[str, float]:
    """``script --measure JSON *args`` in a child process on the code under ``src`` -> the JSON it wrote."""
    with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
        env = {**os.environ, "PYTHONPATH": str(src)}
        subprocess.run([sys.executable, str(script), "--measure", tmp.name, *args], check=True, env=env)
        result: dict[str, float] = json.loads(Path(tmp.name).read_text())
        return result


def measure_beside(
    script: Path, root: Path, repeats: int, baseline: str | None = None, args: Sequence[str] = ()
) -> dict[str, list[dict[str, float]]]:
    """``{"this": [...], "before": [...]}``: one :func:`run_child` result per repeat on the code of the checkout
    at ``root`` (its ``src``) and, with ``baseline`` (a commit of that repository), on that commit's (``before``
    stays empty without one)."""
    runs: dict[str, list[dict[str, float]]] = {"this": [], "before": []}
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "baseline"
        if baseline:
            subprocess.run(["git", "worktree", "add", "--detach", str(tree), baseline], check=True, cwd=root)
        try:
            for repeat in range(repeats):
                order = ["this", "before"] if repeat % 2 == 0 else ["before", "this"]
                for label in order if baseline else ["this"]:
                    runs[label].append(run_child(script, root / "src" if label == "this" else tree / "src", args))
                    log.info("repeat %d %s done", repeat, label)
        finally:
            if baseline:
                subprocess.run(["git", "worktree", "remove", "--force", str(tree)], check=False, cwd=root)
    return runs
