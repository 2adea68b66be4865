"""vLLM's request extensions through a real trunk server: each is honoured (``allowed_token_ids``,
``structured_outputs``, ``add_generation_prompt``, ``continue_final_message``, ``chat_template_kwargs``,
``truncate_prompt_tokens``)
or, sent with a value that would change the output, a 400 naming it; never silently ignored."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
import torch
from transformers import AutoTokenizer

from tests.conftest import local_model
from tests.serve.conftest import CHAT_TEMPLATE, MODEL_NAME, Stack
from tests.serve.helpers import tokenize

ASK = [{"role": "user", "content": "to be or not"}]
CHAT = {"model": MODEL_NAME, "messages": ASK, "max_tokens": 6, "temperature": 0}
COMPLETION = {"model": MODEL_NAME, "prompt": "to be or not", "max_tokens": 6, "temperature": 0}
# Qwen3's switch, in miniature: enable_thinking false puts an empty block after the assistant's cue
THINKING_TEMPLATE = CHAT_TEMPLATE + (
    "{% if add_generation_prompt and enable_thinking is defined and not enable_thinking %}to be {% endif %}"
)
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}, "score": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["answer", "score"],
    "additionalProperties": False,
}


def post(stack: Stack, path: str, body: Mapping[str, Any]) -> httpx.Response:
    return httpx.post(f"{stack.base_url}{path}", json=dict(body), timeout=60)


def ok(stack: Stack, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
    response = post(stack, path, body)
    assert response.status_code == 200, response.text
    return dict(response.json())


def error(stack: Stack, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
    response = post(stack, path, body)
    assert response.status_code == 400, response.text
    return dict(response.json()["error"])


def content(reply: Mapping[str, Any]) -> str:
    return str(reply["choices"][0]["message"]["content"])


def end_id(stack: Stack) -> int:
    (end,) = stack.state.chat_stop_ids - stack.state.eos_token_ids
    return int(end)


def local_render(model: Path, messages: Sequence[Mapping[str, Any]], template: str | None = None, **kw: Any) -> Any:
    """The template's token ids for ``messages``, rendered here with transformers alone."""
    tokenizer = AutoTokenizer.from_pretrained(model, local_files_only=True)
    if template is not None:
        tokenizer.chat_template = template
    return tokenizer.apply_chat_template([dict(m) for m in messages], tokenize=True, return_dict=False, **kw)


def completion_of(stack: Stack, prompt_ids: list[int], max_tokens: int) -> dict[str, Any]:
    """Greedy completion of a rendered chat prompt, stopping where a chat reply stops (compare the words: this
    tokenizer decodes tokens apart, and a completion's text is decoded after its prompt's, a chat reply's alone)."""
    body = {**COMPLETION, "prompt": prompt_ids, "max_tokens": max_tokens, "stop_token_ids": [end_id(stack)]}
    return ok(stack, "/completions", body)


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(stack: Stack) -> None:
    """vLLM's left truncation: the reply to a prompt cut to its last k tokens is the reply to those k tokens sent as
    ids (completions, echoing what was kept) and to the chat prompt's last k tokens; -1 keeps what fits the model;
    a limit over its positions, 0 and -2 are 400s naming the field."""
    prompt_ids = tokenize(stack, {"model": MODEL_NAME, "prompt": "to be or not to be that is the question"})
    cut = ok(stack, "/completions", {**COMPLETION, "prompt": "to be or not to be that is the question",
                                     "truncate_prompt_tokens": 4, "echo": True})  # fmt: skip
    sent = ok(stack, "/completions", {**COMPLETION, "prompt": prompt_ids[-4:], "echo": True})
    assert cut["usage"]["prompt_tokens"] == 4
    assert cut["choices"][0]["text"] == sent["choices"][0]["text"]  # the kept prompt's text, then the same reply
    whole = ok(stack, "/completions", {**COMPLETION, "prompt": "to be or not", "truncate_prompt_tokens": -1})
    assert whole["choices"] == ok(stack, "/completions", COMPLETION)["choices"]
    chat_ids = tokenize(stack, {"model": MODEL_NAME, "messages": ASK})
    chat_cut = ok(stack, "/chat/completions", {**CHAT, "truncate_prompt_tokens": 5})
    assert chat_cut["usage"]["prompt_tokens"] == 5
    same = ok(stack, "/completions", {**COMPLETION, "prompt": chat_ids[-5:], "stop_token_ids": [end_id(stack)]})
    assert content(chat_cut).split() == same["choices"][0]["text"].split()
    for path, base in (("/completions", COMPLETION), ("/chat/completions", CHAT)):
        for bad in (stack.state.max_positions + 1, 0, -2):
            assert error(stack, path, {**base, "truncate_prompt_tokens": bad})["param"] == "truncate_prompt_tokens"


