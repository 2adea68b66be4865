"""Bad requests get OpenAI-shaped errors with the right status codes, naming the parameter."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest

from tests.serve.conftest import MODEL_NAME, Stack


def post(stack: Stack, path: str, **kw: Any) -> httpx.Response:
    return httpx.post(f"{stack.base_url}{path}", timeout=60, **kw)


def error_of(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    return dict(body["error"])


CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "to be"}], "max_tokens": 4}


def test_malformed_json(stack: Stack) -> None:
    err = error_of(post(stack, "/chat/completions", content=b'{"model": "tiny-chat", "messages": [', headers={
        "content-type": "application/json"}), 400)  # fmt: skip
    assert err["type"] == "invalid_request_error"
    assert err["code"] == "invalid_json"


def test_unknown_model(stack: Stack) -> None:
    err = error_of(post(stack, "/chat/completions", json={**CHAT, "model": "gpt-4o"}), 404)
    assert err["code"] == "model_not_found"
    assert err["param"] == "model"
    assert "gpt-4o" in err["message"]
    client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="to be", max_tokens=2)


@pytest.mark.parametrize(
    ("path", "change", "param"),
    [
        ("/chat/completions", {"max_tokens": -1}, "max_tokens"),
        ("/chat/completions", {"max_completion_tokens": 0}, "max_completion_tokens"),
        ("/chat/completions", {"temperature": -0.5}, "temperature"),
        ("/chat/completions", {"top_p": 0}, "top_p"),
        ("/chat/completions", {"messages": []}, "messages"),
        ("/chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, "messages"),
        ("/chat/completions", {"stop": [chr(0x100 + i) for i in range(65)]}, "stop"),  # 64 at most
        ("/chat/completions", {"n": 0}, "n"),
        ("/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/chat/completions", {"presence_penalty": 2.5}, "presence_penalty"),
        ("/chat/completions", {"min_p": 1.5}, "min_p"),
        ("/chat/completions", {"bad_words": ["be", " "]}, "bad_words"),
        ("/chat/completions", {"bad_words": ["x"] * 129}, "bad_words"),
        ("/completions", {"prompt": "to be", "min_p": -0.1}, "min_p"),
        ("/chat/completions", {"repetition_penalty": 0}, "repetition_penalty"),
        ("/completions", {"prompt": "to be", "repetition_penalty": -1.2}, "repetition_penalty"),
        ("/chat/completions", {"logit_bias": {"to": 1}}, "logit_bias"),
        ("/chat/completions", {"logit_bias": {"5": 101}}, "logit_bias"),
        ("/chat/completions", {"logit_bias": {"99999": 1}}, "logit_bias"),
        ("/chat/completions", {"logit_bias": {"\u00b2": 1}}, "logit_bias"),  # a digit to str.isdigit, not to int()
        ("/completions", {"prompt": "to be", "logit_bias": {"9" * 4301: 1}}, "logit_bias"),  # int() refuses: a 500
        ("/chat/completions", {"seed": 2**64}, "seed"),  # torch's seeds are 64-bit: it took a session, then a 500
        ("/completions", {"prompt": "to be", "seed": -(2**63) - 1}, "seed"),
        ("/chat/completions", {"min_tokens": -1}, "min_tokens"),
        ("/chat/completions", {"stop_token_ids": [99999]}, "stop_token_ids"),
        ("/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
        ("/chat/completions", {"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
        ("/completions", {"prompt": [1, 2, 9999]}, "prompt"),
        ("/completions", {"prompt": [[1, 2], [9999]]}, "prompt"),
        ("/completions", {"prompt": []}, "prompt"),
        ("/completions", {"prompt": "to be", "logprobs": 21}, "logprobs"),
    ],
)
def test_invalid_values(stack: Stack, path: str, change: dict[str, Any], param: str) -> None:
    body = {**CHAT, **change} if path == "/chat/completions" else {"model": MODEL_NAME, "max_tokens": 2, **change}
    err = error_of(post(stack, path, json=body), 400)
    assert err["param"] == param
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("path", "extra", "param"),
    [
        ("/chat/completions", {"use_beam_search": True}, "use_beam_search"),
        ("/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
        ("/chat/completions", {"prediction": {"type": "content", "content": "to be"}}, "prediction"),
        ("/completions", {"best_of": 3}, "best_of"),
        ("/completions", {"suffix": "x"}, "suffix"),
    ],
)
def test_unsupported_parameters_are_named(stack: Stack, path: str, extra: dict[str, Any], param: str) -> None:
    base = CHAT if path == "/chat/completions" else {"model": MODEL_NAME, "prompt": "to be", "max_tokens": 2}
    err = error_of(post(stack, path, json={**base, **extra}), 400)
    assert err["param"] == param
    assert err["code"] == "unsupported_parameter"
    assert f"'{param}'" in err["message"]


def test_a_template_that_ignores_tools_is_named(stack: Stack) -> None:
    err = error_of(post(stack, "/chat/completions", json={
        **CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}), 400)  # fmt: skip
    assert err["param"] == "tools"
    assert err["code"] == "tools_unsupported"
    assert "ignores tools" in err["message"]


def test_unknown_fields_and_neutral_values_are_accepted(stack: Stack, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("DEBUG", logger="splitspec.serve.schemas"):
        response = post(stack, "/chat/completions", json={**CHAT, "frobnicate": 1, "store": False, "min_p": 0.0,
                                                          "metadata": {"a": "b"}})  # fmt: skip
    assert response.status_code == 200, response.text
    lines = [r.getMessage() for r in caplog.records if "unknown request fields" in r.getMessage()]
    assert lines == ["ignoring unknown request fields: frobnicate, metadata, store"]


def test_over_long_prompt(stack: Stack) -> None:
    long_prompt = list(range(10, 60)) * 82  # 4100 tokens: beyond the model's 4096 positions
    err = error_of(post(stack, "/completions", json={"model": MODEL_NAME, "prompt": long_prompt, "max_tokens": 4}), 400)
    assert err["code"] == "context_length_exceeded"
    assert err["param"] == "prompt"
    fits_but_not_with_completion = long_prompt[:4090]
    err = error_of(post(stack, "/completions", json={
        "model": MODEL_NAME, "prompt": fits_but_not_with_completion, "max_tokens": 10}), 400)  # fmt: skip
    assert err["code"] == "context_length_exceeded"
    assert "4100" in err["message"]


def test_an_empty_prompt_is_a_400_not_a_server_error(stack: Stack) -> None:
    assert stack.server.state.tokenizer.encode("") == []  # no BOS token added: "" encodes to nothing
    err = error_of(post(stack, "/completions", json={"model": MODEL_NAME, "prompt": "", "max_tokens": 4}), 400)
    assert err["param"] == "prompt"
    assert "empty" in err["message"]
    err = error_of(post(stack, "/completions", json={"model": MODEL_NAME, "prompt": ["the cat", ""]}), 400)
    assert err["param"] == "prompt"
    assert post(stack, "/completions", json={"model": MODEL_NAME, "prompt": "the cat", "max_tokens": 2}).is_success


def test_unknown_route_and_method(stack: Stack) -> None:
    assert error_of(post(stack, "/embeddings", json={}), 404)["code"] == "not_found"
    assert error_of(httpx.get(f"{stack.base_url}/chat/completions"), 405)["code"] == "method_not_allowed"


def test_requests_are_counted_by_route_not_by_url(make_stack: Callable[..., Stack]) -> None:
    """A scanner's 404s, or /v1/models/<any name>, used to make a metric series per URL, without bound."""
    s = make_stack()
    for i in range(5):
        assert httpx.get(f"{s.base_url}/probe-{i}").status_code == 404
        assert httpx.get(f"{s.base_url}/models/name-{i}").status_code == 404
    metrics = httpx.get(s.base_url.removesuffix("/v1") + "/metrics").text
    endpoints = {line.split('endpoint="')[1].split('"')[0] for line in metrics.splitlines()
                 if line.startswith("splitspec_serve_requests_total{")}  # fmt: skip
    assert endpoints == {"unmatched", "/v1/models/{model_id:path}"}


