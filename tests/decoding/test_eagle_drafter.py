"""The EAGLE drafter's tree: grown level by level in the head's cache, it is the tree the head gives when
every level re-runs the whole tree in one step (the reference below), greedy and sampled."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from splitspec.decoding.drafters import is_cheap, is_dear
from splitspec.decoding.eagle import HEAD_WINDOW, EagleDrafter
from splitspec.decoding.local import LocalSequence
from splitspec.decoding.sampling import SamplingParams
from splitspec.decoding.trees import dynamic_tree
from splitspec.exceptions import ConfigError
from splitspec.models.checkpoint import Checkpoint
from splitspec.models.draft_head import DraftHead, default_config
from splitspec.models.kv_cache import KVCache
from splitspec.models.loading import load_full
from splitspec.models.masks import chain, depths
from splitspec.models.stack import FullModel
from splitspec.prefix import window_start

PROMPT = [5, 9, 17, 3, 44, 2, 8, 5, 9, 17, 3, 61, 30, 12, 7]


def _setup(make_checkpoint: Callable[..., Path], family: str) -> tuple[FullModel, DraftHead, LocalSequence]:
    directory = make_checkpoint(family, layers=4)
    model = load_full(Checkpoint(directory), torch.float32)
    torch.manual_seed(1)
    head = DraftHead(default_config(Checkpoint(directory)), torch.device("cpu"), torch.float32).eval()
    verifier = LocalSequence(model)
    verifier.keep_features((4,))
    verifier.run(PROMPT)
    return model, head, verifier


def _reference(
    model: FullModel, head: DraftHead, verifier: LocalSequence, context: list[int], start: int = 0
) -> Callable[..., object]:
    """An expander that re-runs the whole tree each call (the standard tree mask within one step), over the
    committed pairs from ``start`` on, at their own positions."""
    log = verifier.features
    assert log is not None
    committed = len(context) - 1
    cache = KVCache()
    with torch.inference_mode():
        out = head(model, torch.tensor(context[start + 1 :]), log.rows(start, committed),
                   torch.arange(start, committed, dtype=torch.int32),
                   torch.tensor(chain(committed - start), dtype=torch.int32), cache)  # fmt: skip
    root = out[-1]
    root_logits = head.logits(model, root[None])
    predicted: list[torch.Tensor] = []

    @torch.inference_mode()
    def expand(tokens: list[int], parents: list[int], expanding: list[int]) -> torch.Tensor:
        if not tokens:
            return root_logits.expand(len(expanding), -1)
        inputs = torch.stack([root if p < 0 else predicted[p] for p in parents])
        parent_t = torch.tensor(parents, dtype=torch.int32)
        cache.truncate(committed - start)
        rows = head(
            model, torch.tensor(tokens), inputs, (committed + depths(parent_t)).to(torch.int32), parent_t, cache
        )
        predicted[:] = list(rows)
        every = torch.cat([root_logits, head.logits(model, rows)])  # (1 + n, V): the whole tree, rerun
        return every[torch.tensor(expanding) + 1]

    return expand


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_the_grown_tree_is_the_whole_tree_rerun(make_checkpoint: Callable[..., Path], family: str) -> None:
    model, head, verifier = _setup(make_checkpoint, family)
    context = [*PROMPT, 11]
    for params, seed in ((SamplingParams(), None), (SamplingParams(temperature=0.8), 3)):
        gen = None if seed is None else torch.Generator().manual_seed(seed)
        drafter = EagleDrafter(head, lambda: model, verifier, params, gen, top_k=3, depth=4)
        draft = drafter.propose(context, 12)
        ref_gen = None if seed is None else torch.Generator().manual_seed(seed)
        reference = dynamic_tree(_reference(model, head, verifier, context), 12, params, ref_gen, 3, 4)  # type: ignore[arg-type]
        assert len(draft) == 12
        assert (draft.tokens, draft.parents) == (reference.tokens, reference.parents)
        assert len(set(draft.parents)) < len(draft.parents)  # a tree, not a chain
        assert len(drafter.cache) == len(context) - 1  # only the committed pairs stay in the head's cache
        if reference.probs is not None:
            assert draft.probs is not None
            torch.testing.assert_close(draft.probs, reference.probs, rtol=1e-4, atol=1e-5)


def test_no_features_no_draft(make_checkpoint: Callable[..., Path]) -> None:
    model, head, verifier = _setup(make_checkpoint, "llama")
    drafter = EagleDrafter(head, lambda: model, verifier, SamplingParams())
    assert len(drafter.propose([*PROMPT[:-1], 99, 11], 8)) == 0  # not the verifier's context
    assert len(EagleDrafter(head, lambda: model, None, SamplingParams()).propose([*PROMPT, 11], 8)) == 0
    bare = LocalSequence(model)
    bare.run(PROMPT)  # tokens without features
    assert len(EagleDrafter(head, lambda: model, bare, SamplingParams()).propose([*PROMPT, 11], 8)) == 0
    with pytest.raises(ValueError, match="seeded generator"):
        EagleDrafter(head, lambda: model, verifier, SamplingParams(temperature=0.5))


def test_a_head_reading_several_layers_is_refused(make_checkpoint: Callable[..., Path]) -> None:
    directory = make_checkpoint("llama", layers=4)
    model = load_full(Checkpoint(directory), torch.float32)
    head = DraftHead(default_config(Checkpoint(directory), (2, 4)), torch.device("cpu"), torch.float32)
    with pytest.raises(ConfigError, match="several feature layers"):
        EagleDrafter(head, lambda: model, None, SamplingParams())


def test_a_head_proposed_aside_proposes_what_it_would_before_the_step_came_back(
    make_checkpoint: Callable[..., Path],
) -> None:
    """The head is dear (judged aside during a lone greedy step's round trip, decoding/aside.py): proposing there,
    it may run after the verifier committed the step in flight, and must still draft the context it was given."""
    model, head, verifier = _setup(make_checkpoint, "llama")
    context = [*PROMPT, 11]  # 11 pending: the step in flight verifies it
    drafter = EagleDrafter(head, lambda: model, verifier, SamplingParams())
    assert is_dear(drafter)
    assert not is_cheap(drafter)
    before = drafter.propose(context, 8)
    verifier.run([11, 4])  # the step came back: 11 and the next one committed, with their features
    late = EagleDrafter(head, lambda: model, verifier, SamplingParams()).propose(context, 8)
    assert len(before) == 8
    assert (late.tokens, late.parents) == (before.tokens, before.parents)


def test_the_window_holds_half_to_all_of_its_pairs_and_moves_by_half() -> None:
    assert [window_start(n, 8) for n in (0, 5, 8)] == [0, 0, 0]
    assert [window_start(n, 8) for n in (9, 11, 12, 15, 16)] == [4, 4, 8, 8, 12]
    for n in range(9, 200):
        assert 4 <= n - window_start(n, 8) <= 8
    assert window_start(10_000, None) == 0
    assert HEAD_WINDOW == 512


def test_a_windowed_head_drafts_the_tree_of_its_window_alone(make_checkpoint: Callable[..., Path]) -> None:
    """With a window of 8 pairs over a 15-token context, the head's tree is the whole tree re-run over the
    committed pairs from its window's start, at their own positions; and as the context grows (the window
    moving), each draft is a fresh head's."""
    model, head, verifier = _setup(make_checkpoint, "llama")
    context = [*PROMPT, 11]
    start = window_start(len(PROMPT), 8)
    assert start > 0
    sampled = SamplingParams(temperature=0.8)  # q, not only its argmax, shows what the head saw
    drafter = EagleDrafter(head, lambda: model, verifier, sampled, torch.Generator().manual_seed(3), 3, 4, window=8)
    draft = drafter.propose(context, 12)
    expand = _reference(model, head, verifier, context, start)
    reference = dynamic_tree(expand, 12, sampled, torch.Generator().manual_seed(3), 3, 4)  # type: ignore[arg-type]
    assert len(drafter.cache) == len(PROMPT) - start  # the window's pairs alone
    assert (draft.tokens, draft.parents) == (reference.tokens, reference.parents)
    assert draft.probs is not None
    assert reference.probs is not None
    torch.testing.assert_close(draft.probs, reference.probs, rtol=1e-4, atol=1e-5)
    every_pair = _reference(model, head, verifier, context)
    whole = dynamic_tree(every_pair, 12, sampled, torch.Generator().manual_seed(3), 3, 4)  # type: ignore[arg-type]
    assert whole.probs is not None
    assert not torch.allclose(whole.probs, draft.probs, rtol=1e-4, atol=1e-5)  # all the pairs: another q
    drafter = EagleDrafter(head, lambda: model, verifier, SamplingParams(), top_k=3, depth=4, window=8)
    for pending in (4, 30, 2, 9, 17, 5):
        verifier.run([context[-1]])
        context = [*context, pending]
        got = drafter.propose(context, 8)
        fresh = EagleDrafter(head, lambda: model, verifier, SamplingParams(), top_k=3, depth=4, window=8)
        want = fresh.propose(context, 8)
        assert (got.tokens, got.parents) == (want.tokens, want.parents)
        assert 4 <= len(drafter.cache) <= 8
    with pytest.raises(ValueError, match="window"):
        EagleDrafter(head, lambda: model, verifier, SamplingParams(), window=1)
