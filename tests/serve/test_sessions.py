"""Sessions: concurrency, client disconnects, a trunk that dies and comes back."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import openai
import pytest
import torch
from starlette.requests import Request
from transformers import AutoTokenizer

from splitspec.detokenize import CONTEXT_TOKENS, text_after
from tests.conftest import local_model
from tests.serve.conftest import MODEL_NAME, Stack
from tests.serve.helpers import generate_cli

PROMPTS = [
    "to be or not", "that is the question", "whether tis nobler", "in the mind to suffer",
    "def main(): return", "for x in range(10):", "class Split: pass", "yield x print(value)",
]  # fmt: skip


async def test_eight_concurrent_streams_are_correct_and_independent(stack: Stack, chat_model: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(chat_model, local_files_only=True)
    model = local_model(chat_model)
    expected = []
    generate: Callable[..., torch.Tensor] = model.generate  # type: ignore[assignment]  # typed as a Tensor

    def decode(part: list[int]) -> str:
        return str(tokenizer.decode(part, skip_special_tokens=True))

    for p in PROMPTS:  # the whole model, locally, one prompt at a time
        ids = tokenizer.encode(p)
        with torch.no_grad():
            out = generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, pad_token_id=0)
        expected.append(text_after(decode, ids[-CONTEXT_TOKENS:], out[0, len(ids) :].tolist()))  # a continuation
    assert len(set(expected)) == len(PROMPTS)
    client = openai.AsyncOpenAI(base_url=stack.base_url, api_key="unused", max_retries=0)
    live = 0
    peak = 0

    async def one(prompt: str) -> str:
        nonlocal live, peak
        stream = await client.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=12, temperature=0, stream=True
        )
        live += 1
        peak = max(peak, live)
        text = "".join([c.choices[0].text async for c in stream])
        live -= 1
        return text

    got = await asyncio.gather(*(one(p) for p in PROMPTS))
    await client.close()
    assert got == expected
    assert peak > 1  # the streams did overlap


@pytest.mark.parametrize("n", [1, 3])
async def test_disconnect_mid_stream_frees_the_cloud_session(make_stack: Callable[..., Stack], n: int) -> None:
    s = make_stack(rtt_ms=20.0, prefix_cache_entries=0)  # 400 tokens at 20 ms each would take > 8 s
    body = {"model": MODEL_NAME, "prompt": "to be", "max_tokens": 400, "temperature": 0, "stream": True, "n": n}
    async with httpx.AsyncClient(timeout=60) as http:
        async with http.stream("POST", f"{s.base_url}/completions", json=body) as response:
            lines = response.aiter_lines()
            for _ in range(6):
                await anext(lines)
            assert s.trunk_sessions() == 1
            assert s.state.pool.active == 1
            t0 = time.monotonic()
    while s.trunk_sessions() and time.monotonic() - t0 < 5:
        await asyncio.sleep(0.02)
    freed_after = time.monotonic() - t0
    assert s.trunk_sessions() == 0, "the trunk still holds the abandoned session"
    assert freed_after < 2.0
    assert s.state.pool.active == 0
    await asyncio.sleep(0.3)
    assert s.trunk_sessions() == 0  # n > 1: no later choice was started for the client that left


def test_trunk_restart_during_a_request_recovers_identically(
    make_stack: Callable[..., Stack], chat_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    s = make_stack(rtt_ms=10.0, speculate="off")
    prompt = "to be or not to be"
    expected = generate_cli(capsys, chat_model, f"ws://127.0.0.1:{s.trunk_port}", prompt, 40)["visible_text"]
    client = openai.OpenAI(base_url=s.base_url, api_key="unused", max_retries=0)
    stream = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=40, temperature=0, stream=True)
    pieces = []
    for i, chunk in enumerate(stream):
        pieces.append(chunk.choices[0].text)
        if i == 5:  # mid-request: the trunk dies (its sessions with it) and comes back
            s.call(s.stop_trunk())
            s.call(s.start_trunk())
    assert "".join(pieces) == expected
    assert chunk.choices[0].finish_reason == "length"
    metrics = httpx.get(f"{s.base_url.removesuffix('/v1')}/metrics").text
    assert "splitspec_serve_recoveries_total 1.0" in metrics


def test_unreachable_trunk_is_503_then_recovers(make_stack: Callable[..., Stack]) -> None:
    s = make_stack()
    client = openai.OpenAI(base_url=s.base_url, api_key="unused", max_retries=0)
    first = client.completions.create(model=MODEL_NAME, prompt="to be", max_tokens=3, temperature=0)
    s.call(s.stop_trunk())  # the idle session kept by the first request now points at nothing
    body = {"model": MODEL_NAME, "prompt": "to be", "max_tokens": 3, "temperature": 0}
    for stream in (False, True):  # the kept session, then a new one: neither reaches the trunk
        response = httpx.post(f"{s.base_url}/completions", json={**body, "stream": stream}, timeout=30)
        assert response.status_code == 503, response.text
        err = response.json()["error"]
        assert err["code"] == "trunk_unreachable"
        assert "unreachable" in err["message"]
    root = s.base_url.removesuffix("/v1")
    assert 'splitspec_serve_errors_total{type="trunk_unreachable"} 2.0' in httpx.get(f"{root}/metrics").text
    assert httpx.get(f"{root}/health").json()["status"] == "ok"  # still serving
    s.call(s.start_trunk())
    again = client.completions.create(model=MODEL_NAME, prompt="to be", max_tokens=3, temperature=0)
    assert again.choices[0].text == first.choices[0].text


def test_only_a_non_streamed_generation_asks_the_connection_whether_its_client_left(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stream's response watches its connection itself; a non-streamed generation polls it between tokens."""
    asked = []
    is_disconnected = Request.is_disconnected

    async def counting(self: Request) -> bool:
        asked.append(self.url.path)
        return await is_disconnected(self)

    monkeypatch.setattr(Request, "is_disconnected", counting)
    body = {"model": MODEL_NAME, "prompt": "to be", "max_tokens": 8, "temperature": 0}
    streamed = httpx.post(f"{stack.base_url}/completions", json={**body, "stream": True}, timeout=60)
    assert streamed.status_code == 200
    assert "[DONE]" in streamed.text
    assert asked == []
    whole = httpx.post(f"{stack.base_url}/completions", json=body, timeout=60)
    assert whole.status_code == 200
    assert asked
    assert set(asked) == {"/v1/completions"}
