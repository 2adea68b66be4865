"""Helpers of the server tests: expected outputs from ``splitspec generate``, local rendering, the server's
/tokenize."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
from transformers import AutoTokenizer

from splitspec.chat_template import end_of_turn_ids
from splitspec.cli import main
from splitspec.detokenize import CONTEXT_TOKENS, text_after
from tests.serve.conftest import Stack


def tokenize(stack: Stack, body: Mapping[str, Any]) -> list[int]:
    """vLLM's /tokenize (at the server's root, not under /v1)."""
    response = httpx.post(f"{stack.base_url.removesuffix('/v1')}/tokenize", json=dict(body), timeout=60)
    assert response.status_code == 200, response.text
    return list(response.json()["tokens"])


def rendered(model: Path, messages: Sequence[Mapping[str, Any]]) -> str:
    """The prompt text the chat template makes of ``messages`` (rendered here, independently)."""
    tokenizer = AutoTokenizer.from_pretrained(model, local_files_only=True)
    return str(tokenizer.apply_chat_template([dict(m) for m in messages], tokenize=False, add_generation_prompt=True))


def generate_cli(
    capsys: pytest.CaptureFixture[str],
    model: Path,
    cloud_url: str,
    prompt: str,
    max_new_tokens: int,
    end_of_turn: bool = False,
) -> dict[str, Any]:
    """``splitspec generate --json`` (greedy) on ``prompt``, plus what OpenAI would show of it.

    ``end_of_turn``: a chat reply, which also ends at the template's end-of-turn token, and whose text is
    decoded alone (a completion's is decoded after the prompt's last ids, as it continues the prompt).
    """
    capsys.readouterr()
    code = main([
        "generate", "--model", str(model), "--cloud", cloud_url, "--prompt", prompt, "--allow-stock-edge-weights",
        "--max-new-tokens", str(max_new_tokens), "--json",
    ])  # fmt: skip
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    tokenizer = AutoTokenizer.from_pretrained(model, local_files_only=True)
    ids = list(out["token_ids"])
    stops = end_of_turn_ids(tokenizer) if end_of_turn else frozenset()
    cut = next((i + 1 for i, t in enumerate(ids) if t in stops), len(ids))
    out["reply_ids"] = ids[:cut]
    out["finish_reason"] = "stop" if cut < len(ids) or (ids and ids[-1] in stops) else "length"

    def decode(part: list[int]) -> str:
        return str(tokenizer.decode(part, skip_special_tokens=True))

    context = [] if end_of_turn else out["prompt_ids"][-CONTEXT_TOKENS:]
    out["visible_text"] = text_after(decode, context, ids[:cut])
    return dict(out)


def chat(client: Any, **kw: Any) -> Any:
    """``client.chat.completions.create(**kw)`` for fields the SDK's overloads do not type (extensions)."""
    return client.chat.completions.create(**kw)


def complete(client: Any, **kw: Any) -> Any:
    """``client.completions.create(**kw)``, as :func:`chat`."""
    return client.completions.create(**kw)
