"""Helpers of the server tests: expected outputs from ``splitspec generate`` and local rendering."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from splitspec.cli import main


def rendered(model: Path, messages: Sequence[Mapping[str, Any]]) -> str:
    """The prompt text the chat template makes of ``messages`` (rendered here, independently)."""
    tokenizer = AutoTokenizer.from_pretrained(model, local_files_only=True)
    return str(tokenizer.apply_chat_template([dict(m) for m in messages], tokenize=False, add_generation_prompt=True))


def generate_cli(
    capsys: pytest.CaptureFixture[str], model: Path, cloud_url: str, prompt: str, max_new_tokens: int
) -> dict[str, Any]:
    """``splitspec generate --json`` (greedy) on ``prompt``, plus the text OpenAI would show."""
    capsys.readouterr()
    code = main([
        "generate", "--model", str(model), "--cloud", cloud_url, "--prompt", prompt, "--allow-stock-edge-weights",
        "--max-new-tokens", str(max_new_tokens), "--json",
    ])  # fmt: skip
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    tokenizer = AutoTokenizer.from_pretrained(model, local_files_only=True)
    out["visible_text"] = tokenizer.decode(out["token_ids"], skip_special_tokens=True)
    return dict(out)
