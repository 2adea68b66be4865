"""A chat request as the model sees it: the rendered prompt, the tool-call format and the grammar.

Messages go to the tokenizer's chat template with OpenAI's ``tools``: ``developer`` becomes
``system``, text parts are joined, an assistant's ``tool_calls`` carry their arguments as objects
(templates like Qwen2.5's ``tojson`` them) and every ``tool`` message must answer a call made
earlier. A template that renders the same prompt with and without the tools ignores them: 400.
``tool_choice`` ``required`` or a named function, and ``response_format`` / ``structured_outputs``
(:mod:`splitspec.serve.structured`), become a grammar (:mod:`splitspec.decoding.grammar`) the reply must
follow. vLLM's ``add_generation_prompt``, ``continue_final_message`` and ``chat_template_kwargs`` go to
the template as they are (a variable named like one of ``apply_chat_template``'s parameters: 400).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

from splitspec.chat_template import render, reserved_template_kwargs
from splitspec.decoding.grammar import GrammarCompiler
from splitspec.serve.errors import ApiError, invalid
from splitspec.serve.schemas import ChatCompletionRequest, ChatMessage, FinishReason, NamedToolChoice
from splitspec.serve.structured import checked, output_grammar, output_param
from splitspec.serve.tool_parsers import Format, detect_format, forcing_grammar


@dataclass
class ChatPlan:
    prompt_ids: list[int]
    tool_format: Format | None = None  # parse tool calls out of the reply in this format
    tools: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> OpenAI function definition
    parallel: bool = True  # parallel_tool_calls: more than one call allowed
    grammar: str | None = None  # llguidance grammar the reply must follow
    # the finish reason of a reply that ends with calls: "stop" under a named tool_choice, as OpenAI and vLLM report it
    call_finish: FinishReason = "tool_calls"


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
    options = RenderOptions(body.add_generation_prompt, body.continue_final_message,
                            template_kwargs(tokenizer, body.chat_template_kwargs))  # fmt: skip
    prompt_ids = _render(tokenizer, messages, [{"type": "function", "function": t} for t in tools], options)
    plan = ChatPlan(prompt_ids, parallel=body.parallel_tool_calls is not False)
    if tools:
        if prompt_ids == _render(tokenizer, messages, [], options):
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
            plan.call_finish = "stop" if named is not None else "tool_calls"
            plan.grammar = checked(lambda: forcing_grammar(compiler(), fmt, forced, several), "tools")
    fmt_param = output_param(body)
    if fmt_param is not None:
        if plan.grammar is not None:
            raise invalid(f"{fmt_param} cannot be combined with a forced tool call", fmt_param)
        plan.grammar = output_grammar(body, compiler)
    return plan


@dataclass(frozen=True)
class RenderOptions:
    """How the template renders a conversation, beyond its messages and tools (vLLM's fields)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: dict[str, Any] = field(default_factory=dict)


def template_kwargs(tokenizer: PreTrainedTokenizerBase, sent: dict[str, Any] | None) -> dict[str, Any]:
    """``chat_template_kwargs`` as the template gets them; 400 for one named like a parameter of the rendering."""
    kwargs = dict(sent or {})
    clash = sorted(set(kwargs) & reserved_template_kwargs(tokenizer))
    if clash:
        raise invalid(
            f"chat_template_kwargs may not set {', '.join(clash)}: the rendering's own parameters (send "
            "add_generation_prompt and continue_final_message as fields of the request)",
            "chat_template_kwargs",
        )
    return kwargs


def _format(parser: str) -> Format | None:
    return "hermes" if parser == "hermes" else "llama3_json" if parser == "llama3_json" else None


def _render(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]],
    options: RenderOptions,
) -> list[int]:
    try:
        return render(tokenizer, messages, options.add_generation_prompt, tools or None,
                      options.continue_final_message, options.template_kwargs)  # fmt: skip
    except ApiError:
        raise
    except Exception as exc:  # the template's own Jinja raise_exception (e.g. roles out of order)
        raise invalid(f"the chat template refused these messages: {exc}", param="messages") from None
