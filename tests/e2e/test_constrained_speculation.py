"""Structured output with speculation, through a real trunk server: drafts are cut at the first token the
grammar forbids and every verified row is masked, so greedy constrained output equals one-token
constrained output, sampled output always validates, and drafts are still accepted."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import jsonschema
import pytest
from transformers import AutoTokenizer

from splitspec.cloud.config import CloudConfig
from splitspec.cloud.server import TrunkServer
from splitspec.decoding.grammar import GrammarCompiler
from splitspec.decoding.loop import SpecStep
from splitspec.decoding.sampling import SamplingParams
from splitspec.edge import EdgeConfig, SplitClient
from tests.tool_model import TOOL_VOCAB

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Lyon", "Nice"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
        "sunny": {"type": "boolean"},
    },
    "required": ["city", "days", "sunny"],
    "additionalProperties": False,
}
# earlier answers in the prompt: what prompt lookup drafts from (the keys and their punctuation)
PROMPT = 'weather: {"city": "Lyon", "days": 4, "sunny": false}\nweather: {"city": "Nice", "days": 2, "sunny": true}\n'


async def _generate(
    client: SplitClient, compiler: GrammarCompiler, ids: list[int], stop: set[int], params: SamplingParams, mode: str
) -> tuple[list[int], list[SpecStep]]:
    processor = compiler.processor(compiler.json_schema(SCHEMA), stop)
    trace: list[SpecStep] = []
    out = [
        e.token
        async for e in client.stream_tokens(
            ids, 60, params, stop_token_ids=stop, speculate=mode, trace=trace, processors=(processor,)
        )
    ]
    assert processor.finished
    return [t for t in out if t not in stop], trace


@pytest.mark.parametrize("mode", ["prompt-lookup", "ngram"])
async def test_constrained_speculation(tool_model: Path, make_checkpoint: Callable[..., Path], mode: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tool_model, local_files_only=True)
    compiler = GrammarCompiler(tokenizer, TOOL_VOCAB)
    stop = {tokenizer.added_tokens_encoder["<|im_end|>"]}
    ids = tokenizer.encode(PROMPT + "weather: ", add_special_tokens=False)
    async with TrunkServer(CloudConfig(model_dir=tool_model, port=0)) as server:
        config = EdgeConfig(allow_stock_edge_weights=True, model_dir=tool_model, cloud_url=server.url)
        async with SplitClient(config) as client:
            alone, _ = await _generate(client, compiler, ids, stop, SamplingParams(), "off")
            greedy, trace = await _generate(client, compiler, ids, stop, SamplingParams(), mode)
            sampled = [
                await _generate(client, compiler, ids, stop, SamplingParams(temperature=1.0, seed=s), mode)
                for s in range(20)
            ]
    assert greedy == alone  # speculation changes nothing under the grammar
    jsonschema.validate(json.loads(str(tokenizer.decode(greedy))), SCHEMA)
    for tokens, _ in sampled:
        jsonschema.validate(json.loads(str(tokenizer.decode(tokens))), SCHEMA)
    steps = [s for _, t in sampled for s in t] + trace
    per_trip = sum(s.emitted for s in steps) / len(steps)
    assert sum(s.accepted for s in steps) > 0  # drafts went through the grammar and were accepted
    assert per_trip > 1.0, per_trip