@pytest.mark.parametrize("path", ["/completions", "/chat/completions"])
def test_include_stop_str_in_output_keeps_the_stop_string(stack: Stack, path: str) -> None:
    """A stop string picked from the greedy reply's middle: the reply ends just before it, or with it when
    ``include_stop_str_in_output`` asks (vLLM's extension), streamed or not."""
    base = {**(COMPLETION if path == "/completions" else CHAT), "max_tokens": 16}

    def text(reply: Mapping[str, Any]) -> str:
        return str(reply["choices"][0]["text"] if path == "/completions" else content(reply))

    full = text(ok(stack, path, base))
    words = full.split()
    assert len(words) >= 4
    stop = " " + words[len(words) // 2]
    before = full[: full.index(stop)]
    assert text(ok(stack, path, {**base, "stop": [stop]})) == before
    kept = ok(stack, path, {**base, "stop": [stop], "include_stop_str_in_output": True})
    assert text(kept) == before + stop
    assert kept["choices"][0]["finish_reason"] == "stop"
    with httpx.stream("POST", f"{stack.base_url}{path}", json={**base, "stop": [stop], "stream": True,
                      "include_stop_str_in_output": True}, timeout=60) as response:  # fmt: skip
        chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    field = "text" if path == "/completions" else "content"
    streamed = "".join(c["choices"][0].get(field) or c["choices"][0].get("delta", {}).get(field) or "" for c in chunks)
    assert streamed == before + stop


# -- refused unless neutral ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "field", "neutral", "value"),
    [
        ("/chat/completions", "use_beam_search", False, True),
        ("/completions", "length_penalty", 1.0, 0.5),
    ],
)
def test_unhonoured_fields_are_refused_unless_neutral(
    stack: Stack, path: str, field: str, neutral: object, value: object
) -> None:
    base = CHAT if path == "/chat/completions" else COMPLETION
    plain = ok(stack, path, base)
    same = ok(stack, path, {**base, field: neutral})
    assert same["choices"] == plain["choices"]
    err = error(stack, path, {**base, field: value})
    assert (err["param"], err["code"]) == (field, "unsupported_parameter")
    assert f"'{field}'" in err["message"]


@pytest.mark.parametrize(
    "spec",
    [
        {"choice": ["a"], "structural_tag": "{}"},
        {"regex": "a", "whitespace_pattern": " *"},
        {"json": {"type": "object"}, "disable_additional_properties": True},
    ],
)
def test_unhonoured_structured_outputs_options_are_refused(tool_stack: Stack, spec: dict[str, Any]) -> None:
    err = error(tool_stack, "/chat/completions", {**CHAT, "structured_outputs": spec})
    assert (err["param"], err["code"]) == ("structured_outputs", "unsupported_parameter")


