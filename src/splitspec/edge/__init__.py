"""The trusted side: embedding, edge layers, LM head, and the client that drives a remote trunk.

:class:`EdgeConfig` loads with the package; the client (and with it torch and transformers) on first use of
its names, so that a command line builds its parser and reads a config without loading a model library.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from splitspec.edge.config import EdgeConfig

if TYPE_CHECKING:
    from splitspec.edge.client import GenerationResult, SplitClient, StepStats

__all__ = ["EdgeConfig", "GenerationResult", "SplitClient", "StepStats"]

_FROM_CLIENT = ("GenerationResult", "SplitClient", "StepStats")


def __getattr__(name: str) -> Any:
    if name in _FROM_CLIENT:
        return getattr(importlib.import_module("splitspec.edge.client"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
