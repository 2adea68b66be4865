"""Draft proposals of several sequences batched in lockstep (models/wave_batcher.py) draft what each drafts alone."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from splitspec.decoding.drafters import DraftModel
from splitspec.decoding.sampling import SamplingParams
from splitspec.decoding.tree_run import TreeRun
from splitspec.decoding.trees import Draft
from splitspec.models.batched import BatchRow, forward_batch
from splitspec.models.checkpoint import Checkpoint
from splitspec.models.kv_cache import KVCache
from splitspec.models.masks import depths
from splitspec.models.stack import FullModel, load_full
from splitspec.models.wave_batcher import WaveBatcher
from tests.families import save_family_checkpoint

# each sequence's context: different lengths, so the batched rows are ragged
CONTEXTS = [[5, 9, 13, 2, 7], [3, 3, 8], [11, 4, 6, 1, 9, 12, 10, 2, 5], [7, 1]]


def _drafts(model: FullModel, params: SamplingParams, waves: WaveBatcher | None, steps: int) -> list[list[Draft]]:
    """Each sequence's drafts over ``steps`` proposals (its context growing by its first draft token), the
    sequences proposing at once on threads of their own when ``waves`` batches them, else one after another."""
    drafters = [
        DraftModel(model, params, torch.Generator().manual_seed(100 + i), top_k=3, depth=4, waves=waves)
        for i in range(len(CONTEXTS))
    ]

    def run(i: int) -> list[Draft]:
        context, out = list(CONTEXTS[i]), []
        for _ in range(steps):
            draft = drafters[i].propose(context, 9)
            out.append(draft)
            context.append(draft.tokens[0] if len(draft) else 0)
        return out

    if waves is None:
        return [run(i) for i in range(len(CONTEXTS))]
    with ThreadPoolExecutor(len(CONTEXTS)) as pool:
        return list(pool.map(run, range(len(CONTEXTS))))


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.8)], ids=["greedy", "sampled"])
def test_concurrent_proposals_batch_and_draft_what_each_drafts_alone(
    make_checkpoint: Callable[..., Path], params: SamplingParams
) -> None:
    model = load_full(Checkpoint(make_checkpoint("llama", layers=2)), torch.float32)
    alone = _drafts(model, params, None, steps=3)
    waves = WaveBatcher(model, patience_s=5.0)  # long patience: every batch is the lockstep set
    batched = _drafts(model, params, waves, steps=3)
    for mine, want in zip(batched, alone, strict=True):
        for got, ref in zip(mine, want, strict=True):
            assert (got.tokens, got.parents) == (ref.tokens, ref.parents)
            if ref.probs is not None:
                assert got.probs is not None
                torch.testing.assert_close(got.probs, ref.probs, rtol=1e-4, atol=1e-6)
    sizes = waves.log.snapshot()
    assert max(sizes) > 1, f"no forward ran several sequences' waves: {sizes}"


def test_a_lone_forward_runs_at_once(make_checkpoint: Callable[..., Path]) -> None:
    model = load_full(Checkpoint(make_checkpoint("llama", layers=2)), torch.float32)
    waves = WaveBatcher(model, patience_s=60.0)  # a lone caller must not wait for it
    drafter = DraftModel(model, SamplingParams(), waves=waves)
    reference = DraftModel(model, SamplingParams())
    draft = drafter.propose(CONTEXTS[0], 6)
    assert (draft.tokens, draft.parents) == (reference.propose(CONTEXTS[0], 6).tokens, draft.parents)
    assert set(waves.log.snapshot()) == {1}
    assert len(drafter.sequence.cache) == len(CONTEXTS[0])  # the tree's entries are gone, the context stays


def test_a_failed_batch_raises_in_every_waiting_thread(make_checkpoint: Callable[..., Path]) -> None:
    model = load_full(Checkpoint(make_checkpoint("llama", layers=2)), torch.float32)
    waves = WaveBatcher(model, patience_s=5.0)
    start = threading.Barrier(2)

    def one(vocab_id: int) -> str:
        cache = KVCache()
        with waves.drafting():
            start.wait()
            visible = torch.ones(1, 1, dtype=torch.bool)
            at = torch.zeros(1, dtype=torch.int32)
            try:
                waves.forward(cache, torch.tensor([vocab_id]), at, visible, at)
            except IndexError as error:
                return type(error).__name__
            return "ran"

    # one row's token is out of the vocabulary: its embedding fails before the batch, on its own thread;
    # the other then runs alone once the failed proposal has left
    with ThreadPoolExecutor(2) as pool:
        outcomes = sorted(pool.map(one, [1, 10**9]))
    assert outcomes == ["IndexError", "ran"]


@pytest.mark.parametrize("family", ["llama3", "mistral", "gemma2"])  # windows; gemma2: eager soft-capping
def test_tree_waves_batch_with_steps_each_as_alone(tmp_path: Path, family: str) -> None:
    ckpt = Checkpoint(save_family_checkpoint(tmp_path, family, layers=2, seed=5, dtype=torch.float32))
    model = load_full(ckpt, torch.float32)
    stack, width = model.layers, int(ckpt.config.hidden_size)
    torch.manual_seed(0)
    rows, expected, pairs = [], [], []
    for past, nodes in ((7, [-1, 0, 0, 1]), (3, [-1, -1, 1])):  # two drafts' trees, grown a level per wave
        solo, batched = KVCache(), KVCache()
        prefix = torch.randn(1, past, width)
        for cache in (solo, batched):
            stack(prefix, torch.arange(past, dtype=torch.int32), torch.arange(-1, past - 1, dtype=torch.int32), cache)
        run_solo, run_batched = TreeRun(past), TreeRun(past)
        first = run_solo.wave(nodes, [i for i, p in enumerate(nodes) if p < 0])  # the roots, alone on both
        run_batched.wave(nodes, first.nodes)
        roots = torch.randn(1, len(first.nodes), width)
        stack.forward_visible(roots, first.positions, first.visible, first.key_positions, solo)
        stack.forward_visible(roots, first.positions, first.visible, first.key_positions, batched)
        wave = run_solo.wave(nodes, [i for i, p in enumerate(nodes) if p >= 0 and run_solo.ran(p)])
        hidden = torch.randn(1, len(wave.nodes), width)
        expected.append(stack.forward_visible(hidden, wave.positions, wave.visible, wave.key_positions, solo))
        parents = torch.zeros(len(wave.nodes), dtype=torch.int32)
        rows.append(
            BatchRow(hidden, wave.positions, parents, batched, visible=wave.visible, key_positions=wave.key_positions)
        )
        pairs.append((solo, batched))
    # and a plain step (parents' mask) in the same batch
    solo, batched = KVCache(), KVCache()
    step_parents = torch.tensor([-1, 0, 0], dtype=torch.int32)
    hidden = torch.randn(1, 3, width)
    at = depths(step_parents).to(torch.int32)
    expected.append(stack(hidden, at, step_parents, solo))
    rows.append(BatchRow(hidden, at, step_parents, batched))
    pairs.append((solo, batched))
    for out, want, (solo, batched) in zip(forward_batch(stack, rows), expected, pairs, strict=True):
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        assert len(batched) == len(solo)


def test_a_waiting_forward_runs_after_its_patience_when_another_proposal_never_asks(
    make_checkpoint: Callable[..., Path],
) -> None:
    model = load_full(Checkpoint(make_checkpoint("llama", layers=2)), torch.float32)
    waves = WaveBatcher(model, patience_s=0.05)
    entered, release = threading.Event(), threading.Event()

    def idle_proposal() -> None:  # in progress, but building its tree in Python: no forward asked yet
        with waves.drafting():
            entered.set()
            release.wait(10)

    with ThreadPoolExecutor(1) as pool:
        idle = pool.submit(idle_proposal)
        assert entered.wait(5)
        with waves.drafting():
            visible = torch.ones(2, 2, dtype=torch.bool).tril()
            at = torch.arange(2, dtype=torch.int32)
            logits = waves.forward(KVCache(), torch.tensor([3, 4]), at, visible, at)  # waits 50 ms, then runs
        assert not idle.done()  # it ran while the other proposal was still in progress
        release.set()
        idle.result(timeout=5)
    assert logits.shape == (2, model.vocab_size)
    assert waves.log.forwards == {1: 1}
