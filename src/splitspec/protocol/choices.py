"""The protocol's names and defaults a command line offers, importable without torch (the CLI parser needs them)."""

from __future__ import annotations

WIRE_CODECS: tuple[str, ...] = ("raw", "bf16", "int8")  # every codec this protocol version knows
DEFAULT_QUANT_BUDGET = 0.05  # ρ: quantization error allowed per position, as a fraction of its tail mass
