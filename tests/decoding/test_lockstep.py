"""Draft-model proposals of several sequences in lockstep: each tree equals the one its drafter grows alone, the
forwards of a round run as one batch, and a failure stays with the proposals it belongs to."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch

from splitspec.decoding.aside import DraftExecutor
from splitspec.decoding.drafters import Draft, DraftModel, MixedDrafter, NgramPool, PromptLookup
from splitspec.decoding.local import LocalSequence
from splitspec.decoding.lockstep import Steps, at_once, finish, finish_together
from splitspec.decoding.sampling import SamplingParams
from splitspec.models import draft_forward
from splitspec.models.checkpoint import Checkpoint
from splitspec.models.draft_forward import ALONE_QUERIES, DraftForward, run_draft_forward, run_draft_forwards
from splitspec.models.kv_cache import KVCache
from splitspec.models.loading import load_full
from splitspec.models.masks import chain
from splitspec.models.stack import FullModel

CONTEXTS = ([5, 9, 17, 3, 44, 2, 8, 5, 9], [7, 7, 12, 30, 2], list(range(3, 40)), [61, 30, 12, 7, 5, 9, 17, 3])


@pytest.fixture
def model(make_checkpoint: Callable[..., Path]) -> FullModel:
    return load_full(Checkpoint(make_checkpoint("llama", layers=2, seed=99)), torch.float32)


def _drafters(model: FullModel, params: SamplingParams) -> list[DraftModel]:
    """One draft model per sequence over the one shared model; a sampling one with its own seeded generator."""
    return [
        DraftModel(model, params, None if params.greedy else torch.Generator().manual_seed(i), top_k=2, depth=4)
        for i in range(len(CONTEXTS))
    ]


def _tree(draft: Draft) -> tuple[list[int], list[int]]:
    return draft.tokens, draft.parents


@pytest.fixture
def batches(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many forwards each batch :func:`finish_together` runs holds, from now on."""
    sizes: list[int] = []
    run = draft_forward.run_draft_forwards

    def counted(requests: Sequence[DraftForward]) -> list[torch.Tensor]:
        sizes.append(len(requests))
        return run(requests)

    monkeypatch.setattr(draft_forward, "run_draft_forwards", counted)
    return sizes


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_trees_grown_in_lockstep_equal_each_grown_alone(
    model: FullModel, batches: list[int], temperature: float
) -> None:
    params = SamplingParams(temperature=temperature)
    budgets = [6, 3, 8, 5]
    by_one, together = _drafters(model, params), _drafters(model, params)
    contexts = list(CONTEXTS)
    for _ in range(2):  # the second round catches each cache up from the first's context
        alone = [d.propose(c, b) for d, c, b in zip(by_one, contexts, budgets, strict=True)]
        outcomes = finish_together([d.propose_steps(c, b) for d, c, b in zip(together, contexts, budgets, strict=True)])
        for outcome, expected in zip(outcomes, alone, strict=True):
            assert outcome.error is None
            assert _tree(outcome.result()) == _tree(expected)
            if not params.greedy:
                assert outcome.value is not None
                assert outcome.value.probs is not None
                assert expected.probs is not None
                torch.testing.assert_close(outcome.value.probs, expected.probs, rtol=1e-4, atol=1e-6)
            assert outcome.seconds > 0
        contexts = [[*c, *a.tokens[:1], 4] for c, a in zip(contexts, alone, strict=True)]
    assert max(batches) == len(CONTEXTS)  # the catch-ups and first levels of all four ran as one forward
    for drafter, context in zip(together, contexts, strict=True):  # the tree's entries went; the next context's not in
        assert len(drafter.sequence.cache) == len(drafter.sequence.tokens) == len(context) - 2


def test_a_mixed_tree_with_a_draft_model_runs_its_forwards_in_lockstep(model: FullModel, batches: list[int]) -> None:
    def mix(drafter: DraftModel) -> MixedDrafter:
        return MixedDrafter([drafter, PromptLookup(), NgramPool()])  # the draft model first: every mix asks it

    alone = [mix(d).propose(c, 6) for d, c in zip(_drafters(model, SamplingParams()), CONTEXTS, strict=True)]
    outcomes = finish_together(
        [mix(d).propose_steps(c, 6) for d, c in zip(_drafters(model, SamplingParams()), CONTEXTS, strict=True)]
    )
    assert [_tree(o.result()) for o in outcomes] == [_tree(a) for a in alone]
    assert max(batches) == len(CONTEXTS)


