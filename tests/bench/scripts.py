"""Import a script of ``benchmarks/`` (not a package) as a module, for tests of its pure parts."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

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
