"""Tool calls and structured outputs through ``splitspec serve`` and a real trunk server, with the
official ``openai`` client: forced calls (``required``, a named function) parsed into
``message.tool_calls``, streamed as OpenAI's deltas, a second turn carrying the result, and
``response_format`` json_schema output that validates (the ``jsonschema`` package)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam

from tests.serve.conftest import MODEL_NAME, Stack
from tests.serve.helpers import chat

WEATHER: ChatCompletionToolParam = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"type": "integer", "minimum": 1,
                                                                                  "maximum": 7}},
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}  # fmt: skip
ADD: ChatCompletionToolParam = {
    "type": "function",
    "function": {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer",
                 "minimum": 0, "maximum": 99}}, "required": ["a"], "additionalProperties": False}},
}  # fmt: skip
ASK: list[ChatCompletionMessageParam] = [{"role": "user", "content": "to be or not to be"}]
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}, "score": {"type": "integer", "minimum": 0, "maximum": 9},
                   "note": {"type": "string", "maxLength": 5}},
    "required": ["answer", "score", "note"],
    "additionalProperties": False,
}  # fmt: skip


@pytest.fixture(scope="module")
def client(tool_stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=tool_stack.base_url, api_key="unused", max_retries=0)


def arguments(call: Any) -> dict[str, Any]:
    value = json.loads(call.function.arguments)
    assert isinstance(value, dict)
    return value


def test_required_forces_a_valid_call_and_a_second_turn_completes(client: openai.OpenAI) -> None:
    reply = chat(client,
        model=MODEL_NAME, messages=ASK, tools=[WEATHER, ADD], tool_choice="required", max_tokens=80,
        temperature=0, parallel_tool_calls=False,
    )  # fmt: skip
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls or []
    assert len(calls) == 1
    call = calls[0]
    assert call.type == "function"
    assert call.id.startswith("call_")
    assert call.function.name in ("get_weather", "add")
    schema = (WEATHER if call.function.name == "get_weather" else ADD)["function"]["parameters"]
    jsonschema.validate(arguments(call), schema)
    assert choice.message.content is None
    history: list[ChatCompletionMessageParam] = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    second = chat(client, model=MODEL_NAME, messages=history, tools=[WEATHER, ADD], max_tokens=8,
                                            temperature=0)  # fmt: skip
    assert second.choices[0].finish_reason in ("stop", "length")
    assert second.usage is not None
    assert second.usage.prompt_tokens > reply.usage.prompt_tokens


def test_a_named_function_is_forced_and_streams_as_openai_deltas(client: openai.OpenAI) -> None:
    named = {"type": "function", "function": {"name": "add"}}
    whole = chat(client,
        model=MODEL_NAME, messages=ASK, tools=[WEATHER, ADD], tool_choice=named, max_tokens=60, temperature=0,
    )  # fmt: skip
    calls = whole.choices[0].message.tool_calls or []
    assert [c.function.name for c in calls] == ["add"]
    assert whole.choices[0].finish_reason == "stop"  # OpenAI's and vLLM's for a named function ("required": tool_calls)
    jsonschema.validate(arguments(calls[0]), ADD["function"]["parameters"])
    chunks = list(chat(client,
        model=MODEL_NAME, messages=ASK, tools=[WEATHER, ADD], tool_choice=named, max_tokens=60, temperature=0,
        stream=True,
    ))  # fmt: skip
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or []) if c.choices]
    assert deltas[0].index == 0
    assert deltas[0].id is not None
    assert deltas[0].type == "function"
    assert deltas[0].function is not None
    assert deltas[0].function.name == "add"
    assert all(d.id is None and d.function is not None and d.function.name is None for d in deltas[1:])
    assert "".join((d.function.arguments or "") for d in deltas if d.function) == calls[0].function.arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_a_reply_cut_after_a_complete_call_finishes_for_length(client: openai.OpenAI, tool_stack: Stack) -> None:
    """One call made, a second cut by max_tokens: "length" (vLLM's rule), not "tool_calls" (the reply did not end)."""
    one = chat(client, model=MODEL_NAME, messages=ASK, tools=[ADD], tool_choice="required", max_tokens=60,
               temperature=0, parallel_tool_calls=False)  # fmt: skip
    assert one.choices[0].finish_reason == "tool_calls"
    assert one.usage is not None
    ends = {str(t): -100 for t in tool_stack.state.chat_stop_ids}  # no end of turn: a second call must follow
    cut = chat(client, model=MODEL_NAME, messages=ASK, tools=[ADD], tool_choice="required",
               max_tokens=one.usage.completion_tokens + 4, temperature=0, logit_bias=ends)  # fmt: skip
    assert [c.function.name for c in cut.choices[0].message.tool_calls or []] == ["add"]
    assert cut.choices[0].finish_reason == "length"


def test_response_format_json_schema_validates_when_sampled(client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA, "strict": True}}
    reply = chat(client,
        model=MODEL_NAME, messages=ASK, response_format=fmt, max_tokens=60, temperature=1.0, n=20, seed=7,
    )  # fmt: skip
    assert [c.index for c in reply.choices] == list(range(20))
    texts = [c.message.content or "" for c in reply.choices]
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(set(texts)) > 1  # 20 independent draws
    assert reply.usage is not None
    # choice i is seeded with seed + i: the same as a one-choice request with that seed
    singles = [
        chat(client, model=MODEL_NAME, messages=ASK, response_format=fmt, max_tokens=60,
                                       temperature=1.0, seed=7 + i)
        for i in (0, 5)
    ]  # fmt: skip
    assert [s.choices[0].message.content for s in singles] == [texts[0], texts[5]]
    assert reply.usage.prompt_tokens == singles[0].usage.prompt_tokens
    assert reply.usage.completion_tokens > sum(s.usage.completion_tokens for s in singles)
    again = chat(client,
        model=MODEL_NAME, messages=ASK, response_format=fmt, max_tokens=60, temperature=1.0, n=20, seed=7,
    )  # fmt: skip
    assert [c.message.content for c in again.choices] == texts  # seed: reproducible


