"""Tool calls parsed from model text: hermes and llama3_json, whole and streamed, and the text
that must stay plain content (undefined functions, arguments that are not JSON)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from splitspec.decoding.grammar import GrammarCompiler
from splitspec.serve.tool_parsers import Format, ToolCallStream, detect_format, forcing_grammar, parse
from tests.tool_model import QWEN_TOOL_TEMPLATE, TOOL_VOCAB

TOOLS = {"get_weather": {"name": "get_weather"}, "add": {"name": "add"}}
HERMES = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
)
LLAMA = '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "add", "parameters": {"a": 1, "b": 2}}'


def streamed(text: str, fmt: Format, seed: int) -> tuple[str, list[tuple[str, str]]]:
    """``text`` fed in random pieces: the content and the calls that come out."""
    rng = random.Random(seed)
    stream = ToolCallStream(fmt, TOOLS)
    events, at = [], 0
    while at < len(text):
        step = rng.randint(1, 7)
        events += stream.feed(text[at : at + step])
        at += step
    events += stream.finish()
    return "".join(e.content for e in events), [(e.call.name, e.call.arguments) for e in events if e.call]


@pytest.mark.parametrize(("fmt", "text"), [("hermes", HERMES), ("llama3_json", LLAMA)])
def test_calls_are_parsed_whole_and_streamed_alike(fmt: Format, text: str) -> None:
    content, calls = parse(text, fmt, TOOLS)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})
    ]  # fmt: skip
    assert content == ("Let me check." if fmt == "hermes" else None)
    assert all(c.id.startswith("call_") for c in calls)
    assert len({c.id for c in calls}) == 2
    for seed in range(20):
        assert streamed(text, fmt, seed) == (content or "", [(c.name, c.arguments) for c in calls])


@pytest.mark.parametrize(
    ("fmt", "text"),
    [
        ("hermes", '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>'),  # undefined function
        ("hermes", '<tool_call>\n{"name": "add", "arguments": {"a": 1,\n</tool_call>'),  # not JSON
        ("hermes", '<tool_call>\n{"name": "add", "arguments": [1, 2]}\n</tool_call>'),  # not an object
        ("hermes", "just prose, and a < sign and <tool"),
        ("llama3_json", '{"name": "nope", "parameters": {}}'),
        ("llama3_json", '{"name": "add", "parameters": {"a": 1}} and then some prose'),
        ("llama3_json", "The weather is fine."),
    ],
)
def test_what_is_not_a_call_stays_content(fmt: Format, text: str) -> None:
    assert parse(text, fmt, TOOLS) == (text, [])
    for seed in range(5):
        assert streamed(text, fmt, seed) == (text, [])


@pytest.mark.parametrize(("fmt", "text"), [("hermes", HERMES), ("llama3_json", LLAMA)])
def test_parallel_false_keeps_the_first_call_only(fmt: Format, text: str) -> None:
    content, calls = parse(text, fmt, TOOLS, parallel=False)
    assert [c.name for c in calls] == ["get_weather"]
    assert '"add"' in (content or "")  # the refused call shows as content, not dropped
    if fmt == "llama3_json":
        assert content == text[text.index(";") :]


def test_an_unclosed_call_at_the_end_still_parses() -> None:
    _, calls = parse('<tool_call>\n{"name": "add", "arguments": {"a": 1}}', "hermes", TOOLS)
    assert [c.name for c in calls] == ["add"]


def test_format_from_the_template() -> None:
    assert detect_format(QWEN_TOOL_TEMPLATE) == "hermes"
    assert detect_format("{{ '<|python_tag|>' }}{{ '<|eot_id|>' }}") == "llama3_json"
    assert detect_format("{% for m in messages %}{{ m.content }}{% endfor %}") is None


def test_forcing_grammar_admits_a_call_and_nothing_else(tool_model: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tool_model, local_files_only=True)
    compiler = GrammarCompiler(tokenizer, TOOL_VOCAB)
    tools = [{"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}},
                                            "required": ["a"], "additionalProperties": False}}]  # fmt: skip
    end = {tokenizer.added_tokens_encoder["<|im_end|>"]}
    grammar = forcing_grammar(compiler, "hermes", tools, parallel=False)
    good = tokenizer.encode(
        '<tool_call>\n{"name": "add", "arguments": {"a": 7}}\n</tool_call>', add_special_tokens=False
    )
    p = compiler.processor(grammar, end)
    assert p.validate_draft(good) == len(good)
    p.accept(good)
    assert p.finished
    for bad in ("Sure!", '<tool_call>\n{"name": "sub"', '<tool_call>\n{"name": "add", "arguments": {"b": 1'):
        ids = tokenizer.encode(bad, add_special_tokens=False)
        assert compiler.processor(grammar, end).validate_draft(ids) < len(ids), bad
