"""The official ``openai`` client against ``splitspec serve`` through a real trunk server."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

import splitspec
from splitspec.decoding.dear_gate import DearGate
from tests.serve.conftest import MODEL_NAME, SPECIALS, Stack
from tests.serve.helpers import generate_cli, rendered

MESSAGES: list[ChatCompletionMessageParam] = [
    {"role": "system", "content": "to be or not to be"},
    {"role": "user", "content": "whether tis nobler in the mind"},
]


@pytest.fixture(scope="module")
def sync_client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0)


def test_chat_equals_generate_on_the_rendered_prompt(
    stack: Stack, chat_model: Path, sync_client: openai.OpenAI, capsys: pytest.CaptureFixture[str]
) -> None:
    prompt = rendered(chat_model, MESSAGES)
    cloud = f"ws://127.0.0.1:{stack.trunk_port}"
    expected = generate_cli(capsys, chat_model, cloud, prompt, 24, end_of_turn=True)
    reply = sync_client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=24, temperature=0)
    n = len(expected["reply_ids"])
    assert reply.choices[0].message.content == expected["visible_text"]
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].finish_reason == expected["finish_reason"]
    assert reply.object == "chat.completion"
    assert reply.model == MODEL_NAME
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == len(expected["prompt_ids"])
    assert reply.usage.completion_tokens == n
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + n

    # streamed: the chunks concatenate to the same text, the usage chunk comes last
    chunks = list(
        sync_client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, max_tokens=24, temperature=0,
            stream=True, stream_options={"include_usage": True},
        )
    )  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected["visible_text"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == expected["finish_reason"]
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (len(expected["prompt_ids"]), n)
    assert len({c.id for c in chunks}) == 1


async def test_async_client_completions_equal_generate(
    stack: Stack, chat_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompt = "def main(): return print(value) for x in"
    cloud = f"ws://127.0.0.1:{stack.trunk_port}"
    expected = await asyncio.to_thread(generate_cli, capsys, chat_model, cloud, prompt, 16)  # runs its own loop
    client = openai.AsyncOpenAI(base_url=stack.base_url, api_key="unused", max_retries=0)
    reply = await client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=16, temperature=0)
    assert reply.choices[0].text == expected["visible_text"]
    assert reply.usage is not None
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(expected["prompt_ids"]), 16)
    stream = await client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected["visible_text"]
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 16
    # the same prompt as token ids gives the same completion
    by_ids = await client.completions.create(
        model=MODEL_NAME, prompt=expected["prompt_ids"], max_tokens=16, temperature=0
    )
    assert by_ids.choices[0].text == expected["visible_text"]
    chat = await client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=8, temperature=0)
    assert chat.usage is not None
    assert 1 <= chat.usage.completion_tokens <= 8  # a chat reply may end at <|end|>
    await client.close()


def test_stop_strings_stop_and_are_excluded(sync_client: openai.OpenAI) -> None:
    prompt = "to be or not to be that is"
    full = sync_client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=24, temperature=0)
    text = full.choices[0].text
    words = text.split()
    assert len(words) >= 6, text
    stop = " ".join(words[3:5])  # two words spanning at least two tokens, a few tokens in
    cut = text.index(stop)
    for stream in (False, True):
        if stream:
            chunks = list(
                sync_client.completions.create(
                    model=MODEL_NAME, prompt=prompt, max_tokens=24, temperature=0, stop=["zzz", stop], stream=True
                )
            )
            got = "".join(c.choices[0].text for c in chunks)
            finish = chunks[-1].choices[0].finish_reason
        else:
            reply = sync_client.completions.create(
                model=MODEL_NAME, prompt=prompt, max_tokens=24, temperature=0, stop=stop
            )
            got, finish = reply.choices[0].text, reply.choices[0].finish_reason
            assert reply.usage is not None
            assert reply.usage.completion_tokens < 24
        assert got == text[:cut]
        assert finish == "stop"


def test_seeded_sampling_is_reproducible(sync_client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        reply = sync_client.completions.create(
            model=MODEL_NAME, prompt="the question", max_tokens=12, temperature=1.0, top_p=0.9, seed=seed
        )
        return reply.choices[0].text

    assert sample(3) == sample(3)
    assert len({sample(s) for s in range(4)}) > 1


def test_sse_wire_format(stack: Stack) -> None:
    body = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 4, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{stack.base_url}/chat/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert {p["object"] for p in payloads} == {"chat.completion.chunk"}
    assert payloads[-1]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
    assert all("usage" not in p for p in payloads)  # only with stream_options.include_usage


def test_models_health_and_metrics(stack: Stack, sync_client: openai.OpenAI) -> None:
    models = sync_client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    assert sync_client.models.retrieve(MODEL_NAME).id == MODEL_NAME
    # vLLM's field, which clients read for the context they may fill: the checkpoint's positions
    assert models.data[0].model_extra == {"max_model_len": stack.state.max_positions}
    assert sync_client.models.retrieve(MODEL_NAME).model_extra == {"max_model_len": stack.state.max_positions}
    sync_client.completions.create(model=MODEL_NAME, prompt="to be", max_tokens=3, temperature=0)
    root = stack.base_url.removesuffix("/v1")
    health = httpx.get(f"{root}/health").json()
    assert health["status"] == "ok"
    assert httpx.get(f"{root}/version").json() == {"version": splitspec.__version__}
    assert health["sessions_active"] == 0
    metrics = httpx.get(f"{root}/metrics").text
    values = {
        line.split(" ")[0]: float(line.split(" ")[1])
        for line in metrics.splitlines()
        if line and not line.startswith("#")
    }
    assert values['splitspec_serve_requests_total{endpoint="/v1/completions",status="200"}'] >= 1
    assert values["splitspec_serve_completion_tokens_total"] >= 3
    assert values["splitspec_serve_time_to_first_token_seconds_count"] >= 1
    assert values['splitspec_serve_wire_bytes_total{direction="up"}'] > 0
    assert values['splitspec_serve_wire_bytes_total{direction="down"}'] > 0
    for part in ("network", "edge", "cloud", "serialize", "edge_queue", "cloud_queue"):
        assert values[f'splitspec_serve_step_milliseconds_count{{part="{part}"}}'] > 0
    assert "splitspec_serve_tokens_per_round_trip_count" in values
    assert "splitspec_serve_decode_tokens_per_second_count" in values
    assert values["splitspec_serve_edge_dear_drafters_held_back"] == 0.0  # one request: never gated
    assert values['splitspec_serve_edge_forwards_total{part="head",rows="1"}'] >= 1  # a lone request's forwards
    assert values['splitspec_serve_edge_forwards_total{part="tail",rows="1"}'] >= 1
    # the draft model's proposals run together in lockstep: two of them, as one run
    stack.state.engine.draft_executor.lockstep_log.observe(2, 3.0)
    metrics = httpx.get(f"{root}/metrics").text
    assert 'splitspec_serve_edge_forwards_total{part="draft",rows="2"} 1.0' in metrics
    assert 'splitspec_serve_edge_forward_milliseconds_total{part="draft",rows="2"} 3.0' in metrics
    # the engine's gate under load, as measured: 16 sequences, 100 tok/s with dear drafters, 150 without
    gate = stack.state.engine.draft_executor.gate
    gate.allows(16, -10.0)
    gate.delivered(200)
    gate.allows(16, -8.0)
    gate.delivered(300)
    gate.allows(16, -6.0)  # without them measured better: the epoch in progress holds them back
    metrics = httpx.get(f"{root}/metrics").text
    assert (
        'splitspec_serve_edge_dear_gate_tokens_per_second{dear_drafters="allowed",sequences_from="16"} 100.0' in metrics
    )
    assert (
        'splitspec_serve_edge_dear_gate_tokens_per_second{dear_drafters="held_back",sequences_from="16"} 150.0'
        in metrics
    )
    assert "splitspec_serve_edge_dear_drafters_held_back 1.0" in metrics
    stack.state.engine.draft_executor.gate = DearGate()  # the other tests' requests start from nothing measured


def test_speculation_estimates_are_shared_across_requests(stack: Stack, sync_client: openai.OpenAI) -> None:
    """The server's one controller learns from every request's session (link and model pair)."""
    controller = stack.state.controller
    assert controller is not None
    assert controller.drafters == ["ngram", "prompt-lookup", "mix"]
    sync_client.completions.create(model=MODEL_NAME, prompt="to be or not to be", max_tokens=8, temperature=0)
    assert controller.step_time(1) < 1.0  # measured (the unmeasured prior is 1 s per step)
    before = controller.value(None, 0)
    for prompt in ("that is the question", "class Split: pass"):
        sync_client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=8, temperature=0)
    assert controller.value(None, 0) != before  # later requests kept updating the same estimates


def test_chat_replies_end_at_the_templates_end_of_turn(stack: Stack) -> None:
    assert stack.state.chat_stop_ids == {SPECIALS.index("<|end|>")}
    assert stack.state.eos_token_ids == frozenset()  # completions run to their limit on this model
