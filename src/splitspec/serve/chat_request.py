"""A chat request as the model sees it: the rendered prompt, the tool-call format and the grammar.

Messages go to the tokenizer's chat template with OpenAI's ``tools``: ``developer`` becomes
``system``, text parts are joined, an assistant's ``tool_calls`` carry their arguments as objects
(templates like Qwen2.5's ``tojson`` them) and every ``tool`` message must answer a call made
earlier. A template that renders the same prompt with and without the tools ignores them: 400.
``tool_choice`` ``required`` or a named function, and ``response_format`` ``json_object`` /
``json_schema``, become a grammar (:mod:`splitspec.decoding.grammar`) the reply must follow.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

from splitspec.chat_template import render
from splitspec.decoding.grammar import GrammarCompiler
from splitspec.exceptions import InvalidGrammar
from splitspec.serve.errors import ApiError, invalid
from splitspec.serve.schemas import (
    ChatCompletionRequest,
    ChatMessage,
    JsonObjectFormat,
    JsonSchemaResponseFormat,
    NamedToolChoice,
)
from splitspec.serve.tool_parsers import Format, detect_format, forcing_grammar


@dataclass
class ChatPlan:
    prompt_ids: list[int]
    tool_format: Format | None = None  # parse tool calls out of the reply in this format
    tools: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> OpenAI function definition
    parallel: bool = True  # parallel_tool_calls: more than one call allowed
    grammar: str | None = None  # llguidance grammar the reply must follow


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """OpenAI messages as chat templates take them; 400 naming ``messages`` for a broken history."""
    out: list[dict[str, Any]] = []
    calls: set[str] = set()
    for i, m in enumerate(messages):
        entry: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        if m.name:
            entry["name"] = m.name
        if m.tool_calls:
            entry["tool_calls"] = []
            for j, call in enumerate(m.tool_calls):
                try:
                    arguments = json.loads(call.function.arguments)
                except json.JSONDecodeError:
                    raise invalid(f"messages[{i}].tool_calls[{j}].function.arguments is not JSON", "messages") from None
                calls.add(call.id)
                entry["tool_calls"].append(
                    {"id": call.id, "type": "function",
                     "function": {"name": call.function.name, "arguments": arguments}}
                )  # fmt: skip
        if m.role == "tool":
            if m.tool_call_id not in calls:
                raise invalid(
                    f"messages[{i}] answers tool call {m.tool_call_id!r}, which no earlier assistant message made",
                    "messages",
                    code="unknown_tool_call_id",
                )
            entry["tool_call_id"] = m.tool_call_id
        out.append(entry)
    return out


def plan_chat(
    body: ChatCompletionRequest,
    tokenizer: PreTrainedTokenizerBase,
    parser: str,
    compiler: Callable[[], GrammarCompiler],
) -> ChatPlan:
    """Render ``body`` and decide how its reply is parsed and constrained (400s name the field)."""
    messages = template_messages(body.messages)
    tools = [t.function.model_dump(exclude_none=True) for t in body.tools or []]
    choice = body.tool_choice
    if choice not in (None, "none", "auto") and not tools:
        raise invalid("tool_choice needs tools", "tool_choice")
    named = choice.function.name if isinstance(choice, NamedToolChoice) else None
    by_name = {t["name"]: t for t in tools}
    if named is not None and named not in by_name:
        raise invalid(f"tool_choice names {named!r}, which is not among the tools", "tool_choice")
    prompt_ids = _render(tokenizer, messages, [{"type": "function", "function": t} for t in tools])
    plan = ChatPlan(prompt_ids, parallel=body.parallel_tool_calls is not False)
    if tools:
        if prompt_ids == _render(tokenizer, messages, []):
            raise invalid(
                "this model's chat template ignores tools: it cannot be told about functions (start the server "
                "with --chat-template FILE holding a template that renders tools)",
                "tools",
                code="tools_unsupported",
            )
        fmt = detect_format(getattr(tokenizer, "chat_template", None)) if parser == "auto" else _format(parser)
        if fmt is None:
            raise invalid(
                "cannot tell this chat template's tool-call format: start the server with --tool-call-parser",
                "tools",
                code="tools_unsupported",
            )
        if choice != "none":
            plan.tool_format, plan.tools = fmt, by_name
        if choice == "required" or named is not None:
            forced = [by_name[named]] if named is not None else tools
            several = plan.parallel and named is None  # a named function: exactly one call, as vLLM
            plan.grammar = _grammar(lambda: forcing_grammar(compiler(), fmt, forced, several), "tools")
    fmt_param = body.response_format
    if isinstance(fmt_param, JsonObjectFormat | JsonSchemaResponseFormat):
        if plan.grammar is not None:
            raise invalid("response_format cannot be combined with a forced tool call", "response_format")
        plan.grammar = response_grammar(fmt_param, compiler)
    return plan


def response_grammar(fmt: JsonObjectFormat | JsonSchemaResponseFormat, compiler: Callable[[], GrammarCompiler]) -> str:
    """The grammar of a ``response_format``; 400 naming it for a schema llguidance refuses."""
    if isinstance(fmt, JsonObjectFormat):
        return _grammar(lambda: compiler().json_schema({"type": "object"}), "response_format")
    schema = fmt.json_schema.schema_
    if schema is None:
        schema = {}
    what = f"response_format.json_schema.schema ({fmt.json_schema.name})"
    return _grammar(lambda: compiler().json_schema(schema, what), "response_format")


def _format(parser: str) -> Format | None:
    return "hermes" if parser == "hermes" else "llama3_json" if parser == "llama3_json" else None


def _grammar(build: Callable[[], str], param: str) -> str:
    try:
        return build()
    except InvalidGrammar as exc:
        raise invalid(str(exc), param, code="invalid_schema") from None


def _render(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], tools: list[dict[str, Any]]
) -> list[int]:
    try:
        return render(tokenizer, messages, tools=tools or None)
    except ApiError:
        raise
    except Exception as exc:  # the template's own Jinja raise_exception (e.g. roles out of order)
        raise invalid(f"the chat template refused these messages: {exc}", param="messages") from None
