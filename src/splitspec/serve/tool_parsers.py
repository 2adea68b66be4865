"""Tool calls parsed out of generated text, and the grammars that force them.

``--tool-call-parser`` picks the format: ``hermes`` (``<tool_call>{"name", "arguments"}</tool_call>``:
Qwen2.5, Qwen3, Hermes) or ``llama3_json`` (the whole reply is ``{"name", "parameters"}``, several
joined by ``;``); ``auto`` reads it from the chat template. Model output is parsed, never trusted:
a call to a function the request did not define, or arguments that are not a JSON object, stay
plain content. :class:`ToolCallStream` works on text deltas, so a streamed reply and a whole one
parse the same: content streams as it comes, and a call is released once complete (its name
first, then its arguments), which is what lets a malformed call fall back to content.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from splitspec.decoding.grammar import JSON_LAYOUT, GrammarCompiler

Format = Literal["hermes", "llama3_json"]


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of the arguments object


@dataclass(frozen=True)
class Event:
    """One piece of a parsed reply: content text, or a complete call."""

    content: str = ""
    call: ToolCall | None = None


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def detect_format(chat_template: str | None) -> Format | None:
    """The tool-call format a chat template asks for, if it says (``--tool-call-parser auto``)."""
    template = chat_template or ""
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or ('"parameters"' in template and "<|eot_id|>" in template):
        return "llama3_json"
    return None


def _call(body: Any, tools: Mapping[str, Any], key: str) -> ToolCall | None:
    """A call from a decoded JSON value, or None if it is not a call to one of ``tools``."""
    if not isinstance(body, dict) or not isinstance(body.get("name"), str) or body["name"] not in tools:
        return None
    args = body.get(key, body.get("arguments", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(new_call_id(), body["name"], json.dumps(args, ensure_ascii=False))


class ToolCallStream:
    """Feeds on text deltas, gives back content and complete calls (see the module doc)."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self, fmt: Format, tools: Mapping[str, Any], parallel: bool = True) -> None:
        self.format = fmt
        self.tools = tools
        self.parallel = parallel
        self.calls: list[ToolCall] = []
        self._buffer = ""
        self._in_call = False
        self._spaces = ""  # whitespace held back: dropped next to a call, kept inside content
        self._mode: Literal["undecided", "content", "json"] = "undecided"

    def feed(self, delta: str) -> list[Event]:
        self._buffer += delta
        return self._hermes(final=False) if self.format == "hermes" else self._llama(final=False)

    def finish(self) -> list[Event]:
        events = self._hermes(final=True) if self.format == "hermes" else self._llama(final=True)
        if self._spaces and not self.calls:
            events.append(Event(content=self._spaces))
        self._spaces = ""
        return events

    def _content(self, text: str, events: list[Event]) -> None:
        body = text.rstrip()
        if body:
            events.append(Event(content=self._spaces + body))
            self._spaces = ""
        self._spaces += text[len(body) :]  # trailing whitespace waits to see what follows it

    def _accept(self, call: ToolCall | None, raw: str, events: list[Event]) -> None:
        if call is None or (self.calls and not self.parallel):
            self._content(raw, events)
            return
        self._spaces = ""
        self.calls.append(call)
        events.append(Event(call=call))

    def _hermes(self, final: bool) -> list[Event]:
        events: list[Event] = []
        while True:
            if not self._in_call:
                at = self._buffer.find(self.OPEN)
                if at < 0:
                    keep = 0 if final else _partial_suffix(self._buffer, self.OPEN)
                    self._content(self._buffer[: len(self._buffer) - keep], events)
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                    return events
                self._content(self._buffer[:at], events)
                self._buffer, self._in_call = self._buffer[at + len(self.OPEN) :], True
            end = self._buffer.find(self.CLOSE)
            if end < 0 and not final:
                return events
            body = self._buffer if end < 0 else self._buffer[:end]
            raw = self.OPEN + body + ("" if end < 0 else self.CLOSE)
            self._accept(_call(_loads(body), self.tools, "arguments"), raw, events)
            self._buffer = "" if end < 0 else self._buffer[end + len(self.CLOSE) :]
            self._in_call = False
            if end < 0:
                return events

    def _llama(self, final: bool) -> list[Event]:
        events: list[Event] = []
        if self._mode == "undecided":
            head = self._buffer.lstrip()
            if not head:
                return events
            self._mode = "json" if head.startswith(("{", "<|python_tag|>")) else "content"
        if self._mode == "content":
            self._content(self._buffer, events)
            self._buffer = ""
            return events
        if not final:
            return events
        calls = _llama_calls(self._buffer, self.tools)
        if calls is None:
            self._content(self._buffer, events)
        else:
            for call, raw in calls:  # raw: what a call parallel_tool_calls=false refuses shows as
                self._accept(call, raw, events)
        self._buffer = ""
        return events


def parse(text: str, fmt: Format, tools: Mapping[str, Any], parallel: bool = True) -> tuple[str | None, list[ToolCall]]:
    """A whole reply: its content (None when it held only calls) and its calls."""
    stream = ToolCallStream(fmt, tools, parallel)
    events = stream.feed(text) + stream.finish()
    content = "".join(e.content for e in events)
    return (content if content or not stream.calls else None), stream.calls


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that could be the start of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def _llama_calls(text: str, tools: Mapping[str, Any]) -> list[tuple[ToolCall, str]] | None:
    """Every call of a llama3_json reply with its text (from the end of the call before it), or None
    unless the whole reply is calls."""
    rest = text.strip().removeprefix("<|python_tag|>").strip()
    decoder, at = json.JSONDecoder(), 0
    calls: list[tuple[ToolCall, str]] = []
    while at < len(rest):
        try:
            body, end = decoder.raw_decode(rest, at)
        except json.JSONDecodeError:
            return None
        call = _call(body, tools, "parameters")
        if call is None:
            return None
        start = at if not calls else len(rest[:at].rstrip().removesuffix(";").rstrip())
        calls.append((call, rest[start:end]))
        tail = rest[end:].lstrip()
        at = len(rest) - len(tail.removeprefix(";").lstrip())
    return calls or None


def call_schema(fmt: Format, tool: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON schema of one call to ``tool`` (an OpenAI function definition) in ``fmt``."""
    params = tool.get("parameters") or {"type": "object", "properties": {}}
    key = "arguments" if fmt == "hermes" else "parameters"
    return {
        "type": "object",
        "properties": {"name": {"const": tool["name"]}, key: params},
        "required": ["name", key],
        "additionalProperties": False,
    }


def forcing_grammar(
    compiler: GrammarCompiler, fmt: Format, tools: Sequence[Mapping[str, Any]], parallel: bool = True
) -> str:
    """A grammar that admits only calls to ``tools`` (one tool: that one), at least one of them."""
    schemas = [call_schema(fmt, t) for t in tools]
    body = json.dumps({**(schemas[0] if len(schemas) == 1 else {"anyOf": schemas}), "x-guidance": JSON_LAYOUT})
    if fmt == "hermes":
        opening, closing = compiler.literal(ToolCallStream.OPEN), compiler.literal(ToolCallStream.CLOSE)
        call = f'call: {opening} "\\n" body "\\n" {closing}'
        start = 'start: call ("\\n" call)*' if parallel else "start: call"
    else:
        call = "call: body"
        start = 'start: call ("; " call)*' if parallel else "start: call"
    return compiler.lark(f"{start}\n{call}\nbody: %json {body}\n", what="tools")