@pytest.mark.parametrize(
    ("path", "change", "param"),
    [
        ("/chat/completions", {"allowed_token_ids": []}, "allowed_token_ids"),
        ("/chat/completions", {"allowed_token_ids": [5, 99999]}, "allowed_token_ids"),
        ("/completions", {"allowed_token_ids": [-1]}, "allowed_token_ids"),
        ("/chat/completions", {"structured_outputs": {}}, "structured_outputs"),
        ("/chat/completions", {"structured_outputs": {"choice": ["a"], "regex": "a"}}, "structured_outputs"),
        ("/chat/completions", {"structured_outputs": {"choice": []}}, "structured_outputs"),
        ("/chat/completions", {"structured_outputs": {"choices": ["a"]}}, "structured_outputs"),  # a typo
        ("/completions", {"structured_outputs": {"json": "{not json"}}, "structured_outputs"),
        ("/completions", {"structured_outputs": {"regex": "[ab"}}, "structured_outputs"),
        ("/completions", {"structured_outputs": {"grammar": "start: ("}}, "structured_outputs"),
        ("/chat/completions", {"structured_outputs": {"choice": ["a"]}, "response_format": {"type": "json_object"}},
         "structured_outputs"),
        ("/chat/completions", {"continue_final_message": True}, "continue_final_message"),  # and the cue: vLLM's 400
        ("/chat/completions", {"chat_template_kwargs": {"tokenize": False}}, "chat_template_kwargs"),
        ("/chat/completions", {"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
    ],
)  # fmt: skip
def test_bad_values_are_named(tool_stack: Stack, path: str, change: dict[str, Any], param: str) -> None:
    base = CHAT if path == "/chat/completions" else COMPLETION
    assert error(tool_stack, path, {**base, **change})["param"] == param


# -- skip_special_tokens ---------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/completions", "/chat/completions"])
def test_skip_special_tokens_false_shows_special_tokens(stack: Stack, path: str) -> None:
    """A reply made of special and plain tokens (allowed_token_ids) shows every token's text with
    skip_special_tokens false and leaves the special ones out by default; the completions' text offsets count
    them too. The stop token's text is never shown (as vLLM)."""
    tokenizer = stack.state.tokenizer
    special = [t for t in tokenizer.all_special_ids if t not in stack.state.chat_stop_ids][:2]
    plain = tokenizer.encode("whether tis nobler", add_special_tokens=False)
    base = CHAT if path == "/chat/completions" else COMPLETION
    body = {**base, "max_tokens": 12, "temperature": 1.0, "seed": 3, "allowed_token_ids": special + plain,
            "logprobs": True if path == "/chat/completions" else 0}  # fmt: skip

    def tokens_and_text(reply: dict[str, Any]) -> tuple[list[str], str]:
        choice = reply["choices"][0]
        if path == "/chat/completions":
            return [e["token"] for e in choice["logprobs"]["content"]], str(choice["message"]["content"])
        return list(choice["logprobs"]["tokens"]), str(choice["text"])

    tokens, hidden = tokens_and_text(ok(stack, path, body))
    shown_tokens, shown = tokens_and_text(ok(stack, path, {**body, "skip_special_tokens": False}))
    assert shown_tokens == tokens  # the same reply, shown differently
    names = set(tokenizer.convert_ids_to_tokens(special))
    assert names & set(tokens)  # the reply holds special tokens
    assert shown.split() == tokens  # this tokenizer decodes tokens apart, spaced
    assert hidden.split() == [t for t in tokens if t not in names]
    if path == "/completions":  # each token moves the offset by its text's length, special ones only when shown
        for skip in (True, False):
            reply = ok(stack, path, {**body, "skip_special_tokens": skip})["choices"][0]["logprobs"]
            steps = [b - a for a, b in zip(reply["text_offset"], reply["text_offset"][1:], strict=False)]
            assert steps == [0 if skip and t in names else len(t) for t in tokens[:-1]], skip


# -- allowed_token_ids ---------------------------------------------------------------------------


def test_allowed_token_ids_ban_every_other_token(stack: Stack, chat_model: Path) -> None:
    prompt = stack.state.tokenizer.encode("to be or not to be", add_special_tokens=False)
    allowed = stack.state.tokenizer.encode("whether tis nobler in the mind", add_special_tokens=False)[:5]
    body = {**COMPLETION, "prompt": prompt, "max_tokens": 10, "allowed_token_ids": allowed}
    reply = ok(stack, "/completions", body)
    model, out = local_model(chat_model), list[int]()  # the whole model, every other token masked here
    with torch.no_grad():
        for _ in range(10):
            logits = model(torch.tensor([prompt + out])).logits[0, -1].float()
            out.append(allowed[int(logits[allowed].argmax())])
    words = stack.state.tokenizer.convert_ids_to_tokens  # this tokenizer decodes tokens apart, spaced
    assert reply["choices"][0]["text"].split() == words(out)
    assert reply["choices"][0]["finish_reason"] == "length"  # no stop token is allowed: none ends it
    plain = ok(stack, "/completions", {**body, "allowed_token_ids": None})
    assert plain["choices"][0]["text"] != reply["choices"][0]["text"]
    sampled = ok(stack, "/chat/completions", {**CHAT, "max_tokens": 8, "temperature": 1.0, "n": 4, "seed": 3,
                                              "allowed_token_ids": allowed})  # fmt: skip
    for choice in sampled["choices"]:
        assert set(choice["message"]["content"].split()) <= set(words(allowed))
        assert choice["finish_reason"] == "length"


# -- structured_outputs ----------------------------------------------------------------------------


def test_structured_outputs_choice_regex_and_grammar(tool_stack: Stack) -> None:
    def replies(path: str, spec: dict[str, Any], **kw: Any) -> list[str]:
        base = {**(CHAT if path == "/chat/completions" else COMPLETION), "max_tokens": 20}
        body = {**base, "temperature": 1.0, "n": 8, "seed": 5, "structured_outputs": spec, **kw}
        choices = ok(tool_stack, path, body)["choices"]
        assert all(c["finish_reason"] == "stop" for c in choices)
        return [c["message"]["content"] if path == "/chat/completions" else c["text"] for c in choices]

    words = ["yes", "no", "to be or not"]
    for path in ("/chat/completions", "/completions"):
        assert set(replies(path, {"choice": words})) <= set(words)
        for text in replies(path, {"regex": r"[0-9]{3}-[a-z]{2}"}):
            assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", text), text
    for grammar in ('start: ("to" | "be") " " ("or" | "not")', 'root ::= ("to" | "be") " " ("or" | "not")'):  # GBNF
        for text in replies("/chat/completions", {"grammar": grammar}):
            assert re.fullmatch(r"(to|be) (or|not)", text), text
    plain = [content(ok(tool_stack, "/chat/completions", {**CHAT, "max_tokens": 20, "seed": 5 + i,
                                                          "temperature": 1.0})) for i in range(3)]  # fmt: skip
    assert not set(plain) <= set(words)  # the constraint, not the model, made them


def test_vllms_older_guided_fields_are_structured_outputs(tool_stack: Stack) -> None:
    """guided_choice/regex/grammar/json (vLLM before 0.10.2) give exactly the replies of the structured_outputs
    they became (seeded, sampled: a constraint read otherwise would change them); with structured_outputs, a 400."""
    base = {**CHAT, "max_tokens": 20, "temperature": 1.0, "n": 4, "seed": 7}
    for key, spec in [("choice", ["yes", "no", "to be or not"]), ("regex", r"[0-9]{3}-[a-z]{2}"),
                      ("grammar", 'start: ("to" | "be") " " ("or" | "not")'), ("json", SCHEMA)]:  # fmt: skip
        guided = ok(tool_stack, "/chat/completions", {**base, f"guided_{key}": spec, "guided_decoding_backend": "x"})
        structured = ok(tool_stack, "/chat/completions", {**base, "structured_outputs": {key: spec}})
        assert [content({"choices": [c]}) for c in guided["choices"]] == [
            content({"choices": [c]}) for c in structured["choices"]
        ], key
    free = ok(tool_stack, "/chat/completions", base)
    assert [c["message"]["content"] for c in free["choices"]] != [c["message"]["content"] for c in guided["choices"]]
    both = {**base, "guided_regex": "a", "structured_outputs": {"regex": "a"}}
    assert "not both" in error(tool_stack, "/chat/completions", both)["message"]
    whitespace = error(
        tool_stack, "/completions", {**COMPLETION, "guided_json": SCHEMA, "guided_whitespace_pattern": " "}
    )
    assert (whitespace["param"], whitespace["code"]) == ("structured_outputs", "unsupported_parameter")


def test_structured_outputs_json_is_response_formats(tool_stack: Stack) -> None:
    body = {**CHAT, "max_tokens": 40}
    fmt = ok(tool_stack, "/chat/completions", {**body, "response_format": {"type": "json_schema", "json_schema": {
        "name": "v", "schema": SCHEMA}}})  # fmt: skip
    for schema in (SCHEMA, json.dumps(SCHEMA)):  # a schema, or its JSON text
        reply = ok(tool_stack, "/chat/completions", {**body, "structured_outputs": {"json": schema}})
        jsonschema.validate(json.loads(content(reply)), SCHEMA)
        assert content(reply) == content(fmt)
    obj = ok(tool_stack, "/completions", {**COMPLETION, "max_tokens": 8, "structured_outputs": {"json_object": True}})
    same = ok(tool_stack, "/completions", {**COMPLETION, "max_tokens": 8, "response_format": {"type": "json_object"}})
    assert obj["choices"][0]["text"] == same["choices"][0]["text"]
    assert obj["choices"][0]["text"].startswith("{")


# -- the chat template: add_generation_prompt, continue_final_message, chat_template_kwargs ---------


def test_add_generation_prompt_and_continue_final_message(stack: Stack, chat_model: Path) -> None:
    bare = local_render(chat_model, ASK, add_generation_prompt=False)
    reply = ok(stack, "/chat/completions", {**CHAT, "add_generation_prompt": False})
    assert reply["usage"]["prompt_tokens"] == len(bare) < len(local_render(chat_model, ASK, add_generation_prompt=True))
    assert content(reply).split() == completion_of(stack, bare, 6)["choices"][0]["text"].split()

    started = [*ASK, {"role": "assistant", "content": "that is the"}]
    open_ids = local_render(chat_model, started, continue_final_message=True)
    assert stack.state.tokenizer.decode(open_ids).endswith("<|assistant|> that is the")  # no end of turn
    body = {**CHAT, "messages": started, "add_generation_prompt": False, "continue_final_message": True}
    reply = ok(stack, "/chat/completions", body)
    assert reply["usage"]["prompt_tokens"] == len(open_ids)
    assert content(reply).split() == completion_of(stack, open_ids, 6)["choices"][0]["text"].split()
    fields = ("messages", "add_generation_prompt", "continue_final_message")
    assert tokenize(stack, {k: body[k] for k in fields}) == open_ids


def test_chat_echo_starts_the_reply_with_the_last_message_of_its_role(stack: Stack) -> None:
    """vLLM's chat ``echo``: a continued assistant message's content, then the continuation, whole or streamed;
    a last message of another role than the reply's (a user's, under add_generation_prompt) is not echoed."""
    started = [
        *ASK,
        {"role": "assistant", "content": [{"type": "text", "text": "that is"}, {"type": "text", "text": "the"}]},
    ]
    body = {**CHAT, "messages": started, "add_generation_prompt": False, "continue_final_message": True}
    plain = content(ok(stack, "/chat/completions", body))
    echoed = ok(stack, "/chat/completions", {**body, "echo": True})
    assert content(echoed) == "that is\nthe" + plain  # text parts joined by newlines, as vLLM
    assert echoed["usage"] == ok(stack, "/chat/completions", body)["usage"]  # the echo is no completion token
    with httpx.stream("POST", f"{stack.base_url}/chat/completions", json={**body, "echo": True, "stream": True},
                      timeout=60) as response:  # fmt: skip
        chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == content(echoed)
    scored = ok(stack, "/chat/completions", {**body, "echo": True, "logprobs": True, "prompt_logprobs": 1})
    assert len(scored["choices"][0]["logprobs"]["content"]) == scored["usage"]["completion_tokens"]  # the reply's
    assert len(scored["prompt_logprobs"]) == scored["usage"]["prompt_tokens"]
    asked = ok(stack, "/chat/completions", {**CHAT, "echo": True})  # the last message is the user's
    assert content(asked) == content(ok(stack, "/chat/completions", CHAT))


def test_chat_template_kwargs_reach_the_template(make_stack: Callable[..., Stack], chat_model: Path) -> None:
    stack = make_stack(chat_template=THINKING_TEMPLATE)
    thinking_off = local_render(chat_model, ASK, THINKING_TEMPLATE, add_generation_prompt=True, enable_thinking=False)
    plain = local_render(chat_model, ASK, THINKING_TEMPLATE, add_generation_prompt=True)
    assert len(thinking_off) > len(plain)
    reply = ok(stack, "/chat/completions", {**CHAT, "chat_template_kwargs": {"enable_thinking": False}})
    assert reply["usage"]["prompt_tokens"] == len(thinking_off)
    assert content(reply).split() == completion_of(stack, thinking_off, 6)["choices"][0]["text"].split()
    on = ok(stack, "/chat/completions", {**CHAT, "chat_template_kwargs": {"enable_thinking": True}})
    assert on["usage"]["prompt_tokens"] == len(plain)
    assert tokenize(stack, {"messages": ASK, "chat_template_kwargs": {"enable_thinking": False}}) == thinking_off
