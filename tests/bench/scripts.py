"""Run a script of ``benchmarks/`` (not a package) in a process of its own, forked from a server that paid the
imports of torch, transformers, splitspec and matplotlib (tests/forkserver.py: the script runs as ``__main__``,
as ``python benchmarks/<name>.py ARGS`` would), or import it as a module for tests of its pure parts."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

from tests.forkserver import Run, run_forked

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load_script(filename: str, name: str) -> ModuleType:
    """``benchmarks/<filename>`` imported as module ``name``."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / filename)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def run_script(
    filename: str, args: list[str], timeout: float | None = None, returncodes: tuple[int, ...] = (0,)
) -> subprocess.CompletedProcess[str]:
    """``benchmarks/<filename> args`` in a process of its own; fails the test unless it exits with one of
    ``returncodes`` (with the tails of its output)."""
    (run,) = run_forked([Run(args, script=BENCHMARKS / filename)], timeout=timeout)
    assert run.returncode in returncodes, (
        f"{filename} exited {run.returncode}:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    )
    return run
