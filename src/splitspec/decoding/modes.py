"""The ``--speculate`` modes, importable without torch (the CLI parser needs them); see :mod:`.speculative`."""

from __future__ import annotations

SPECULATE_MODES = ("off", "ngram", "prompt-lookup", "draft", "eagle", "mix", "auto")