def test_json_object_composes_with_logit_bias(client: openai.OpenAI, tool_stack: Stack) -> None:
    # a random model nests objects without end; a bias on "}" closes it, and the grammar keeps it JSON
    url = tool_stack.base_url.removesuffix("/v1")
    braces = httpx.post(f"{url}/tokenize", json={"prompt": "{}", "add_special_tokens": False}, timeout=30).json()
    assert braces["count"] == 2  # "{" and "}" (not '{"', which would open a key)
    assert braces["max_model_len"] == 4096
    bias = {str(t): 100 for t in braces["tokens"]}
    obj = chat(client, model=MODEL_NAME, messages=ASK, response_format={"type": "json_object"},
                                         max_tokens=60, temperature=0, logit_bias=bias)  # fmt: skip
    assert obj.choices[0].finish_reason == "stop"
    assert obj.choices[0].message.content == "{}"
    assert isinstance(json.loads(obj.choices[0].message.content or ""), dict)
    cut = chat(client, model=MODEL_NAME, messages=ASK, response_format={"type": "json_object"}, max_tokens=5,
               temperature=0)  # fmt: skip
    assert cut.choices[0].finish_reason == "length"  # a document not finished within max_tokens
    assert cut.choices[0].message.content.startswith("{")
    assert cut.usage.completion_tokens == 5
    plain = chat(client, model=MODEL_NAME, messages=ASK, max_tokens=6, temperature=0,
                                           logit_bias=bias)  # fmt: skip
    assert set(plain.choices[0].message.content or "") <= set("{}")  # the bias alone, without a grammar
    assert plain.usage is not None
    assert plain.usage.completion_tokens == 6


@pytest.mark.parametrize("choice", ["auto", "none"])
def test_text_that_is_not_a_call_stays_content(client: openai.OpenAI, tool_stack: Stack, choice: str) -> None:
    # a bias makes the model open <tool_call> again and again: never valid JSON, never a 500
    tag = httpx.post(f"{tool_stack.base_url.removesuffix('/v1')}/tokenize",
                     json={"prompt": "<tool_call>", "add_special_tokens": False}, timeout=30).json()  # fmt: skip
    assert tag["count"] == 1
    reply = chat(client, model=MODEL_NAME, messages=ASK, tools=[WEATHER], tool_choice=choice, max_tokens=6,
                 temperature=0, logit_bias={str(tag["tokens"][0]): 100})  # fmt: skip
    message = reply.choices[0].message
    assert message.tool_calls is None
    assert message.content == "<tool_call>" * 6
    assert reply.choices[0].finish_reason == "length"


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools"),
        ({"tools": [{"type": "rpc", "function": {"name": "f"}}]}, "tools"),
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": [WEATHER]}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
         "response_format"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
          "properties": 5}}}], "tool_choice": "required"}, "tools"),
        ({"messages": [*ASK, {"role": "tool", "tool_call_id": "call_x", "content": "r"}]}, "messages"),
        ({"messages": [*ASK, {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
          "name": "add", "arguments": "{not json"}}]}]}, "messages"),
    ],
)  # fmt: skip
def test_bad_tool_and_format_values_are_named(tool_stack: Stack, change: dict[str, Any], param: str) -> None:
    body = {"model": MODEL_NAME, "messages": ASK, "max_tokens": 2, **change}
    response = httpx.post(f"{tool_stack.base_url}/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    err = response.json()["error"]
    assert err["param"] == param
    assert err["type"] == "invalid_request_error"
    fixed = {**body, "messages": ASK, "tools": None, "tool_choice": None, "response_format": None}
    ok = httpx.post(f"{tool_stack.base_url}/chat/completions", json=fixed, timeout=60)
    assert ok.status_code == 200, ok.text  # and the server keeps serving


@pytest.mark.parametrize("speculate", ["prompt-lookup", "ngram"])
def test_structured_output_is_whole_when_steps_verify_several_tokens(
    tool_model: Path, client: openai.OpenAI, speculate: str
) -> None:
    """A speculative step's tokens are all emitted: the grammar is complete after the step, not after its first
    token (the reply used to stop there, cut mid-object with finish_reason stop). The prompt holds the object's
    text, so the lookups draft whole runs of it, and the grammar's forced tokens are accepted together."""
    fmt = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA, "strict": True}}
    shown = json.dumps({"answer": "yes", "score": 3, "note": "ok"})
    ask: list[ChatCompletionMessageParam] = [{"role": "user", "content": f"{shown} {shown} {shown}"}]
    request: dict[str, Any] = dict(model=MODEL_NAME, messages=ask, response_format=fmt, max_tokens=60, temperature=0)
    alone = chat(client, **request)  # the shared stack (speculate auto over a 0 ms link)
    stack = Stack(tool_model, speculate=speculate)
    try:
        drafting = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0)
        reply = chat(drafting, **request)
        trips = stack.server.state.metrics.registry.get_sample_value("splitspec_serve_tokens_per_round_trip_sum")
    finally:
        stack.close()
    text = reply.choices[0].message.content or ""
    jsonschema.validate(json.loads(text), SCHEMA)
    assert text == alone.choices[0].message.content
    assert reply.usage is not None
    assert alone.usage is not None
    assert reply.usage.completion_tokens == alone.usage.completion_tokens
    assert reply.choices[0].finish_reason == "stop"
    assert trips is not None
    assert trips > 1  # the request's steps verified several tokens each, on average