def test_wrong_api_key(make_stack: Callable[..., Stack]) -> None:
    s = make_stack(api_key="sesame")
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sesame"}):
        err = error_of(post(s, "/chat/completions", json=CHAT, headers=headers), 401)
        assert err["code"] == "invalid_api_key"
    assert httpx.get(f"{s.base_url}/models", headers={"Authorization": "Bearer x"}).status_code == 401
    # the key is checked before the body: a wrong key never learns whether its body was valid
    error_of(post(s, "/chat/completions", json={"model": "x"}, headers={"Authorization": "Bearer no"}), 401)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=s.base_url, api_key="wrong", max_retries=0).models.list()
    good = openai.OpenAI(base_url=s.base_url, api_key="sesame", max_retries=0)
    reply = good.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "to be"}], max_tokens=3, temperature=0
    )
    assert reply.usage is not None
    assert 1 <= reply.usage.completion_tokens <= 3


async def test_busy_pool_gets_429_with_retry_after(make_stack: Callable[..., Stack]) -> None:
    # the held generation must outlast two 0.3 s queue waits: 60 tokens took 0.7 s at 20 ms RTT on a quiet
    # machine (the test then failed), 2.8 s at 100 ms
    s = make_stack(rtt_ms=100.0, max_active=1, queue_timeout_s=0.3)
    client = openai.AsyncOpenAI(base_url=s.base_url, api_key="unused", max_retries=0)
    long = {"model": MODEL_NAME, "prompt": "to be", "max_tokens": 60, "temperature": 0}
    async with httpx.AsyncClient(timeout=60) as http:
        async with http.stream("POST", f"{s.base_url}/completions", json={**long, "stream": True}) as held:
            assert held.status_code == 200
            await asyncio.sleep(0.05)
            response = await http.post(f"{s.base_url}/completions", json={**long, "max_tokens": 2})
            err = error_of(response, 429)
            assert err["type"] == "rate_limit_error"
            assert int(response.headers["retry-after"]) >= 1
            with pytest.raises(openai.RateLimitError):
                await client.completions.create(model=MODEL_NAME, prompt="to be", max_tokens=2)
            async for _ in held.aiter_lines():
                pass
    reply = await client.completions.create(model=MODEL_NAME, prompt="to be", max_tokens=2)  # the slot is free again
    assert reply.usage is not None
    assert reply.usage.completion_tokens == 2
    await client.close()