def test_a_failing_proposal_fails_alone(model: FullModel) -> None:
    drafters = _drafters(model, SamplingParams())

    def failing() -> Steps[Draft]:
        yield from drafters[0].propose_steps(CONTEXTS[0], 4)
        raise ValueError("no tree")

    outcomes = finish_together([failing(), drafters[1].propose_steps(CONTEXTS[1], 4)])
    assert isinstance(outcomes[0].error, ValueError)
    with pytest.raises(ValueError, match="no tree"):
        outcomes[0].result()
    assert outcomes[1].error is None
    assert _tree(outcomes[1].result()) == _tree(_drafters(model, SamplingParams())[1].propose(CONTEXTS[1], 4))


def test_a_failing_forward_reaches_every_proposal_waiting_on_it(
    model: FullModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(requests: Sequence[DraftForward]) -> list[torch.Tensor]:
        raise RuntimeError("out of memory")

    monkeypatch.setattr(draft_forward, "run_draft_forwards", broken)
    drafters = _drafters(model, SamplingParams())
    for drafter, context in zip(drafters, CONTEXTS, strict=True):
        drafter.prepare(context)
    outcomes = finish_together([d.propose_steps(c, 4) for d, c in zip(drafters, CONTEXTS, strict=True)])
    assert [type(o.error) for o in outcomes] == [RuntimeError] * len(CONTEXTS), [o.error for o in outcomes]
    # each proposal's cleanup ran: its cache holds its context's committed prefix, nothing of a tree
    assert all(len(d.sequence.cache) == len(d.sequence.tokens) for d in drafters)


def test_steps_that_need_no_forward_finish_at_once() -> None:
    assert finish(at_once(7)) == 7
    assert finish_together([at_once("a"), at_once("b")])[1].result() == "b"


def _step(model: FullModel, cache: KVCache, tokens: list[int], logits_from: int = 0) -> DraftForward:
    past = len(cache)
    return DraftForward(
        model,
        cache,
        torch.tensor(tokens),
        torch.arange(past, past + len(tokens), dtype=torch.int32),
        parents=torch.tensor(chain(len(tokens)), dtype=torch.int32),
        logits_from=logits_from,
    )


def _wave(model: FullModel, cache: KVCache, tokens: list[int]) -> DraftForward:
    """Siblings after the cached prefix: each sees the prefix and itself."""
    past, q = len(cache), len(tokens)
    visible = torch.zeros(q, past + q, dtype=torch.bool)
    visible[:, :past] = True
    visible[:, past:] = torch.eye(q, dtype=torch.bool)
    positions = torch.full((q,), past, dtype=torch.int32)
    keys = torch.cat([torch.arange(past, dtype=torch.int32), positions])
    return DraftForward(model, cache, torch.tensor(tokens), positions, visible=visible, key_positions=keys)


def test_a_batch_of_steps_and_waves_computes_what_each_does_alone(model: FullModel) -> None:
    def caches() -> list[KVCache]:
        out = []
        for context in CONTEXTS[:3]:
            cache = KVCache()
            run_draft_forward(_step(model, cache, context))
            out.append(cache)
        return out

    def requests(cs: list[KVCache]) -> list[DraftForward]:
        long = list(range(3, 3 + ALONE_QUERIES + 1))  # more queries than a batch takes: run alone
        return [_step(model, cs[0], [4, 5, 6], logits_from=2), _wave(model, cs[1], [8, 9]), _step(model, cs[2], long)]

    alone = [run_draft_forward(r) for r in requests(caches())]
    together = run_draft_forwards(requests(caches()))
    assert [t.shape[0] for t in together] == [a.shape[0] for a in alone] == [1, 2, ALONE_QUERIES + 1]
    for t, a in zip(together, alone, strict=True):
        torch.testing.assert_close(t, a, rtol=1e-4, atol=1e-4)


def test_a_sequence_step_is_the_forward_its_run_makes(model: FullModel) -> None:
    ran, stepped = LocalSequence(model), LocalSequence(model)
    expected = ran.run(CONTEXTS[0], logits_from=3)
    torch.testing.assert_close(run_draft_forward(stepped.step(CONTEXTS[0], logits_from=3)), expected)
    assert len(stepped.cache) == len(ran.cache)
    keeping = LocalSequence(model)
    keeping.keep_features([1])
    with pytest.raises(ValueError, match="runs its steps itself"):
        keeping.step([1, 2])


def test_draft_forwards_are_refused_where_they_cannot_run(model: FullModel) -> None:
    cache = KVCache()
    with pytest.raises(ValueError, match="either a step"):
        DraftForward(model, cache, torch.tensor([1]), torch.tensor([0], dtype=torch.int32))
    with pytest.raises(ValueError, match="logits_from 1 is not a query of 1"):
        _step(model, cache, [1], logits_from=1)
    with pytest.raises(ValueError, match="over one cache"):
        run_draft_forwards([_step(model, cache, [1]), _step(model, cache, [2])])
    assert draft_forward.ALONE_QUERIES == ALONE_QUERIES


async def test_the_executor_runs_the_proposals_asked_in_one_turn_together(model: FullModel) -> None:
    executor = DraftExecutor(threaded=False)
    drafters = _drafters(model, SamplingParams())
    jobs = [executor.propose(d, c, 5) for d, c in zip(drafters, CONTEXTS, strict=True)]
    assert not any(job.done() for job in jobs)  # nothing runs before the caller yields
    assert executor.expected_wait() == 0.0  # not timed yet
    results = await asyncio.gather(*(asyncio.wrap_future(job) for job in jobs))
    expected = [d.propose(c, 5) for d, c in zip(_drafters(model, SamplingParams()), CONTEXTS, strict=True)]
    assert [_tree(draft) for draft, _ in results] == [_tree(e) for e in expected]
    assert all(seconds > 0 for _, seconds in results)
    assert executor.lockstep_log.snapshot().keys() == {len(CONTEXTS)}  # one run of all four
    assert executor.idle
    # a drafter that is not stepwise runs as a job of its own; outside a loop a proposal runs at once
    lookup = await asyncio.wrap_future(executor.propose(PromptLookup(), [1, 2, 3, 1, 2], 2))
    assert _tree(lookup[0]) == _tree(PromptLookup().propose([1, 2, 3, 1, 2], 2))
    assert executor.lockstep_log.snapshot().keys() == {len(CONTEXTS)}
    executor.shutdown()


async def test_a_proposal_whose_caller_went_away_is_not_run_and_the_others_are(model: FullModel) -> None:
    executor = DraftExecutor(threaded=False)
    drafters = _drafters(model, SamplingParams())
    jobs = [executor.propose(d, c, 5) for d, c in zip(drafters, CONTEXTS, strict=True)]
    jobs[1].cancel()  # a closed request's proposal, before the lockstep runs
    results = await asyncio.gather(*(asyncio.wrap_future(job) for i, job in enumerate(jobs) if i != 1))
    expected = [d.propose(c, 5) for d, c in zip(_drafters(model, SamplingParams()), CONTEXTS, strict=True)]
    assert [_tree(draft) for draft, _ in results] == [_tree(e) for i, e in enumerate(expected) if i != 1]
    assert len(drafters[1].sequence.tokens) == 0  # never ran
    assert executor.lockstep_log.snapshot().keys() == {len(CONTEXTS) - 1}
    assert executor.expected_wait() == 0.0  # nothing left outstanding
    executor.shutdown()


def test_an_executor_outside_an_event_loop_proposes_at_once(model: FullModel) -> None:
    executor = DraftExecutor(threaded=False)
    job = executor.propose(_drafters(model, SamplingParams())[0], CONTEXTS[0], 4)
    assert job.done()
    assert _tree(job.result()[0]) == _tree(_drafters(model, SamplingParams())[0].propose(CONTEXTS[0], 4))
    failing = executor.propose(_Failing(), CONTEXTS[0], 4)
    assert isinstance(failing.exception(), ValueError)
    assert executor.idle
    executor.shutdown()


class _Failing:
    name = "failing"

    def propose(self, context: Sequence[int], budget: int) -> Draft:
        return finish(self.propose_steps(context, budget))

    def propose_steps(self, context: Sequence[int], budget: int) -> Steps[Draft]:
        yield from ()
        raise ValueError("no draft")


def test_a_threaded_executor_proposes_on_its_thread(model: FullModel) -> None:
    executor = DraftExecutor(threaded=True)
    try:
        draft, seconds = executor.propose(_drafters(model, SamplingParams())[0], CONTEXTS[0], 4).result(timeout=30)
        assert _tree(draft) == _tree(_drafters(model, SamplingParams())[0].propose(CONTEXTS[0], 4))
        assert seconds > 0
        assert executor.lockstep_log.snapshot() == {}
    finally:
        executor.shutdown()
