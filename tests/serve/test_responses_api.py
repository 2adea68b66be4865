"""``POST /v1/responses`` (OpenAI's Responses API): the request's translation into the chat request it means, and
through ``splitspec serve`` and a real trunk server with the official ``openai`` client: the reply equals the
chat endpoint's, streamed or not, forced function calls come back as ``function_call`` items, and a second turn
carries their output."""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import jsonschema
import openai
import pytest
from pydantic import ValidationError

from splitspec.serve.choices import Tally
from splitspec.serve.errors import CONTEXT_EXCEEDED, ApiError
from splitspec.serve.responses import (
    ResponsesRequest,
    chat_request,
    fitted,
    response_events,
    response_object,
    truncated,
    turns,
)
from splitspec.serve.schemas import ChatCompletionRequest
from splitspec.serve.tool_parsers import Event, ToolCall
from tests.serve.conftest import MODEL_NAME, Stack
from tests.serve.helpers import chat, tokenize
from tests.serve.test_tools_api import ADD, SCHEMA, WEATHER

FLAT_WEATHER: Any = {"type": "function", **WEATHER["function"]}  # the Responses API's tools are flat
FLAT_ADD: Any = {"type": "function", **ADD["function"]}


def translated(**request: Any) -> dict[str, Any]:
    return chat_request(ResponsesRequest.model_validate({"model": MODEL_NAME, **request})).model_dump(
        exclude_none=True, by_alias=True
    )


def test_instructions_input_tools_and_limits_become_the_chat_request() -> None:
    chat_body = translated(instructions="be brief", input="hello", max_output_tokens=7, temperature=0.5,
                           tools=[FLAT_WEATHER], tool_choice={"type": "function", "name": "get_weather"},
                           parallel_tool_calls=False, top_k=3, seed=9)  # fmt: skip
    assert [(m["role"], m["content"]) for m in chat_body["messages"]] == [("system", "be brief"), ("user", "hello")]
    assert (chat_body["max_tokens"], chat_body["temperature"], chat_body["top_k"], chat_body["seed"]) == (7, 0.5, 3, 9)
    assert chat_body["tools"] == [{"type": "function", "function": WEATHER["function"]}]
    assert chat_body["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert chat_body["parallel_tool_calls"] is False


def test_items_become_messages_and_calls_join_the_assistant_turn() -> None:
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "checking"}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call", "call_id": "c2", "name": "add", "arguments": '{"a": 1}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": "2"},
    ]
    messages = translated(input=items)["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "tool"]
    assert messages[0]["content"] == [{"type": "text", "text": "weather?"}]
    assert [c["id"] for c in messages[1]["tool_calls"]] == ["c1", "c2"]  # both calls on the one assistant turn
    assert messages[1]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    assert (messages[2]["tool_call_id"], messages[2]["content"]) == ("c1", "sunny")
    structured = translated(input="x", text={"format": {"type": "json_schema", "name": "r", "schema": SCHEMA}})
    assert structured["response_format"] == {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}}


@pytest.mark.parametrize(
    ("request_fields", "param", "says"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id", "stores no responses"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input (input_image)",
         "text only"),
        ({"tools": [{"type": "web_search"}]}, "tools (web_search)", "only function tools"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input (reasoning)", "items are"),
        ({"input": [{"type": "function_call", "call_id": "c"}]}, "input", "missing or mistyped"),
        ({"text": {"format": {"type": "xml"}}}, "text", "text.format must be"),
        ({"temperature": 5.0}, "temperature", "less than or equal to 2"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt", "change the reply"),
        ({"max_tool_calls": 1}, "max_tool_calls", "change the reply"),
        ({"background": True}, "background", "change the reply"),
        ({"max_output_tokens": 0}, "max_output_tokens", "greater than or equal to 1"),
    ],
)  # fmt: skip
def test_what_cannot_be_served_is_a_400_naming_the_field(request_fields: dict[str, Any], param: str, says: str) -> None:
    with pytest.raises((ApiError, ValidationError)) as caught:  # pydantic's: the Responses field itself is bad
        translated(**{"input": "hi", **request_fields})
    err = caught.value
    if isinstance(err, ApiError):
        assert (err.status, err.param) == (400, param)
        assert says in err.body()["error"]["message"]
    else:
        assert says in str(err)
        assert param in str(err)


@pytest.fixture(scope="module")
def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0)


