"""vLLM's ``repetition_penalty``, ``min_p`` and ``bad_words`` through a real trunk server: sent in a request, or (the
first two) published in the checkpoint's generation_config.json (``--generation-config auto``, as vLLM), they change
the reply as transformers' processors, or the rule written out here, change its whole model's output."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from transformers import AutoTokenizer, RepetitionPenaltyLogitsProcessor

from splitspec.cli import main
from tests.conftest import local_model
from tests.serve.conftest import MODEL_NAME, Stack

PROMPT = "to be or not to be that is the question to be or not to be"
COMPLETION: dict[str, Any] = {"model": MODEL_NAME, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "to be or not"}], "max_tokens": 10}


def ok(stack: Stack, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(f"{stack.base_url}{path}", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return dict(response.json())


def text(reply: dict[str, Any]) -> str:
    choice = reply["choices"][0]
    return str(choice["text"] if "text" in choice else choice["message"]["content"])


def penalised_greedy(model_dir: Path, prompt: list[int], penalty: float, tokens: int) -> list[int]:
    """The whole model's greedy tokens under transformers' own RepetitionPenaltyLogitsProcessor."""
    model, out = local_model(model_dir), list[int]()
    processor = RepetitionPenaltyLogitsProcessor(penalty)
    with torch.no_grad():
        for _ in range(tokens):
            ids = torch.tensor([prompt + out])  # (1, n)
            logits = model(ids).logits[:, -1].float()  # (1, V)
            out.append(int(processor(ids, logits).argmax()))
    return out


@pytest.mark.parametrize("penalty", [1.8, 1.05])
def test_repetition_penalty_is_transformers_over_the_prompt_and_the_reply(
    make_stack: Callable[..., Stack], chat_model: Path, penalty: float
) -> None:
    """Greedy under the penalty, n-gram drafts verified several a step, equals the whole model under transformers'
    processor token for token, streamed or not; without it the reply differs (the prompt repeats itself, so its
    tokens are what the penalty lowers)."""
    stack = make_stack(speculate="ngram")
    prompt = stack.state.tokenizer.encode(PROMPT, add_special_tokens=False)
    body = {**COMPLETION, "prompt": prompt, "repetition_penalty": penalty}
    reply = ok(stack, "/completions", body)
    tokenizer = stack.state.tokenizer
    want = penalised_greedy(chat_model, prompt, penalty, COMPLETION["max_tokens"])
    shown = [t for t in want if t not in tokenizer.all_special_ids]  # the reply's text skips special tokens
    assert text(reply).split() == tokenizer.convert_ids_to_tokens(shown)  # it decodes tokens apart, spaced
    assert reply["usage"]["completion_tokens"] == COMPLETION["max_tokens"]
    plain = ok(stack, "/completions", {**body, "repetition_penalty": 1.0})
    assert text(plain) != text(reply)
    assert text(ok(stack, "/completions", {**body, "repetition_penalty": None})) == text(plain)  # not sent: off
    with httpx.stream("POST", f"{stack.base_url}/completions", json={**body, "stream": True}, timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == text(reply)


def test_min_p_one_leaves_only_the_likeliest_token(stack: Stack) -> None:
    """min_p 1 keeps only tokens as likely as the likeliest: sampled at temperature 1, every choice is the greedy
    reply; without it the seeded choices are not."""
    greedy = text(ok(stack, "/chat/completions", {**CHAT, "temperature": 0}))
    sampled = {**CHAT, "temperature": 1.0, "seed": 11, "n": 3}
    kept = ok(stack, "/chat/completions", {**sampled, "min_p": 1.0})
    assert [c["message"]["content"] for c in kept["choices"]] == [greedy] * 3
    free = ok(stack, "/chat/completions", sampled)
    assert any(c["message"]["content"] != greedy for c in free["choices"])
    responses = ok(stack, "/responses", {"model": MODEL_NAME, "input": CHAT["messages"], "max_output_tokens": 10,
                                         "temperature": 1.0, "min_p": 1.0})  # fmt: skip
    assert responses["output"][0]["content"][0]["text"] == greedy  # passed through to the chat request


@pytest.fixture(scope="module")
def penalty_model(chat_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The chat checkpoint publishing repetition_penalty 1.8 (and nothing else)."""
    directory = tmp_path_factory.mktemp("penalty")
    shutil.copytree(chat_model, directory, dirs_exist_ok=True)
    (directory / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "repetition_penalty": 1.8}))
    return directory


