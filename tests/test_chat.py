"""Chat with a chat template: what reaches the caches is apply_chat_template of the conversation, every turn."""

from __future__ import annotations

import io
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from splitspec.chat import ChatConfig, chat
from splitspec.chat_template import end_of_turn_ids, plan_turn, render
from splitspec.cloud.config import CloudConfig
from splitspec.cloud.server import TrunkServer
from splitspec.decoding.sampling import SamplingParams
from splitspec.edge import EdgeConfig
from splitspec.exceptions import ConfigError
from tests.conftest import local_greedy

# ChatML-like, with a BOS at the start (as Llama 3's template has) and </s> closing every turn
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


@pytest.fixture(scope="module")
def instruct_model(make_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("instruct")
    shutil.copytree(make_checkpoint("llama", logit_scale=4.0), directory, dirs_exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(directory)
    return directory


async def run_chat(model: Path, lines: list[str], system_prompt: str | None = None) -> list[dict[str, Any]]:
    out = io.StringIO()
    async with TrunkServer(CloudConfig(model_dir=model, port=0)) as server:
        edge = EdgeConfig(model_dir=model, cloud_url=server.url, allow_stock_edge_weights=True)
        config = ChatConfig(
            edge=edge,
            max_new_tokens=5,
            params=SamplingParams(),
            speculate="off",
            json_lines=True,
            system_prompt=system_prompt,
        )
        await chat(config, lines, out)
    return [json.loads(line) for line in out.getvalue().splitlines()]


@pytest.mark.parametrize("system", [None, "be brief"])
async def test_chat_sends_the_chat_template_turn_after_turn(instruct_model: Path, system: str | None) -> None:
    tokenizer = AutoTokenizer.from_pretrained(instruct_model)
    users = ["to be or not", "whether tis nobler", "the question"]
    turns = await run_chat(instruct_model, [f"{u}\n" for u in users], system_prompt=system)
    assert len(turns) == 3
    messages: list[dict[str, str]] = [] if system is None else [{"role": "system", "content": system}]
    for user, turn in zip(users, turns, strict=True):
        messages.append({"role": "user", "content": user})
        expected = render(tokenizer, messages)  # = apply_chat_template(..., add_generation_prompt=True)
        assert expected == tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        assert turn["input_ids"] == expected
        assert list(expected).count(tokenizer.bos_token_id) == 1  # never a BOS mid-context
        # the caches held exactly that context: the greedy reply is the local model's from it
        assert turn["token_ids"] == local_greedy(instruct_model, list(expected), 5)
        sent = turn["sent_ids"]
        assert isinstance(sent, list)
        assert expected[len(expected) - len(sent) :] == sent
        if len(messages) > 1 + (system is not None):  # later turns send only what the caches lack
            assert len(sent) < len(expected) // 2
        messages.append({"role": "assistant", "content": str(turn["text"])})


def test_end_of_turn_and_turn_plan(instruct_model: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(instruct_model)
    assert end_of_turn_ids(tokenizer) == {tokenizer.eos_token_id}
    rendered = render(tokenizer, [{"role": "user", "content": "hi"}])
    plan = plan_turn([*rendered[:3], 7, 7], rendered)
    assert (plan.keep, plan.send) == (3, rendered[3:])
    assert plan_turn(rendered, rendered).send == rendered[-1:]  # always at least one token


async def test_plain_mode_and_system_without_template(make_checkpoint: Callable[..., Path]) -> None:
    model = make_checkpoint("llama")
    turns = await run_chat(model, ["to be\n", "or not\n"])
    tokenizer = AutoTokenizer.from_pretrained(model)
    first, second = turns
    assert first["input_ids"] == tokenizer.encode("to be\n")
    assert second["input_ids"] == [
        *first["input_ids"],
        *first["token_ids"],
        *tokenizer.encode("or not\n", add_special_tokens=False),
    ]
    with pytest.raises(ConfigError, match="chat template"):
        await run_chat(model, ["x\n"], system_prompt="be brief")
