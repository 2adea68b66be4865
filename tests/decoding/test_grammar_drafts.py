"""Drafts under a grammar and stop tokens: a speculative decode emits what one token at a time emits, and leaves
its caches as one-token decoding does.

The verifier is scripted: its logits prefer the next token of a fixed answer (a JSON object, then the stop
token), and a lookup drafter proposes the rest of that answer, so every draft is accepted whole unless the loop
cuts it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from splitspec.decoding.adjusters import MinTokens
from splitspec.decoding.controller import FixedPolicy
from splitspec.decoding.drafters import Draft
from splitspec.decoding.grammar import GrammarCompiler
from splitspec.decoding.loop import decode
from splitspec.decoding.processors import LogitsProcessor, ProcessorChain
from splitspec.decoding.sampling import SamplingParams
from tests.tool_model import TOOL_VOCAB

PROMPT = [5, 6]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}


class ScriptedVerifier:
    """Row i of a step prefers ``answer[k]`` for the k-th token after the prompt (``fallback`` past its end)."""

    def __init__(self, answer: Sequence[int], vocab: int, fallback: int) -> None:
        self.answer, self.vocab, self.fallback = list(answer), vocab, fallback
        self.tokens: list[int] = []  # what its caches hold
        self._last = 0

    def reset(self) -> None:
        self.tokens = []

    def keep(self, indices: Sequence[int]) -> None:
        start = len(self.tokens) - self._last
        self.tokens = self.tokens[:start] + [self.tokens[start + i] for i in indices]

    async def forward(
        self,
        tokens: Sequence[int],
        parents: Sequence[int] | None = None,
        logits_from: int = 0,
        *,
        sent: Callable[[], None] | None = None,
    ) -> torch.Tensor:
        if sent is not None:
            sent()
        rows = torch.zeros(len(tokens), self.vocab)
        for i in range(len(tokens)):
            k = len(self.tokens) + i + 1 - len(PROMPT)
            rows[i, self.answer[k] if 0 <= k < len(self.answer) else self.fallback] = 10.0
        self.tokens += list(tokens)
        self._last = len(tokens)
        return rows[logits_from:]


class AnswerLookup:
    """Proposes the rest of the scripted answer (as prompt lookup would, from a prompt that quotes it)."""

    name = "lookup"

    def __init__(self, answer: Sequence[int]) -> None:
        self.answer = list(answer)

    def propose(self, context: Sequence[int], budget: int) -> Draft:
        rest = self.answer[len(context) - len(PROMPT) :][:budget]
        return Draft(rest, list(range(-1, len(rest) - 1)))


async def _decode(
    verifier: ScriptedVerifier,
    processors: Sequence[LogitsProcessor],
    drafting: AnswerLookup | None,
    temperature: float,
    stop: set[int],
) -> list[int]:
    drafters = {} if drafting is None else {"lookup": drafting}
    policy = None if drafting is None else FixedPolicy("lookup", 8)
    params = SamplingParams(temperature=temperature)
    generator = torch.Generator().manual_seed(0)
    stream = decode(verifier, PROMPT, 30, params, generator, drafters, policy, stop, processors=processors)
    return [emitted.token async for emitted in stream]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("min_tokens", [0, 20])
async def test_a_draft_that_completes_the_grammar_decodes_as_one_token_at_a_time(
    tool_model: Path, temperature: float, min_tokens: int
) -> None:
    """The token that completes the grammar comes from its own row: a draft holding it used to be verified with
    one row more, where only the stop token may follow. That emitted a stop token one-token decoding never
    makes, and with min_tokens (which forbids the stop token too) the row had no token at all: greedy picked
    token 0, which broke the grammar, and sampling met a row of NaN."""
    tokenizer = AutoTokenizer.from_pretrained(tool_model, local_files_only=True)
    compiler = GrammarCompiler(tokenizer, TOOL_VOCAB)
    stop = {tokenizer.added_tokens_encoder["<|im_end|>"]}
    answer = tokenizer.encode(json.dumps({"a": 1}), add_special_tokens=False)

    def processors() -> list[LogitsProcessor]:
        grammar = compiler.processor(compiler.json_schema(SCHEMA), stop)
        return [ProcessorChain([MinTokens(min_tokens, stop), grammar])] if min_tokens else [grammar]

    alone = await _decode(ScriptedVerifier(answer, TOOL_VOCAB, 0), processors(), None, temperature, stop)
    drafted = await _decode(
        ScriptedVerifier(answer, TOOL_VOCAB, 0), processors(), AnswerLookup(answer), temperature, stop
    )
    assert alone == answer  # the grammar completes with the object: nothing follows it
    assert drafted == alone


async def test_a_stop_token_inside_the_accepted_path_leaves_the_rest_out_of_the_caches() -> None:
    """A draft accepted whole past a stop token: the tokens after it are not emitted, and the caches hold what
    was emitted but its last token, as after any step (the next turn of a chat appends to them)."""
    stop = 15
    answer = [1, 2, stop, 7, 8]
    verifier = ScriptedVerifier(answer, 16, 0)
    emitted = await _decode(verifier, [], AnswerLookup(answer), 0.0, {stop})
    assert emitted == [1, 2, stop]
    assert verifier.tokens == [*PROMPT, 1, 2]  # held [5, 6, 1, 2, 15, 7, 8]
