"""OpenAI's Responses API (``POST /v1/responses``) on the chat path.

Agent frameworks default to it now (the OpenAI Agents SDK, ``langchain-openai`` with
``use_responses_api``, Codex-style clients), and vLLM serves it. A request is translated into the
Chat Completions request it means (:func:`chat_request`: ``instructions`` become the system message,
``input`` items the messages, flat function tools the nested ones, ``max_output_tokens`` the
``max_tokens``, ``text.format`` the ``response_format``), runs exactly as that chat request runs
(template, tool-call parsing, grammars, sampling defaults), and its one choice is rendered as the
Responses stream's typed events (:func:`response_events`) or, unstreamed, as the ``response`` object
those events end with (:func:`whole_response`: one code path, so both give the same items).
``include: ["message.output_text.logprobs"]`` (with ``top_logprobs``) adds chat's token logprobs.

The server keeps no responses: ``previous_response_id`` and ``conversation`` are a 400 (send the whole
conversation in ``input``), and a response says ``"store": false``. ``truncation: "auto"`` drops the
conversation's oldest turns (a user message and what follows it, up to the next; the system messages
before the first stay) until the prompt and ``max_output_tokens`` fit the context (:func:`truncated`),
as OpenAI drops items from the beginning; ``"disabled"`` (the default) answers a prompt that does not
fit with a 400. Tools other than functions,
input images and files, and the fields in :data:`REFUSED` are a 400 naming the field. ``reasoning``
and the other ``include`` entries are read and ignored: no model served here reasons in a separate
channel, and no other extra output is produced.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from splitspec.decoding.loop import Emitted
from splitspec.serve import schemas
from splitspec.serve.choices import Runner
from splitspec.serve.errors import CONTEXT_EXCEEDED, ApiError, internal_error, invalid, unsupported
from splitspec.serve.logprobs import chat_logprobs, triples
from splitspec.serve.schemas import ChatCompletionRequest

log = logging.getLogger(__name__)

# chat request fields (vLLM's extensions and the sampling ones) a Responses request may send as they are
PASSED_THROUGH = ("top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "min_tokens", "presence_penalty",
                  "frequency_penalty", "repetition_penalty", "logit_bias", "chat_template_kwargs")  # fmt: skip
# Responses fields that would change the reply but are not honoured, with the values that change nothing (anything
# else is a 400 naming the field, as chat's REFUSED): a stored prompt template by id, a cap on tool calls, a
# response run in the background to be polled for
REFUSED: dict[str, tuple[object, ...]] = {"prompt": (None,), "max_tool_calls": (None,), "background": (None, False)}
# chat request fields and the Responses fields they are made from, where the names differ
CHAT_FIELDS = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text"}
LOGPROBS = "message.output_text.logprobs"  # the ``include`` entry that asks for the text's token logprobs
T = TypeVar("T")

# the logprob entries of generated tokens ({"token", "logprob", "bytes", "top_logprobs"}, chat's shape)
Logprobs = Callable[[Sequence[Emitted]], list[dict[str, Any]]]


def item_id(prefix: str) -> str:
    """A Responses id as OpenAI writes them: ``resp_``, ``msg_``, ``fc_`` and 32 hex digits."""
    return f"{prefix}_{uuid.uuid4().hex}"


def logprob_entries(token_bytes: Callable[[int], bytes]) -> Logprobs:
    """Chat's logprob entries of generated tokens: the Responses API's ``output_text`` logprobs have their shape."""
    return lambda tokens: list(chat_logprobs(triples(tokens), token_bytes)["content"])


class ResponsesRequest(BaseModel):
    """The Responses API's request (the fields that shape the reply; unknown ones are ignored, as on chat)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None  # None: the served model
    input: str | list[dict[str, Any]]  # a user message, or the conversation's items
    instructions: str | None = None  # the system message, before the input
    tools: list[dict[str, Any]] | None = None  # {"type": "function", "name", "description", "parameters", ...}
    tool_choice: str | dict[str, Any] | None = None  # "auto", "none", "required", {"type": "function", "name"}
    parallel_tool_calls: bool | None = None
    temperature: float | None = None  # None: the server's default (generation_config.json under auto)
    top_p: float | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)  # None: the server's default max_tokens
    include: list[str] | None = None  # with "message.output_text.logprobs": the text's token logprobs
    top_logprobs: int | None = Field(default=None, ge=0, le=schemas.MAX_TOP_LOGPROBS)  # alternatives per token
    text: dict[str, Any] | None = None  # {"format": {"type": "text" | "json_object" | "json_schema", ...}}
    stream: bool = False
    store: bool | None = None  # nothing is stored whatever it says: responses carry "store": false
    previous_response_id: str | None = None  # refused: no response is kept to continue from
    conversation: str | dict[str, Any] | None = None  # refused, as previous_response_id
    metadata: dict[str, str] | None = None  # echoed back
    user: str | None = None
    truncation: Literal["auto", "disabled"] | None = None  # auto: drop the oldest turns to fit; None: disabled