def test_a_response_is_the_chat_reply_streamed_or_not(client: openai.OpenAI) -> None:
    ask = "to be or not"
    reference = chat(client, model=MODEL_NAME, messages=[{"role": "system", "content": "brief"},
                     {"role": "user", "content": ask}], max_tokens=12, temperature=0)  # fmt: skip
    whole = client.responses.create(model=MODEL_NAME, instructions="brief", input=ask, max_output_tokens=12,
                                    temperature=0)  # fmt: skip
    assert whole.output_text == reference.choices[0].message.content
    assert (whole.status, whole.incomplete_details and whole.incomplete_details.reason) == (
        "incomplete", "max_output_tokens")  # fmt: skip  # cut at 12 tokens, as the chat reply ("length")
    assert reference.choices[0].finish_reason == "length"
    assert whole.usage is not None
    assert (whole.usage.input_tokens, whole.usage.output_tokens) == (
        reference.usage.prompt_tokens, reference.usage.completion_tokens)  # fmt: skip
    assert whole.id.startswith("resp_")
    assert str(whole.output[0].id).startswith("msg_")
    assert whole.to_dict()["store"] is False  # nothing is kept
    deltas: list[str] = []
    with client.responses.stream(model=MODEL_NAME, instructions="brief", input=ask, max_output_tokens=12,
                                 temperature=0) as stream:  # fmt: skip
        kinds, final = [], None
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
            if event.type == "response.incomplete":  # OpenAI's last event for a reply cut by max_output_tokens
                final = event.response
    assert final is not None
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.incomplete"
    assert "".join(deltas) == final.output_text == whole.output_text
    assert [item.type for item in final.output] == ["message"]