def test_a_failure_of_our_own_is_openais_error_json_and_ends_a_stream_with_an_error_event(
    make_stack: Callable[..., Stack],
) -> None:
    """An exception that is no splitspec error (here the edge's tail forward fails, as a torch error would) was
    Starlette's plain-text 500, and a stream it hit stopped with neither an error event nor [DONE]."""
    s = make_stack()
    tail = s.server.state.engine._tail
    run_rows = tail.run_rows
    calls = {"left": 0}

    def failing(rows: list[Any]) -> Any:
        calls["left"] -= 1
        if calls["left"] == 0:
            raise RuntimeError("injected tail failure")
        return run_rows(rows)

    tail.run_rows = failing  # type: ignore[method-assign]
    request = {"model": MODEL_NAME, "prompt": "the cat sat", "max_tokens": 8, "temperature": 0.0}
    calls["left"] = 1  # the prefill's tail forward
    err = error_of(post(s, "/completions", json=request), 500)
    assert err["code"] == "internal_error"
    assert "injected tail failure" in err["message"]
    calls["left"] = 3  # a decode step, once tokens have streamed
    with httpx.stream("POST", f"{s.base_url}/completions", json={**request, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert '"code": "internal_error"' in events[-2] or '"code":"internal_error"' in events[-2]
    assert any('"text"' in e for e in events[:-2])  # tokens came before the failure
    calls["left"] = 0  # no more failures: the server serves on
    assert post(s, "/completions", json=request).is_success
