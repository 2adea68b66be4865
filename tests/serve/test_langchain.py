"""LangChain's ``ChatOpenAI(...).bind_tools([...])`` against ``splitspec serve`` and a real trunk: a
forced call parsed into name and arguments, the same call streamed as deltas, and a second turn
carrying the tool's result."""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest
from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage, ToolMessage
from langchain_openai import ChatOpenAI

from tests.serve.conftest import MODEL_NAME, Stack
from tests.serve.test_tools_api import ADD, WEATHER

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def llm(tool_stack: Stack) -> ChatOpenAI:
    return ChatOpenAI(model=MODEL_NAME, base_url=tool_stack.base_url, api_key="unused",  # type: ignore[arg-type]
                      temperature=0, max_completion_tokens=80, max_retries=0)  # fmt: skip


TOOLS: list[dict[str, Any]] = [dict(WEATHER), dict(ADD)]  # as LangChain types them


def schema_of(name: str) -> dict[str, Any]:
    tool = WEATHER if name == "get_weather" else ADD
    return dict(tool["function"]["parameters"])


def test_bind_tools_required_gets_a_call_and_a_second_turn(llm: ChatOpenAI) -> None:
    # one call: a random model goes on calling until max_tokens cuts it, and a cut reply finishes for "length"
    bound = llm.bind_tools(TOOLS, tool_choice="required", parallel_tool_calls=False)
    ask = [HumanMessage("to be or not to be")]
    reply = bound.invoke(ask)
    assert isinstance(reply, AIMessage)
    assert len(reply.tool_calls) >= 1
    call = reply.tool_calls[0]
    assert call["name"] in ("get_weather", "add")
    jsonschema.validate(call["args"], schema_of(call["name"]))
    assert call["id"]
    assert reply.response_metadata["finish_reason"] == "tool_calls"
    results = [ToolMessage("sunny, 21 C", tool_call_id=str(c["id"])) for c in reply.tool_calls]
    second = llm.bind_tools(TOOLS).invoke([*ask, reply, *results], max_tokens=8)
    assert isinstance(second, AIMessage)
    assert second.response_metadata["finish_reason"] in ("stop", "length")
    assert not second.tool_calls


def test_a_named_tool_is_forced_and_streams_to_the_same_call(llm: ChatOpenAI) -> None:
    bound = llm.bind_tools(TOOLS, tool_choice="get_weather")
    reply = bound.invoke("whether tis nobler")
    assert [c["name"] for c in reply.tool_calls] == ["get_weather"]
    jsonschema.validate(reply.tool_calls[0]["args"], schema_of("get_weather"))
    chunks = list(bound.stream("whether tis nobler"))
    assert len(chunks) > 2
    full = chunks[0]
    for chunk in chunks[1:]:
        full += chunk  # type: ignore[assignment]  # LangChain's chunk addition is typed loosely
    assert isinstance(full, AIMessageChunk)
    assert [(c["name"], c["args"]) for c in full.tool_calls] == [(c["name"], c["args"]) for c in reply.tool_calls]


def test_the_responses_api_gets_the_forced_call_and_a_second_turn(tool_stack: Stack) -> None:
    """``ChatOpenAI(use_responses_api=True)``: the same forced call over ``/v1/responses``, streamed or not, and
    a second turn whose history LangChain sends as function_call and function_call_output items."""
    llm = ChatOpenAI(model=MODEL_NAME, base_url=tool_stack.base_url, api_key="unused",  # type: ignore[arg-type]
                     temperature=0, max_completion_tokens=80, max_retries=0, use_responses_api=True)  # fmt: skip
    bound = llm.bind_tools(TOOLS, tool_choice="get_weather")
    reply = bound.invoke("whether tis nobler")
    assert isinstance(reply, AIMessage)
    assert [c["name"] for c in reply.tool_calls] == ["get_weather"]
    jsonschema.validate(reply.tool_calls[0]["args"], schema_of("get_weather"))
    chunks = list(bound.stream("whether tis nobler"))
    full = chunks[0]
    for chunk in chunks[1:]:
        full += chunk  # type: ignore[assignment]  # LangChain's chunk addition is typed loosely
    assert isinstance(full, AIMessageChunk)
    assert [(c["name"], c["args"]) for c in full.tool_calls] == [(c["name"], c["args"]) for c in reply.tool_calls]
    results = [ToolMessage("sunny, 21 C", tool_call_id=str(c["id"])) for c in reply.tool_calls]
    second = llm.bind_tools(TOOLS).invoke([HumanMessage("whether tis nobler"), reply, *results], max_tokens=8)
    assert isinstance(second, AIMessage)
    assert not second.tool_calls
    assert isinstance(second.text, str)