def test_forced_calls_are_function_call_items_and_a_second_turn_answers(tool_stack: Stack) -> None:
    client = openai.OpenAI(base_url=tool_stack.base_url, api_key="unused", max_retries=0)
    ask = "to be or not to be"
    forced: dict[str, Any] = {"model": MODEL_NAME, "input": ask, "tools": [FLAT_WEATHER, FLAT_ADD],
                              "max_output_tokens": 80, "tool_choice": {"type": "function", "name": "get_weather"},
                              "temperature": 0}  # fmt: skip
    whole = client.responses.create(**forced)
    calls = [item for item in whole.output if item.type == "function_call"]
    assert len(calls) == 1
    assert calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["function"]["parameters"])
    assert whole.status == "completed"
    with client.responses.stream(**forced) as stream:
        added = [e.item.type for e in stream if e.type == "response.output_item.added"]
        streamed = stream.get_final_response()
    assert "function_call" in added
    streamed_calls = [item for item in streamed.output if item.type == "function_call"]
    assert [(c.name, c.arguments) for c in streamed_calls] == [(c.name, c.arguments) for c in calls]
    second = client.responses.create(
        model=MODEL_NAME, max_output_tokens=8, temperature=0, tools=[FLAT_WEATHER, FLAT_ADD],
        input=[{"role": "user", "content": ask}, calls[0].model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny, 21 C"}],
    )  # fmt: skip
    reference = chat(
        client, model=MODEL_NAME, max_tokens=8, temperature=0, tools=[WEATHER, ADD],
        messages=[{"role": "user", "content": ask},
                  {"role": "assistant", "content": None, "tool_calls": [{"id": calls[0].call_id, "type": "function",
                   "function": {"name": calls[0].name, "arguments": calls[0].arguments}}]},
                  {"role": "tool", "tool_call_id": calls[0].call_id, "content": "sunny, 21 C"}],
    )  # fmt: skip
    assert second.output_text == (reference.choices[0].message.content or "")


def test_a_bad_request_over_http_is_openais_error_object(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as missing:
        client.post("/responses", cast_to=object, body={"model": MODEL_NAME})  # no input
    assert missing.value.status_code == 400
    assert missing.value.param == "input"
    with pytest.raises(openai.BadRequestError) as stored:
        client.responses.create(model=MODEL_NAME, input="hi", previous_response_id="resp_x")
    assert stored.value.param == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="another-model", input="hi")
    with pytest.raises(openai.BadRequestError) as too_long:  # the chat request's 400 names the Responses field
        client.responses.create(model=MODEL_NAME, input="to be " * 5000)
    assert too_long.value.param == "input"
    with pytest.raises(openai.NotFoundError, match="stores no responses"):
        client.responses.retrieve("resp_x")
    with pytest.raises(openai.NotFoundError, match="stores no responses"):
        client.responses.delete("resp_x")


class ScriptedRunner:
    """A runner whose reply is given: text, calls and a finish reason, as ``Runner.events`` yields them."""

    def __init__(self, events: list[Event], finish: str) -> None:
        self.items = [SimpleNamespace(event=e, finish=None, tokens=[]) for e in events]
        self.items.append(SimpleNamespace(event=None, finish=finish, tokens=[]))
        self.tally = Tally(prompt=5, completion=9)

    async def events(self) -> AsyncIterator[Any]:
        for item in self.items:
            yield item


def streamed(events: list[Event], finish: str) -> list[dict[str, Any]]:
    body = ResponsesRequest.model_validate({"input": "hi"})
    response = response_object(body, "resp_1", 0, MODEL_NAME, chat_request(body))

    async def read() -> list[str]:
        return [line async for line in response_events(ScriptedRunner(events, finish), response)]  # type: ignore[arg-type]

    lines = asyncio.run(read())
    return [json.loads(line.split("data: ", 1)[1]) for line in lines]


@pytest.mark.parametrize(
    ("events", "finish", "kinds"),
    [
        ([Event("Let me "), Event("check."), Event(call=ToolCall("call_1", "add", '{"a": 1}')),
          Event(call=ToolCall("call_2", "add", '{"a": 2}'))], "tool_calls",
         ["message", "function_call", "function_call"]),
        ([], "stop", ["message"]),  # an empty reply: one empty message
        ([Event(call=ToolCall("call_1", "add", "{}")), Event("after")], "length", ["function_call", "message"]),
    ],
)  # fmt: skip
def test_the_stream_opens_and_closes_each_output_item_in_order(
    events: list[Event], finish: str, kinds: list[str]
) -> None:
    """Every item is added, fed and done at its own output_index, in order, with one id; the sequence numbers count
    from 0; the last event's response holds exactly the done items, with the usage and status."""
    payloads = streamed(events, finish)
    assert [p["sequence_number"] for p in payloads] == list(range(len(payloads)))
    assert [p["type"] for p in payloads[:2]] == ["response.created", "response.in_progress"]
    last = payloads[-1]
    assert last["type"] == ("response.incomplete" if finish == "length" else "response.completed")
    added = [p for p in payloads if p["type"] == "response.output_item.added"]
    done = [p for p in payloads if p["type"] == "response.output_item.done"]
    assert [p["output_index"] for p in added] == [p["output_index"] for p in done] == list(range(len(kinds)))
    assert [p["item"]["type"] for p in done] == kinds
    assert [p["item"]["id"] for p in added] == [p["item"]["id"] for p in done]
    assert last["response"]["output"] == [p["item"] for p in done]
    for p in payloads:
        if "item_id" in p:  # a delta or a done event belongs to the item open at its index
            assert p["item_id"] == done[p["output_index"]]["item"]["id"]
    text = "".join(e.content for e in events if e.call is None)
    message = next(p["item"] for p in done if p["item"]["type"] == "message")
    assert message["content"][0]["text"] == text
    calls = [p["item"] for p in done if p["item"]["type"] == "function_call"]
    assert [(c["call_id"], c["arguments"]) for c in calls] == [
        (e.call.id, e.call.arguments) for e in events if e.call is not None
    ]
    assert last["response"]["usage"]["output_tokens"] == 9


def test_included_logprobs_are_chats_streamed_or_not(client: openai.OpenAI) -> None:
    """``include: ["message.output_text.logprobs"]`` with ``top_logprobs``: the text's token logprobs are exactly
    the chat endpoint's for the same request, whole or streamed (the deltas' entries add up to the message's)."""
    ask = [{"role": "user", "content": "to be or not"}]
    reference = chat(client, model=MODEL_NAME, messages=ask, max_tokens=6, temperature=0, logprobs=True,
                     top_logprobs=2).choices[0].logprobs.content  # fmt: skip
    expected = [(e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs]) for e in reference]
    assert len(expected) == 6
    asked: dict[str, Any] = {"model": MODEL_NAME, "input": ask, "max_output_tokens": 6, "temperature": 0,
                             "include": ["message.output_text.logprobs"], "top_logprobs": 2}  # fmt: skip
    whole = client.responses.create(**asked)
    part = whole.to_dict()["output"][0]["content"][0]
    got = [(e["token"], e["logprob"], [(t["token"], t["logprob"]) for t in e["top_logprobs"]])
           for e in part["logprobs"]]  # fmt: skip
    assert got == expected
    deltas, done = [], None
    with client.responses.stream(**asked) as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                deltas += [(e.token, e.logprob) for e in event.logprobs]
            if event.type == "response.output_text.done":
                done = [(e.token, e.logprob) for e in event.logprobs]
    assert deltas == done == [(token, logprob) for token, logprob, _ in expected]
    plain = client.responses.create(**{**asked, "include": [], "top_logprobs": None})
    assert plain.to_dict()["output"][0]["content"][0]["logprobs"] == []  # not asked: none


