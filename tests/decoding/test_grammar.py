"""GrammarProcessor against a real tokenizer: masks, drafts, rollback, and constrained decoding
of a tiny model that yields schema-valid JSON (checked with the jsonschema package)."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from splitspec.decoding.grammar import GrammarCompiler, GrammarProcessor
from splitspec.decoding.sampling import SamplingParams, choose_token
from splitspec.exceptions import InvalidGrammar
from tests.conftest import local_model
from tests.tool_model import TOOL_VOCAB

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 6},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
        "sunny": {"type": "boolean"},
    },
    "required": ["city", "days", "sunny"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer(tool_model: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(tool_model, local_files_only=True)


@pytest.fixture(scope="module")
def compiler(tokenizer: PreTrainedTokenizerBase) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, TOOL_VOCAB)


def stops(tokenizer: PreTrainedTokenizerBase) -> set[int]:
    return {tokenizer.added_tokens_encoder["<|im_end|>"]}


def processor(compiler: GrammarCompiler, tokenizer: PreTrainedTokenizerBase) -> GrammarProcessor:
    return compiler.processor(compiler.json_schema(SCHEMA), stops(tokenizer))


def allowed_texts(p: GrammarProcessor, tokenizer: PreTrainedTokenizerBase) -> set[str]:
    return {str(tokenizer.decode([i])) for i in torch.nonzero(p.allowed()).flatten().tolist()}


def test_mask_allows_exactly_what_the_schema_allows(
    compiler: GrammarCompiler, tokenizer: PreTrainedTokenizerBase
) -> None:
    p = processor(compiler, tokenizer)
    assert p.allowed().shape == (TOOL_VOCAB,)
    assert all(t.startswith("{") for t in allowed_texts(p, tokenizer))  # an object, nothing before it
    logits = torch.zeros(1, TOOL_VOCAB)
    out = p.process(logits, [], [])
    assert torch.isinf(out[0]).sum() == TOOL_VOCAB - int(p.allowed().sum())
    assert not p.allowed()[TOOL_VOCAB - 1]  # ids the tokenizer lacks are never allowed
    text = json.dumps({"city": "Paris", "days": 3, "sunny": True})
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert p.validate_draft(ids) == len(ids)
    p.accept(ids)
    assert p.finished
    assert allowed_texts(p, tokenizer) == {"<|im_end|>"}  # complete: only the stop token may follow


def test_drafts_are_cut_at_the_first_forbidden_token(
    compiler: GrammarCompiler, tokenizer: PreTrainedTokenizerBase
) -> None:
    p = processor(compiler, tokenizer)
    good = tokenizer.encode('{"city": "Rome", "days": ', add_special_tokens=False)
    bad = tokenizer.encode("x", add_special_tokens=False)  # days must be a digit
    assert p.validate_draft([*good, *bad, *good]) == len(good)
    assert p.validate_draft(bad) == 0
    with pytest.raises(ValueError, match="validate_draft"):
        p.process(torch.zeros(len(good) + 2, TOOL_VOCAB), [], [*good, *bad])


def test_draft_rows_equal_one_token_at_a_time(compiler: GrammarCompiler, tokenizer: PreTrainedTokenizerBase) -> None:
    draft = tokenizer.encode('{"city": "Oslo"', add_special_tokens=False)
    batched = processor(compiler, tokenizer).process(torch.randn(len(draft) + 1, TOOL_VOCAB), [], draft)
    one = processor(compiler, tokenizer)
    for i in range(len(draft) + 1):
        assert torch.equal(torch.isinf(batched[i]), ~one.allowed()), i
        if i < len(draft):
            one.accept([draft[i]])


def test_rollback_restores_the_state(compiler: GrammarCompiler, tokenizer: PreTrainedTokenizerBase) -> None:
    p = processor(compiler, tokenizer)
    ids = tokenizer.encode('{"city": "Oslo", "days": 4', add_special_tokens=False)
    p.accept(ids[:2])
    before = p.allowed().clone()
    p.accept(ids[2:])
    assert not torch.equal(before, p.allowed())
    p.rollback(len(ids) - 2)
    assert torch.equal(before, p.allowed())
    with pytest.raises(ValueError, match="break the grammar"):
        p.accept(tokenizer.encode("]", add_special_tokens=False))


@pytest.mark.parametrize(
    "schema", [{"type": "nonsense"}, {"type": "object", "properties": 3}, {"type": "string", "minLength": "x"}]
)
def test_invalid_schemas_are_refused(compiler: GrammarCompiler, schema: dict[str, object]) -> None:
    with pytest.raises(InvalidGrammar, match="the schema"):
        compiler.json_schema(schema, "the schema")


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_constrained_decoding_of_a_tiny_model_is_schema_valid(
    tool_model: Path, compiler: GrammarCompiler, tokenizer: PreTrainedTokenizerBase, temperature: float
) -> None:
    model = local_model(tool_model)
    params = SamplingParams(temperature=temperature)
    end = stops(tokenizer)
    for seed in range(3 if temperature else 1):
        generator = torch.Generator().manual_seed(seed)
        p = processor(compiler, tokenizer)
        ids = tokenizer.encode("to be or not", add_special_tokens=False)
        out: list[int] = []
        with torch.no_grad():
            while not p.finished and len(out) < 80:
                logits = model(torch.tensor([ids + out])).logits[0, -1:].float()  # (1, V)
                token = choose_token(p.process(logits, ids + out, [])[0], params, generator)
                p.accept([token])
                out.append(token)
        assert p.finished, tokenizer.decode(out)
        assert not end & set(out)
        jsonschema.validate(json.loads(str(tokenizer.decode(out))), SCHEMA)
