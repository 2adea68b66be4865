"""Chat with a chat template: what reaches the caches is apply_chat_template of the conversation, every turn."""

from __future__ import annotations

import asyncio
import io
import json
import shutil
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer, RepetitionPenaltyLogitsProcessor

from splitspec.chat import ChatConfig, chat
from splitspec.chat_template import end_of_turn_ids, plan_turn, render
from splitspec.cloud.config import CloudConfig
from splitspec.cloud.server import TrunkServer
from splitspec.decoding.sampling import SamplingParams
from splitspec.edge import EdgeConfig, SplitClient
from splitspec.edge.runtime import EdgeRuntime
from splitspec.exceptions import ConfigError
from tests.conftest import local_greedy, local_model

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


async def run_chat(
    model: Path, lines: list[str], system_prompt: str | None = None, repetition_penalty: float = 1.0
) -> list[dict[str, Any]]:
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
            repetition_penalty=repetition_penalty,
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


async def test_the_repetition_penalty_reads_the_whole_conversation(instruct_model: Path) -> None:
    """Every turn's reply is the whole model's greedy one under transformers' processor over the whole conversation
    (the caches keep earlier turns; the penalty still sees their tokens)."""
    turns = await run_chat(instruct_model, ["to be or not\n", "to be or not to be\n"], repetition_penalty=3.0)
    plain = await run_chat(instruct_model, ["to be or not\n", "to be or not to be\n"])
    model = local_model(instruct_model)
    for turn in turns:
        context, out = list(turn["input_ids"]), list[int]()
        with torch.no_grad():
            for _ in range(len(turn["token_ids"])):
                ids = torch.tensor([context + out])  # (1, n)
                out.append(int(RepetitionPenaltyLogitsProcessor(3.0)(ids, model(ids).logits[:, -1].float()).argmax()))
        assert turn["token_ids"] == out
    assert [t["token_ids"] for t in turns] != [t["token_ids"] for t in plain]


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


# turns closed by a special token that is not EOS (as Qwen's <|im_end|> or Llama 3's <|eot_id|>)
EOT_TEMPLATE = TEMPLATE.replace("{{ eos_token }}", "{{ unk_token }}")