def _text(content: Any, where: str) -> str | list[dict[str, str]]:
    """A message's content as chat takes it: the string, or its text parts (images and files: a 400)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"{where}.content must be a string or a list of content parts", "input")
    parts = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind in ("input_image", "input_file", "input_audio"):
            raise unsupported(f"input ({kind})", "this server's models read text only")
        else:
            raise invalid(f"{where}.content[{k}] must be a text part (input_text or output_text)", "input")
    return parts


def _messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The chat messages ``instructions`` and ``input`` mean: calls join the assistant message before them."""
    messages: list[dict[str, Any]] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        return [*messages, {"role": "user", "content": body.input}]
    for k, item in enumerate(body.input):
        where = f"input[{k}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message" and item.get("role") in ("user", "system", "developer", "assistant"):
            messages.append({"role": item["role"], "content": _text(item.get("content"), where)})
        elif kind == "function_call" and all(isinstance(item.get(f), str) for f in ("call_id", "name", "arguments")):
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}  # fmt: skip
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output" and isinstance(item.get("call_id"), str):
            output = item.get("output")
            content = _text(output, where) if output is not None else None
            if content is None:
                raise invalid(f"{where}.output must be a string or a list of text parts", "input")
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": content})
        elif kind in ("message", "function_call", "function_call_output"):
            raise invalid(f"{where} is a {kind} item with a missing or mistyped field", "input")
        else:
            raise unsupported(f"input ({kind})", "items are messages, function calls and their outputs")
    return messages


