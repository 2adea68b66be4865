"""The ``--compile`` modes (torch.compile's, plus ``auto``), importable without torch for argument parsing."""

from __future__ import annotations

COMPILE_MODES = ("auto", "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
