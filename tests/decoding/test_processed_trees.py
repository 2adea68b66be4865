"""Draft trees under logits processors: every verified row is processed along its own path, nodes a processor
forbids are pruned, and greedy output equals one-token greedy decoding under the same processors."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch

from splitspec.decoding.adjusters import BadWords, LogitBias, Penalties, RepetitionPenalty
from splitspec.decoding.controller import FixedPolicy
from splitspec.decoding.drafters import Draft
from splitspec.decoding.local import LocalSequence
from splitspec.decoding.loop import decode, paths, prune_draft
from splitspec.decoding.processors import LogitsProcessor
from splitspec.decoding.sampling import SamplingParams
from splitspec.decoding.speculative import SpecStep
from splitspec.models.checkpoint import Checkpoint
from splitspec.models.loading import load_full
from splitspec.models.stack import FullModel

PROMPT = [5, 9, 17, 3, 44, 2, 8, 5, 9, 17, 3, 61, 30, 12, 7, 5, 9]
TOKENS = 24


def processors() -> list[LogitsProcessor]:
    return [LogitBias({3: 2.0, 11: -1.5}, 64), BadWords([[7], [5, 9]]), RepetitionPenalty(1.4), Penalties(0.3, 0.2)]


class SecondChildOracle:
    """Knows the answer: at each step a tree whose first root is wrong and whose second root starts the right
    continuation (with a wrong and a right child under it, and so on): only a tree verifier accepts it."""

    name = "oracle"

    def __init__(self, answer: Sequence[int], prompt: Sequence[int], vocab: int) -> None:
        self.answer, self.prompt, self.vocab = list(answer), list(prompt), vocab

    def propose(self, context: Sequence[int], budget: int) -> Draft:
        done = len(context) - len(self.prompt)
        right = self.answer[done : done + 4]
        tokens: list[int] = []
        parents: list[int] = []
        parent = -1
        for k, token in enumerate(right[:3]):
            # a wrong sibling first: the right token of the next level where it can be (a row processed as if it
            # followed its wrong sibling would count that token as seen), then the right token
            wrong = right[k + 1] if k + 1 < len(right) and right[k + 1] != token else (token + 1) % self.vocab
            tokens += [wrong, token]
            parents += [parent, parent]
            parent = len(tokens) - 1
        return Draft(tokens[:budget], parents[:budget])


async def greedy(model: FullModel, drafter: SecondChildOracle | None, trace: list[SpecStep]) -> list[int]:
    stream = decode(
        LocalSequence(model), PROMPT, TOKENS, SamplingParams(), torch.Generator(),
        {"oracle": drafter} if drafter else {}, FixedPolicy("oracle", 6) if drafter else None,
        trace=trace, processors=processors(),
    )  # fmt: skip
    return [e.token async for e in stream]


@pytest.fixture(scope="module")
def model(make_checkpoint: Callable[..., Path]) -> FullModel:
    return load_full(Checkpoint(make_checkpoint("llama")), torch.float32)


async def test_a_tree_under_processors_is_verified_along_each_path(model: FullModel) -> None:
    one_token = await greedy(model, None, [])
    assert 7 not in one_token  # the premise: the processors act (7 is banned)
    trace: list[SpecStep] = []
    drafted = await greedy(model, SecondChildOracle(one_token, PROMPT, model.config.vocab_size), trace)
    assert drafted == one_token
    # the right tokens sit under wrong first siblings: a first-branch chain would accept nothing
    assert sum(s.accepted for s in trace) >= TOKENS // 2


def test_prune_draft_drops_what_a_processor_forbids_with_its_subtree() -> None:
    draft = Draft([4, 7, 6, 8, 9], [-1, -1, 0, 1, 2])  # 7 is banned: it and its child 8 go
    pruned = prune_draft(draft, [BadWords([[7], [6, 9]])])  # 9 after 6 is banned too
    assert (pruned.tokens, pruned.parents) == ([4, 6], [-1, 0])
    assert prune_draft(Draft([1, 2], [-1, 0]), [BadWords([[7]])]) == Draft([1, 2], [-1, 0])
    assert paths([-1, -1, 0, 1, 2]) == [[0], [1], [0, 2], [1, 3], [0, 2, 4]]
