"""The ``--dtype`` choices, importable without torch (the CLI parser needs them)."""

from __future__ import annotations

AUTO = "auto"
DTYPE_NAMES = ("float32", "bfloat16", "float16")
DTYPE_CHOICES = (AUTO, *DTYPE_NAMES)