def test_a_json_schema_text_format_constrains_the_reply(tool_stack: Stack) -> None:
    """``text.format`` json_schema (flat, as the Responses API has it) constrains sampled replies to the schema, and
    the same seed reproduces the chat endpoint's reply under the nested ``response_format``."""
    client = openai.OpenAI(base_url=tool_stack.base_url, api_key="unused", max_retries=0)
    ask = "to be or not to be"
    texts = [
        client.responses.create(model=MODEL_NAME, input=ask, max_output_tokens=60, temperature=1.0,
                                text={"format": {"type": "json_schema", "name": "verdict", "schema": SCHEMA,
                                                 "strict": True}}, extra_body={"seed": seed}).output_text
        for seed in (3, 4)
    ]  # fmt: skip
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
    nested = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA, "strict": True}}
    reference = chat(client, model=MODEL_NAME, messages=[{"role": "user", "content": ask}], response_format=nested,
                     max_tokens=60, temperature=1.0, seed=3)  # fmt: skip
    assert texts[0] == reference.choices[0].message.content


def conversation(turns_: int, words: int) -> list[dict[str, Any]]:
    """``turns_`` user/assistant turns of about ``words`` tokens each, after a system message."""
    out: list[dict[str, Any]] = [{"role": "system", "content": "brief"}]
    for k in range(turns_):
        out += [{"role": "user", "content": f"turn {k}: " + "to be " * (words // 2)},
                {"role": "assistant", "content": "or not"}]  # fmt: skip
    return out[:-1]  # ends on the last user message


def test_turns_start_at_user_messages_after_the_leading_system_ones() -> None:
    def chat_of(*roles: str) -> Any:
        messages = [{"role": r, "content": "x"} if r != "tool" else {"role": r, "content": "x", "tool_call_id": "c"}
                    for r in roles]  # fmt: skip
        return ChatCompletionRequest.model_validate({"model": MODEL_NAME, "messages": messages})

    chat_body = chat_of("system", "developer", "user", "assistant", "tool", "user", "system", "user")
    assert turns(chat_body.messages) == [2, 5, 7]
    assert [m.role for m in truncated(chat_body, 1).messages] == ["system", "developer", "user", "system", "user"]
    assert [m.role for m in truncated(chat_body, 2).messages] == ["system", "developer", "user"]
    assert turns(chat_of("system", "assistant", "user").messages) == [1, 2]  # what precedes the first user is a turn
    assert turns(chat_of("system").messages) == []
    for drop in (0, 3):
        with pytest.raises(ValueError, match="the last one stays"):
            truncated(chat_body, drop)


def test_auto_truncation_drops_the_fewest_oldest_turns() -> None:
    chat_body = ChatCompletionRequest.model_validate({"model": MODEL_NAME, "messages": conversation(9, 10)})
    tried: list[int] = []

    async def job_of(fits: int, body: ChatCompletionRequest) -> int:  # a prompt of at most ``fits`` turns fits
        tried.append(len(turns(body.messages)))
        if len(turns(body.messages)) > fits:
            raise ApiError(400, "too long", param="messages", code=CONTEXT_EXCEEDED)
        return len(body.messages)

    for fits in range(1, 10):
        tried.clear()
        kept, job = asyncio.run(fitted(chat_body, True, functools.partial(job_of, fits)))
        assert len(turns(kept.messages)) == fits  # the fewest turns dropped
        assert kept.messages[-1] == chat_body.messages[-1]
        assert job == len(kept.messages)
        assert len(tried) <= 5  # bisected: 1 + ceil(log2(8)) + 1 tries at most
    with pytest.raises(ApiError, match="too long"):  # without truncation, or when only the last turn would not fit
        asyncio.run(fitted(chat_body, False, functools.partial(job_of, 5)))
    with pytest.raises(ApiError, match="too long"):
        asyncio.run(fitted(chat_body, True, functools.partial(job_of, 0)))

    async def other(body: ChatCompletionRequest) -> int:
        raise ApiError(400, "bad tools", param="tools")

    with pytest.raises(ApiError, match="bad tools"):  # another 400 is not a reason to drop turns
        asyncio.run(fitted(chat_body, True, other))


def test_auto_truncation_answers_as_chat_does_on_the_turns_that_fit(stack: Stack, client: openai.OpenAI) -> None:
    """A conversation over the model's 4,096 positions: a 400 naming ``input`` without truncation; with
    ``truncation: "auto"`` exactly the chat endpoint's reply to the conversation without its fewest oldest turns
    whose prompt and ``max_output_tokens`` fit (counted here with the server's /tokenize)."""
    messages = conversation(12, 400)

    def prompt_tokens(kept: list[dict[str, Any]]) -> int:
        return len(tokenize(stack, {"messages": kept}))

    def without(drop: int) -> list[dict[str, Any]]:
        return [messages[0], *messages[1 + 2 * drop :]]

    limit = 4096 - 8
    assert prompt_tokens(messages) > limit
    drop = next(k for k in range(12) if prompt_tokens(without(k)) <= limit)
    assert drop >= 2
    items: Any = [{"type": "message", **m} for m in messages[1:]]
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=MODEL_NAME, instructions="brief", input=items, max_output_tokens=8)
    assert refused.value.param == "input"
    whole = client.responses.create(model=MODEL_NAME, instructions="brief", input=items, max_output_tokens=8,
                                    temperature=0, truncation="auto")  # fmt: skip
    reference = chat(client, model=MODEL_NAME, messages=without(drop), max_tokens=8, temperature=0)
    assert whole.truncation == "auto"
    assert whole.output_text == reference.choices[0].message.content
    assert whole.usage is not None
    assert whole.usage.input_tokens == reference.usage.prompt_tokens == prompt_tokens(without(drop))