def _tools(body: ResponsesRequest) -> dict[str, Any]:
    """``tools`` and ``tool_choice`` in chat's nested form (tools other than functions: a 400)."""
    out: dict[str, Any] = {}
    if body.tools is not None:
        nested = []
        for tool in body.tools:
            if tool.get("type") != "function":
                raise unsupported(f"tools ({tool.get('type')})", "only function tools are")
            nested.append({"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}})
        out["tools"] = nested
    choice = body.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise unsupported("tool_choice", 'it may be "auto", "none", "required" or {"type": "function", "name"}')
        choice = {"type": "function", "function": {"name": choice["name"]}}
    if choice is not None:
        out["tool_choice"] = choice
    return out


def _response_format(body: ResponsesRequest) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format`` (its json_schema is flat, chat's nested)."""
    fmt = (body.text or {}).get("format")
    if fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text"):
        return None
    if isinstance(fmt, dict) and fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        inner = {k: v for k, v in fmt.items() if k in ("name", "description", "schema", "strict")}
        return {"type": "json_schema", "json_schema": inner}
    raise invalid('text.format must be {"type": "text"}, {"type": "json_object"} or a json_schema format', "text")


def chat_request(body: ResponsesRequest) -> ChatCompletionRequest:
    """The Chat Completions request ``body`` means; a 400 names the Responses field at fault."""
    for name in ("previous_response_id", "conversation"):
        if getattr(body, name) is not None:
            raise unsupported(name, "this server stores no responses: send the whole conversation in input")
    chat: dict[str, Any] = {
        "model": body.model,
        "messages": _messages(body),
        **_tools(body),
        "max_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "parallel_tool_calls": body.parallel_tool_calls,
        "response_format": _response_format(body),
        "user": body.user,
    }
    if LOGPROBS in (body.include or []) or body.top_logprobs is not None:
        chat.update(logprobs=True, top_logprobs=body.top_logprobs or 0)
    extra = body.model_extra or {}
    for name, neutral in REFUSED.items():
        if extra.get(name) not in neutral:
            raise unsupported(name, "it would change the reply")
    chat.update({key: extra[key] for key in PASSED_THROUGH if key in extra})
    ignored = sorted(set(extra) - set(PASSED_THROUGH) - set(REFUSED))
    if ignored:
        log.debug("responses: ignoring fields %s", ", ".join(ignored))
    try:
        return ChatCompletionRequest.model_validate(chat)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise invalid(f"{where}: {first.get('msg', 'invalid')}", responses_param(where.split(".")[0] or None)) from None


def turns(messages: Sequence[Any]) -> list[int]:
    """Where each turn of a conversation starts (indices into ``messages``): its leading system and developer
    messages are no turn; a turn runs from one user message to the next (what comes before the first user message,
    after them, is one turn too)."""
    start = next((i for i, m in enumerate(messages) if m.role not in ("system", "developer")), len(messages))
    users = [i for i in range(start + 1, len(messages)) if messages[i].role == "user"]
    return [start, *users] if start < len(messages) else []


def truncated(chat: ChatCompletionRequest, drop: int) -> ChatCompletionRequest:
    """``chat`` without its ``drop`` oldest turns (:func:`turns`; the leading system messages stay)."""
    starts = turns(chat.messages)
    if not 0 < drop < len(starts):
        raise ValueError(f"{drop} turns of {len(starts)} cannot be dropped (the last one stays)")
    kept = chat.messages[: starts[0]] + chat.messages[starts[drop] :]
    return chat.model_copy(update={"messages": kept})


async def fitted(
    chat: ChatCompletionRequest, truncate: bool, job_of: Callable[[ChatCompletionRequest], Awaitable[T]]
) -> tuple[ChatCompletionRequest, T]:
    """``chat`` and its job (``job_of``, a 400 for a prompt that does not fit); with ``truncate``, one that does not
    fit drops its fewest oldest turns that make it fit (bisected: fewer turns, fewer tokens), or is the first
    attempt's 400 if only its last turn would not."""
    try:
        return chat, await job_of(chat)
    except ApiError as err:
        if not truncate or err.code != CONTEXT_EXCEEDED:
            raise
        refusal = err
    found: tuple[ChatCompletionRequest, T] | None = None
    count = len(turns(chat.messages))
    low, high = 1, count - 1  # the turns that may go
    while low <= high:
        drop = (low + high) // 2
        shorter = truncated(chat, drop)
        try:
            found = shorter, await job_of(shorter)
            high = drop - 1
        except ApiError as err:
            if err.code != CONTEXT_EXCEEDED:
                raise
            low = drop + 1
    if found is None:
        raise refusal
    log.info("truncation auto: dropped the oldest %d of %d turns", low, count)
    return found


def responses_param(chat_param: str | None) -> str | None:
    """The Responses field a chat request's field came from (a 400 on the chat request names it)."""
    return CHAT_FIELDS.get(chat_param or "", chat_param)


def _usage(use: dict[str, Any]) -> dict[str, Any]:
    return {
        "input_tokens": use["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": use["prompt_tokens_details"]["cached_tokens"]},
        "output_tokens": use["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": use["total_tokens"],
    }


def _message_item(
    item_id: str, text: str, status: Literal["in_progress", "completed"], logprobs: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    content = [] if status == "in_progress" else [_text_part(text, logprobs)]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def _text_part(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}  # fmt: skip


def response_object(
    body: ResponsesRequest, rid: str, created: int, model: str, chat: ChatCompletionRequest
) -> dict[str, Any]:
    """The ``response`` object, in progress (no output, no usage): the stream's first events carry it."""
    return {
        "id": rid,
        "object": "response",
        "created_at": created,
        "status": "in_progress",
        "error": None,
        "incomplete_details": None,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "model": model,
        "output": [],
        "parallel_tool_calls": chat.parallel_tool_calls is not False,
        "previous_response_id": None,
        "reasoning": {"effort": None, "summary": None},
        "store": False,
        "temperature": body.temperature,
        "text": {"format": (body.text or {}).get("format") or {"type": "text"}},
        "tool_choice": body.tool_choice or "auto",
        "tools": body.tools or [],
        "top_p": body.top_p,
        "truncation": body.truncation or "disabled",
        "usage": None,
        "user": body.user,
        "metadata": body.metadata or {},
    }


def finished(response: dict[str, Any], output: list[dict[str, Any]], finish: str, use: dict[str, Any]) -> None:
    """``response`` done: its output, status (a reply cut by the token limit is ``incomplete``) and usage."""
    response["output"] = output
    response["usage"] = _usage(use)
    if finish == "length":
        response["status"] = "incomplete"
        response["incomplete_details"] = {"reason": "max_output_tokens"}
    else:
        response["status"] = "completed"


async def _events(
    runner: Runner, response: dict[str, Any], logprobs: Logprobs | None
) -> AsyncIterator[tuple[str, dict[str, Any]]]:
    """The reply as the Responses stream's events, (type, fields), the last one carrying ``response`` done (a
    failure raises). Items in order: a message when text comes (closed before a call, and one empty message for an
    empty reply), each function call whole. With ``logprobs``, each text delta carries its tokens' entries and the
    message all of them (the tokens after its last text, an end of turn, included), as chat's logprobs."""
    output: list[dict[str, Any]] = []
    message: dict[str, Any] | None = None  # the message item whose text is streaming
    text, entries = "", list[dict[str, Any]]()  # its text and its tokens' logprobs so far
    finish = "stop"

    def logprobs_of(tokens: Sequence[Emitted]) -> list[dict[str, Any]]:
        return logprobs(tokens) if logprobs is not None and tokens else []

    def open_text() -> tuple[dict[str, Any], list[tuple[str, dict[str, Any]]]]:
        item = _message_item(item_id("msg"), "", "in_progress")
        at = {"item_id": item["id"], "output_index": len(output), "content_index": 0}
        return item, [("response.output_item.added", {"output_index": len(output), "item": item}),
                      ("response.content_part.added", {**at, "part": _text_part("")})]  # fmt: skip

    def close_text(item: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        done = _message_item(item["id"], text, "completed", entries)
        at = {"item_id": done["id"], "output_index": len(output), "content_index": 0}
        events = [("response.output_text.done", {**at, "text": text, "logprobs": entries}),
                  ("response.content_part.done", {**at, "part": _text_part(text, entries)}),
                  ("response.output_item.done", {"output_index": len(output), "item": done})]  # fmt: skip
        output.append(done)
        return events

    yield "response.created", {"response": response}
    yield "response.in_progress", {"response": response}
    async for item in runner.events():
        if item.event is not None and item.event.call is not None:
            if message is not None:
                for kind, fields in close_text(message):
                    yield kind, fields
                message, text, entries = None, "", []
            call = item.event.call
            fc = _call_item(item_id("fc"), call.id, call.name, "", "in_progress")
            at = {"item_id": fc["id"], "output_index": len(output)}
            yield "response.output_item.added", {"output_index": len(output), "item": fc}
            yield "response.function_call_arguments.delta", {**at, "delta": call.arguments}
            yield "response.function_call_arguments.done", {**at, "arguments": call.arguments}
            fc = {**fc, "arguments": call.arguments, "status": "completed"}
            yield "response.output_item.done", {"output_index": len(output), "item": fc}
            output.append(fc)
        elif item.event is not None and item.event.content:
            if message is None:
                message, opening = open_text()
                for kind, fields in opening:
                    yield kind, fields
            text += item.event.content
            fresh = logprobs_of(item.tokens)
            entries += fresh
            yield (
                "response.output_text.delta",
                {
                    "item_id": message["id"],
                    "output_index": len(output),
                    "content_index": 0,
                    "delta": item.event.content,
                    "logprobs": fresh,
                },
            )
        else:  # tokens without text (an end of turn): the message's, when it has one
            entries += logprobs_of(item.tokens)
        if item.finish is not None:
            finish = item.finish
    if message is None and not output:  # an empty reply: one empty message
        message, opening = open_text()
        for kind, fields in opening:
            yield kind, fields
    if message is not None:
        for kind, fields in close_text(message):
            yield kind, fields
    finished(response, output, finish, runner.tally.usage())
    yield (
        ("response.incomplete" if response["status"] == "incomplete" else "response.completed"),
        {"response": response},
    )


async def response_events(
    runner: Runner, response: dict[str, Any], logprobs: Logprobs | None = None
) -> AsyncIterator[str]:
    """The Responses stream as server-sent events, numbered from 0; a failure mid-stream is an error event, as
    chat's."""
    sequence = 0
    try:
        async for kind, fields in _events(runner, response, logprobs):
            yield f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': sequence, **fields})}\n\n"
            sequence += 1
    except ApiError as err:
        yield f"data: {json.dumps(err.body())}\n\n"
    except Exception as exc:  # a failure of our own mid-stream: the client still gets an error event
        log.exception("a responses stream failed")
        yield f"data: {json.dumps(internal_error(exc).body())}\n\n"


async def whole_response(runner: Runner, response: dict[str, Any], logprobs: Logprobs | None = None) -> dict[str, Any]:
    """``response`` done, unstreamed: the same items as the stream's (one code path); a failure raises."""
    async for _ in _events(runner, response, logprobs):
        pass
    return response