@pytest.mark.parametrize("mode", ["auto", "vllm"])
def test_a_published_repetition_penalty_is_the_default(stack: Stack, penalty_model: Path, mode: str) -> None:
    """Under ``auto`` a request that sends no penalty gets the file's, as vLLM; one sent wins; ``vllm`` leaves it
    off. (The shared stack serves the same weights with no generation_config.json.)"""
    prompt = stack.state.tokenizer.encode(PROMPT, add_special_tokens=False)
    body = {**COMPLETION, "prompt": prompt}
    published = Stack(penalty_model, generation_config=mode)
    try:
        unset = text(ok(published, "/completions", body))
        off = text(ok(published, "/completions", {**body, "repetition_penalty": 1.0}))
    finally:
        published.close()
    penalised = text(ok(stack, "/completions", {**body, "repetition_penalty": 1.8}))
    plain = text(ok(stack, "/completions", body))
    assert off == plain
    assert unset == (penalised if mode == "auto" else plain)


def banned_greedy(model_dir: Path, prompt: list[int], tokens: int, single: int, pair: tuple[int, int]) -> list[int]:
    """The whole model's greedy tokens, never ``single``, and never ``pair[1]`` right after a generated ``pair[0]``."""
    model, out = local_model(model_dir), list[int]()
    with torch.no_grad():
        for _ in range(tokens):
            logits = model(torch.tensor([prompt + out])).logits[0, -1].float()  # (V,)
            logits[single] = -float("inf")
            if out[-1:] == [pair[0]]:
                logits[pair[1]] = -float("inf")
            out.append(int(logits.argmax()))
    return out


def test_bad_words_are_never_generated(make_stack: Callable[..., Stack], chat_model: Path) -> None:
    """vLLM's rule: a one-token word is banned, a longer word's last token after the rest of it; under n-gram
    drafting, the reply equals the whole model's greedy tokens under that rule, and differs without each word."""
    stack = make_stack(speculate="ngram")
    tokenizer = stack.state.tokenizer
    prompt = tokenizer.encode(PROMPT, add_special_tokens=False)

    def reply_tokens(words: list[str]) -> list[str]:
        body = {**COMPLETION, "prompt": prompt, "logprobs": 0, "bad_words": words or None}
        return list(ok(stack, "/completions", body)["choices"][0]["logprobs"]["tokens"])

    plain = reply_tokens([])
    single = plain[0]  # banned alone, it changes the reply from its first token
    assert tokenizer.encode(single, add_special_tokens=False) == tokenizer.convert_tokens_to_ids([single])
    without_single = reply_tokens([single])
    pair = without_single[:2]  # then, banned as a two-token word, from its second token
    assert tokenizer.encode(" ".join(pair), add_special_tokens=False) == tokenizer.convert_tokens_to_ids(pair)
    both = reply_tokens([single, " ".join(pair)])
    ids = tokenizer.convert_tokens_to_ids([single, *pair])
    want = banned_greedy(chat_model, prompt, COMPLETION["max_tokens"], ids[0], (ids[1], ids[2]))
    assert both == tokenizer.convert_ids_to_tokens(want)
    assert without_single[0] != plain[0]
    assert both[0] == without_single[0]
    assert both[1] != without_single[1]


def generate_ids(model: Path, port: int, prompt: str, *flags: str) -> list[int]:
    """``splitspec generate --json`` (greedy, n-gram drafting) against the trunk on ``port``: its token ids."""
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = main(["generate", "--model", str(model), "--cloud", f"ws://127.0.0.1:{port}", "--prompt", prompt,
                     "--allow-stock-edge-weights", "--max-new-tokens", "24", "--speculate", "ngram", "--json",
                     "--temperature", "0", *flags])  # fmt: skip
    assert code == 0
    return list(json.loads(stdout.getvalue())["token_ids"])


def test_generate_applies_the_repetition_penalty_given_or_published(
    stack: Stack, chat_model: Path, penalty_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``generate --repetition-penalty`` equals the whole model under transformers' processor (up to an end of
    sequence); without the flag, a checkpoint publishing 1.8 gets the same (as transformers' generate), and
    ``--repetition-penalty 1`` turns it off."""
    ids = generate_ids(chat_model, stack.trunk_port, PROMPT, "--repetition-penalty", "1.8")
    prompt = AutoTokenizer.from_pretrained(chat_model).encode(PROMPT)
    assert ids == penalised_greedy(chat_model, prompt, 1.8, 24)[: len(ids)]
    assert len(ids) == 24 or ids[-1] in stack.state.eos_token_ids
    assert generate_ids(penalty_model, stack.trunk_port, PROMPT) == ids
    plain = generate_ids(chat_model, stack.trunk_port, PROMPT)
    assert plain != ids
    assert generate_ids(penalty_model, stack.trunk_port, PROMPT, "--repetition-penalty", "1") == plain
    with caplog.at_level(logging.ERROR, logger="splitspec"):
        code = main(["generate", "--model", str(chat_model), "--cloud", f"ws://127.0.0.1:{stack.trunk_port}",
                     "--prompt", PROMPT, "--repetition-penalty", "0"])  # fmt: skip
    assert code != 0
    assert "--repetition-penalty must be above 0, got 0" in caplog.text
