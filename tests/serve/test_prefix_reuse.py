"""Prefix reuse across turns: only the new suffix crosses the wire; output equals a fresh session's."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import openai
import pytest
import torch
from openai.types.chat import ChatCompletionMessageParam
from transformers import AutoTokenizer

from splitspec.edge import EdgeConfig, SplitClient
from splitspec.prefix import common_prefix
from tests.serve.conftest import MODEL_NAME, Stack
from tests.serve.helpers import generate_cli, rendered

TOKEN_BYTES = 64 * 4 + 4 + 4  # one token up the wire: hidden state (64 float32), int32 position and parent
STEP_HEADER_BYTES = 400  # frame header and JSON of one step, at most


def chat_turn(stack: Stack, messages: list[ChatCompletionMessageParam]) -> tuple[str, int, int]:
    """(reply, cached prompt tokens, bytes sent up the link) of one greedy turn."""
    client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0)
    before = stack.emulator.stats().bytes_upstream
    reply = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=12, temperature=0)
    assert reply.usage is not None
    assert reply.usage.prompt_tokens_details is not None
    cached = reply.usage.prompt_tokens_details.cached_tokens or 0
    return reply.choices[0].message.content or "", cached, stack.emulator.stats().bytes_upstream - before


def test_second_turn_sends_only_its_new_tokens(
    make_stack: Callable[..., Stack], chat_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # no speculation: the decode steps (and their bytes) are then the same in both, only the prefill differs
    reuse, fresh = make_stack(speculate="off"), make_stack(speculate="off", prefix_reuse=False)
    tokenizer = AutoTokenizer.from_pretrained(chat_model, local_files_only=True)
    turn1: list[ChatCompletionMessageParam] = [{"role": "user", "content": "to be or not to be that is the question"}]
    answers = [chat_turn(s, turn1) for s in (reuse, fresh)]
    assert answers[0][0] == answers[1][0]
    turn2: list[ChatCompletionMessageParam] = [
        *turn1,
        {"role": "assistant", "content": answers[0][0]},
        {"role": "user", "content": "whether tis nobler"},
    ]
    text2, cached, up_reuse = chat_turn(reuse, turn2)
    text2_fresh, cached_fresh, up_fresh = chat_turn(fresh, turn2)
    prompt1 = tokenizer.encode(rendered(chat_model, turn1), add_special_tokens=False)
    prompt2 = tokenizer.encode(rendered(chat_model, turn2), add_special_tokens=False)
    assert cached_fresh == 0
    assert cached >= len(prompt1)  # at least the whole first prompt stayed in the caches
    # the link carried only the new tokens: the saving is exactly the reused tokens (headers aside)
    assert abs((up_fresh - up_reuse) - cached * TOKEN_BYTES) <= 100
    steps = 12  # one prefill, then one decode step per further token
    assert up_reuse <= (len(prompt2) - cached + steps - 1) * TOKEN_BYTES + steps * STEP_HEADER_BYTES
    # output identical to a fresh session, and to `splitspec generate` on the rendered prompt
    cloud = f"ws://127.0.0.1:{fresh.trunk_port}"
    expected = generate_cli(capsys, chat_model, cloud, rendered(chat_model, turn2), 12, end_of_turn=True)
    assert text2 == text2_fresh == expected["visible_text"]

    # an edited conversation: the cloud cache is cut back to the longest common prefix
    edited: list[ChatCompletionMessageParam] = [
        *turn1,
        {"role": "assistant", "content": answers[0][0]},
        {"role": "user", "content": "def main():"},
    ]
    prompt3 = tokenizer.encode(rendered(chat_model, edited), add_special_tokens=False)
    text3, cached3, _ = chat_turn(reuse, edited)
    text3_fresh, _, _ = chat_turn(fresh, edited)
    assert cached3 == common_prefix(prompt2, prompt3) < len(prompt2)
    assert text3 == text3_fresh


async def test_truncate_then_extend_equals_a_fresh_prefill(stack: Stack, chat_model: Path) -> None:
    """SplitClient.truncate (what the pool does to a kept session): the cut, merged with a pending
    keep of a speculative step, leaves exactly the kept prefix on both sides."""
    url = f"ws://127.0.0.1:{stack.trunk_port}"
    cfg = EdgeConfig(model_dir=chat_model, cloud_url=url, allow_stock_edge_weights=True)
    tokenizer = AutoTokenizer.from_pretrained(chat_model, local_files_only=True)
    prompt = tokenizer.encode("to be or not to be to be or not to be to be or not")
    async with SplitClient(cfg) as edited, SplitClient(cfg) as fresh:
        await edited.generate(prompt, 24, speculate="ngram")
        await edited.forward([5, 6, 7])  # a step whose accepted path (first two) is pending for the cloud
        edited.keep([0, 1])
        history = edited.history
        for cut in (len(history), len(history) - 1, len(history) - 6, 5, 0):
            edited.truncate(cut)
            assert edited.history == history[:cut]
            suffix = [7, 8, 9]
            logits = await edited.forward(suffix)
            fresh.reset()
            expected = await fresh.forward([*history[:cut], *suffix])
            torch.testing.assert_close(logits, expected[-3:], atol=1e-4, rtol=1e-4)
            history = edited.history