@pytest.fixture(scope="module")
def eot_model(make_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An instruct checkpoint whose end-of-turn token (<unk>) differs from EOS, and which greedily emits it.

    Its LM head row for <unk> is 1.05 x the row of a token the model picks greedily in the first
    reply, so <unk> wins there (and maybe earlier); EOS is declared in config and generation_config.
    """
    directory = tmp_path_factory.mktemp("eot")
    shutil.copytree(make_checkpoint("llama", logit_scale=4.0), directory, dirs_exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    tokenizer.chat_template = EOT_TEMPLATE
    tokenizer.save_pretrained(directory)
    context = render(tokenizer, [{"role": "user", "content": "to be or not"}])
    picked = local_greedy(directory, context, 3)[2]
    tensors = load_file(directory / "model.safetensors")
    tensors["lm_head.weight"][tokenizer.unk_token_id] = tensors["lm_head.weight"][picked] * 1.05
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    for name in ("config.json", "generation_config.json"):
        data = json.loads((directory / name).read_text())
        (directory / name).write_text(json.dumps({**data, "eos_token_id": tokenizer.eos_token_id}))
    return directory


async def test_a_turn_ends_at_an_end_of_turn_token_that_is_not_eos(eot_model: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(eot_model)
    eot = tokenizer.unk_token_id
    assert end_of_turn_ids(tokenizer) == {eot} != {tokenizer.eos_token_id}
    (turn,) = await run_chat(eot_model, ["to be or not\n"])
    reference = local_greedy(eot_model, turn["input_ids"], 5)  # HF greedy, which knows only EOS
    assert eot in reference
    assert turn["token_ids"] == reference[: reference.index(eot) + 1]  # the split reply stops right at it
    assert "<unk>" not in turn["text"]


async def test_a_turn_that_cannot_fit_is_refused_and_the_chat_goes_on(make_checkpoint: Callable[..., Path]) -> None:
    model = make_checkpoint("llama", max_positions=32)
    tokenizer = AutoTokenizer.from_pretrained(model)
    first, refused, second = await run_chat(model, ["to be\n", "to be or not to be " * 4 + "\n", "or not\n"])
    assert "exceeds the model's 32 positions" in refused["error"]
    assert second["turn"] == 2
    assert second["input_ids"] == [  # the refused line never entered the context
        *first["input_ids"],
        *first["token_ids"],
        *tokenizer.encode("or not\n", add_special_tokens=False),
    ]


async def test_the_event_loop_runs_while_a_line_is_awaited(make_checkpoint: Callable[..., Path]) -> None:
    """Reading a line (a user typing) must not block the loop: it answers the link's keepalive pings meanwhile."""
    model = make_checkpoint("llama")
    reading = threading.Event()

    def typed() -> Iterator[str]:  # a terminal: each line comes after a pause
        for line in ("to be\n", "or not\n"):
            reading.set()
            time.sleep(0.5)
            reading.clear()
            yield line
        reading.set()
        time.sleep(0.5)  # then a pause before the end of input
        reading.clear()

    ticks_while_reading = 0
    done = asyncio.Event()

    async def ticker() -> None:
        nonlocal ticks_while_reading
        while not done.is_set():
            ticks_while_reading += reading.is_set()
            await asyncio.sleep(0.01)

    out = io.StringIO()
    async with TrunkServer(CloudConfig(model_dir=model, port=0)) as server:
        edge = EdgeConfig(model_dir=model, cloud_url=server.url, allow_stock_edge_weights=True)
        config = ChatConfig(edge=edge, max_new_tokens=3, params=SamplingParams(), speculate="off", json_lines=True)
        tick = asyncio.create_task(ticker())
        try:
            turns = await chat(config, typed(), out)
        finally:
            done.set()
            await tick
    assert turns == 2
    assert len(out.getvalue().splitlines()) == 2
    assert ticks_while_reading >= 30  # ~100 possible in the 1.5 s of pauses; none when the loop blocks on input


async def test_an_error_reading_a_line_reaches_the_chat(make_checkpoint: Callable[..., Path]) -> None:
    model = make_checkpoint("llama")

    def broken() -> Iterator[str]:
        yield "to be\n"
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")

    async with TrunkServer(CloudConfig(model_dir=model, port=0)) as server:
        edge = EdgeConfig(model_dir=model, cloud_url=server.url, allow_stock_edge_weights=True)
        config = ChatConfig(edge=edge, max_new_tokens=3, params=SamplingParams(), speculate="off", json_lines=True)
        with pytest.raises(UnicodeDecodeError):
            await chat(config, broken(), io.StringIO())


async def test_chat_samples_with_the_generator_made_where_the_edges_logits_live(
    make_checkpoint: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A CUDA edge's logits are sampled with a CUDA generator: chat takes it from the runtime, as generate does
    (a CPU generator failed at the first torch.multinomial of ``chat --device cuda --temperature 0.7``)."""
    model = make_checkpoint("llama")
    made: list[tuple[torch.device, torch.Generator]] = []
    passed: list[torch.Generator | None] = []
    runtime_generator = EdgeRuntime.generator
    stream = SplitClient.stream

    def spy_generator(self: EdgeRuntime, params: SamplingParams) -> tuple[torch.Generator, int]:
        generator, seed = runtime_generator(self, params)
        made.append((self.device, generator))
        return generator, seed

    def spy_stream(self: SplitClient, *args: Any, **kwargs: Any) -> AsyncIterator[int]:
        passed.append(kwargs.get("generator"))
        return stream(self, *args, **kwargs)

    monkeypatch.setattr(EdgeRuntime, "generator", spy_generator)
    monkeypatch.setattr(SplitClient, "stream", spy_stream)
    async with TrunkServer(CloudConfig(model_dir=model, port=0)) as server:
        edge = EdgeConfig(model_dir=model, cloud_url=server.url, allow_stock_edge_weights=True)
        params = SamplingParams(temperature=0.7, seed=3)
        config = ChatConfig(edge=edge, max_new_tokens=3, params=params, speculate="off", json_lines=True)
        assert await chat(config, ["to be\n", "or not\n"], io.StringIO()) == 2
    assert len(made) == 1  # one generator for the whole conversation, made for the edge's device
    device, generator = made[0]
    assert passed == [generator, generator]
    assert generator.device == device


# Gemma's way: a template that refuses a system role (and, here, a user line saying "boom")
REFUSING_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for m in messages %}{% if m['content'] == 'boom' %}{{ raise_exception('no booms') }}{% endif %}{% endfor %}"
    + TEMPLATE
)


@pytest.fixture(scope="module")
def refusing_model(make_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("refusing")
    shutil.copytree(make_checkpoint("llama", logit_scale=4.0), directory, dirs_exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    tokenizer.chat_template = REFUSING_TEMPLATE
    tokenizer.save_pretrained(directory)
    return directory


async def test_a_template_refusing_the_system_prompt_is_a_config_error_before_connecting(refusing_model: Path) -> None:
    edge = EdgeConfig(model_dir=refusing_model, cloud_url="ws://127.0.0.1:1", allow_stock_edge_weights=True)
    config = ChatConfig(edge=edge, max_new_tokens=3, params=SamplingParams(), speculate="off", system_prompt="hi")
    with pytest.raises(ConfigError, match=r"refused the conversation \(--system\): System role not supported"):
        await chat(config, ["to be\n"], io.StringIO())  # no trunk at that address: refused before connecting


async def test_a_turn_the_template_refuses_is_reported_and_the_chat_goes_on(refusing_model: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(refusing_model)
    refused, turn = await run_chat(refusing_model, ["boom\n", "to be\n"])
    assert "no booms" in refused["error"]
    assert turn["turn"] == 1
    assert turn["input_ids"] == render(tokenizer, [{"role": "user", "content": "to be"}])  # boom never entered it
