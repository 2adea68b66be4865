"""Drafters catch up with the prompt during the prefill: a draft model's cache holds the prompt before
the first draft is asked, proposals are unchanged, and greedy output stays one-token greedy. A drafter
that reads the verifier's features (an EAGLE head) catches up during the first decode steps instead."""

from __future__ import annotations

import asyncio
import itertools
import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from splitspec.decoding.aside import DraftExecutor
from splitspec.decoding.controller import BlindPolicy, Choice, FixedPolicy, SpeculationPolicy
from splitspec.decoding.drafters import (
    Draft,
    Drafter,
    DraftModel,
    MixedDrafter,
    NgramPool,
    Preparable,
    PromptLookup,
    is_cheap,
)
from splitspec.decoding.eagle import EagleDrafter
from splitspec.decoding.local import LocalSequence
from splitspec.decoding.loop import decode
from splitspec.decoding.sampling import SamplingParams
from splitspec.decoding.speculative import make_drafters
from splitspec.decoding.warmup import CATCH_UP_MIN_TOKENS, PREPARE_PIECE_TOKENS, start_catch_up, start_prepare
from splitspec.models.checkpoint import Checkpoint
from splitspec.models.draft_head import DraftHead, default_config
from splitspec.models.loading import load_full
from splitspec.models.stack import FullModel
from splitspec.prefix import window_start
from tests.conftest import local_greedy

PROMPT = [5, 9, 17, 3, 44, 2, 8, 5, 9, 17, 3, 61, 30, 12, 7, 5, 9, 40, 41, 42, 5, 9, 17]


def full(directory: Path) -> FullModel:
    return load_full(Checkpoint(directory), torch.float32)


class RecordingDraftModel(DraftModel):
    """A draft model that notes how many tokens its cache held when each proposal was asked."""

    def __init__(self, model: FullModel) -> None:
        super().__init__(model, SamplingParams())
        self.cached_at_propose: list[int] = []

    def propose(self, context: Sequence[int], budget: int) -> Draft:
        self.cached_at_propose.append(len(self.sequence.tokens))
        return super().propose(context, budget)


class WaitingVerifier:
    """A local verifier that awaits :meth:`before` once each step is sent, ahead of its forward (a round trip in
    flight)."""

    def __init__(self, model: FullModel) -> None:
        self.inner = LocalSequence(model)

    async def own_side(self, tokens: Sequence[int]) -> None:
        """What happens before the step of ``tokens`` is sent (the edge's head forward)."""

    async def before(self, tokens: Sequence[int]) -> None:
        """What happens while the forward of ``tokens`` is in flight."""

    async def forward(
        self,
        tokens: Sequence[int],
        parents: Sequence[int] | None = None,
        logits_from: int = 0,
        *,
        sent: Callable[[], None] | None = None,
    ) -> torch.Tensor:
        await self.own_side(tokens)
        if sent is not None:
            sent()  # the step's own work on this side is done: its reply is what is awaited
        await self.before(tokens)
        return await self.inner.forward(tokens, parents, logits_from)

    def keep(self, indices: Sequence[int]) -> None:
        self.inner.keep(indices)

    def reset(self) -> None:
        self.inner.reset()


class PrefillWaitsForDrafter(WaitingVerifier):
    """A local verifier whose prefill does not return before the drafter's cache holds the prompt:
    the prefill can only finish if the drafter was prepared while it was in flight."""

    def __init__(self, model: FullModel, drafter: DraftModel, prompt_len: int, timeout_s: float = 10.0) -> None:
        super().__init__(model)
        self.drafter = drafter
        self.prompt_len = prompt_len
        self.timeout_s = timeout_s
        self.cached_when_prefill_returned = -1

    async def before(self, tokens: Sequence[int]) -> None:
        if not self.inner.tokens:  # the prefill: the round trip is in flight while the drafter prepares
            deadline = time.monotonic() + self.timeout_s
            while len(self.drafter.sequence.tokens) < self.prompt_len:
                if time.monotonic() > deadline:
                    raise TimeoutError("the drafter was not prepared during the prefill")
                await asyncio.sleep(0.005)
            self.cached_when_prefill_returned = len(self.drafter.sequence.tokens)


async def decode_on_a_drafting_thread(
    verifier: WaitingVerifier, prompt: list[int], n: int, drafters: dict[str, Drafter], policy: SpeculationPolicy
) -> list[int]:
    """Greedy :func:`decode` of ``n`` tokens with the drafters on a drafting thread of their own."""
    executor = ThreadPoolExecutor(max_workers=1)
    try:
        out = decode(
            verifier, prompt, n, SamplingParams(), torch.Generator(), drafters, policy, draft_executor=executor
        )
        return [emitted.token async for emitted in out]
    finally:
        executor.shutdown()


def test_draft_model_prepare_fills_the_cache_and_changes_no_proposal(make_checkpoint: Callable[..., Path]) -> None:
    model = full(make_checkpoint("llama", layers=2, seed=99))
    prepared = DraftModel(model, SamplingParams())
    prepared.prepare(PROMPT)
    assert prepared.sequence.tokens == PROMPT
    assert len(prepared.sequence.cache) == len(PROMPT)
    fresh = DraftModel(model, SamplingParams())
    for budget in (1, 4, 12):  # chains and trees with runner-up branches
        context = [*PROMPT, 7]
        got, want = prepared.propose(context, budget), fresh.propose(context, budget)
        assert (got.tokens, got.parents) == (want.tokens, want.parents)
    prepared.prepare([*PROMPT[:5], 33])  # a new prompt sharing a prefix: the cache keeps only that prefix
    assert prepared.sequence.tokens == [*PROMPT[:5], 33]


def test_prepare_keeps_chunks_positions_right(make_checkpoint: Callable[..., Path]) -> None:
    """A prompt longer than one prepare chunk is fed in chunks with the right positions."""
    model = full(make_checkpoint("llama", layers=2, seed=99))
    chunked = DraftModel(model, SamplingParams())
    chunked.prepare_chunk = 5
    chunked.prepare(PROMPT)
    assert chunked.sequence.tokens == PROMPT
    fresh = DraftModel(model, SamplingParams())
    context = [*PROMPT, 7]
    assert chunked.propose(context, 6).tokens == fresh.propose(context, 6).tokens


def test_ngram_and_mixed_prepare_change_no_proposal() -> None:
    context = [*PROMPT, 17, 3]
    pool = NgramPool()
    pool.prepare(PROMPT)
    assert pool.propose(context, 4).tokens == NgramPool().propose(context, 4).tokens
    mixed = MixedDrafter([PromptLookup(), NgramPool()])
    assert isinstance(mixed, Preparable)
    assert not isinstance(PromptLookup(), Preparable)
    mixed.prepare(PROMPT)
    assert mixed.propose(context, 6).tokens == MixedDrafter([PromptLookup(), NgramPool()]).propose(context, 6).tokens


def test_greedy_auto_shares_one_draft_model_between_draft_and_mix(make_checkpoint: Callable[..., Path]) -> None:
    draft = full(make_checkpoint("llama", layers=2, seed=99))
    drafters = make_drafters("auto", SamplingParams(), draft)
    mixed = drafters["mix"]
    assert isinstance(mixed, MixedDrafter)
    assert mixed.sources[-1] is drafters["draft"]  # one cache to fill, not two
    sampled = make_drafters("auto", SamplingParams(temperature=0.8), draft, torch.Generator().manual_seed(0))
    assert isinstance(sampled["mix"], MixedDrafter)
    assert sampled["mix"].sources[-1] is not sampled["draft"]


async def test_the_draft_model_is_prepared_during_the_prefill(make_checkpoint: Callable[..., Path]) -> None:
    directory = make_checkpoint("llama")
    model = full(directory)
    drafter = RecordingDraftModel(full(make_checkpoint("llama", layers=2, seed=99)))
    verifier = PrefillWaitsForDrafter(model, drafter, len(PROMPT))
    tokens = await decode_on_a_drafting_thread(verifier, PROMPT, 30, {"draft": drafter}, FixedPolicy("draft", 4))
    assert verifier.cached_when_prefill_returned == len(PROMPT)  # the prefill waited for it, and it came
    assert drafter.cached_at_propose[0] == len(PROMPT)  # the first draft found the prompt cached
    assert tokens == local_greedy(directory, PROMPT, 30)  # and greedy output is one-token greedy


class PreparingLookup(PromptLookup):
    """A prompt lookup that notes each context it was prepared for."""

    def __init__(self) -> None:
        super().__init__()
        self.prepared: list[int] = []  # context lengths

    def prepare(self, context: Sequence[int]) -> None:
        self.prepared.append(len(context))


class HeadForwardFirst(WaitingVerifier):
    """A local verifier whose prefill spends a while on its own side (the edge's head forward) before it is sent,
    noting whether the drafter's preparation had started by then."""

    def __init__(self, model: FullModel, drafter: PreparingLookup) -> None:
        super().__init__(model)
        self.drafter = drafter
        self.prepared_before_sent: list[int] | None = None

    async def own_side(self, tokens: Sequence[int]) -> None:
        if not self.inner.tokens:  # the prefill
            await asyncio.sleep(0.05)  # the head forward over the prompt: a drafting thread started before would run
            self.prepared_before_sent = list(self.drafter.prepared)


async def test_the_drafters_are_prepared_once_the_prefill_is_sent(make_checkpoint: Callable[..., Path]) -> None:
    """The preparation does not compete with the prefill's own work on the edge: it starts when the prefill is on
    its way, and is done before the first draft."""
    directory = make_checkpoint("llama")
    drafter = PreparingLookup()
    verifier = HeadForwardFirst(full(directory), drafter)
    tokens = await decode_on_a_drafting_thread(verifier, PROMPT, 6, {"lookup": drafter}, FixedPolicy("lookup", 4))
    assert verifier.prepared_before_sent == []
    assert drafter.prepared == [len(PROMPT)]
    assert tokens == local_greedy(directory, PROMPT, 6)


async def test_on_the_event_loop_a_long_prompt_is_prepared_in_pieces_with_the_loop_free_between(
    make_checkpoint: Callable[..., Path],
) -> None:
    """A CPU engine's draft executor runs on the event loop: a long prompt's preparation is cut into pieces, and
    other sequences' work runs between two of them; the draft model then proposes as if prepared at once."""
    events: list[str] = []

    class Noting(PreparingLookup):
        def prepare(self, context: Sequence[int]) -> None:
            super().prepare(context)
            events.append("piece")

    async def other_sequence() -> None:
        for _ in range(50):
            events.append("other")
            await asyncio.sleep(0)

    lookup = Noting()
    draft_model = DraftModel(full(make_checkpoint("llama", layers=2, seed=99)), SamplingParams())
    prompt = [3 + i % 90 for i in range(2 * PREPARE_PIECE_TOKENS + 44)]
    executor = DraftExecutor(threaded=False)
    try:
        other = asyncio.ensure_future(other_sequence())
        await asyncio.sleep(0)
        prepared = start_prepare({"lookup": lookup, "draft": draft_model}, prompt, executor)
        assert prepared is not None
        await prepared
        await other
    finally:
        executor.shutdown()
    assert lookup.prepared == [PREPARE_PIECE_TOKENS, 2 * PREPARE_PIECE_TOKENS, len(prompt)]
    pieces = [i for i, event in enumerate(events) if event == "piece"]
    assert all("other" in events[a:b] for a, b in itertools.pairwise(pieces))  # the loop ran between
    assert draft_model.sequence.tokens == prompt
    fresh = DraftModel(draft_model.sequence.model, SamplingParams())
    context = [*prompt, 7]
    got, want = draft_model.propose(context, 6), fresh.propose(context, 6)
    assert (got.tokens, got.parents) == (want.tokens, want.parents)


async def test_a_windowed_draft_model_prepares_only_the_window_its_first_proposal_reads(
    make_checkpoint: Callable[..., Path],
) -> None:
    """A draft model whose positions a long prompt outgrows prepares, in pieces on the event loop, only the latest
    tokens its first proposal reads (its window), and then proposes as one that read them at once."""
    model = full(make_checkpoint("llama", layers=2, seed=99, max_positions=64))
    draft_model = DraftModel(model, SamplingParams())  # a tree of 8 levels: a window of 56 tokens
    prompt = [3 + i % 90 for i in range(300)]
    start = window_start(len(prompt) + 1, 56)
    assert start == 252
    executor = DraftExecutor(threaded=False)
    try:
        prepared = start_prepare({"draft": draft_model}, prompt, executor)
        assert prepared is not None
        await prepared
    finally:
        executor.shutdown()
    assert (draft_model.start, draft_model.sequence.tokens) == (start, prompt[start:])
    context = [*prompt, 7]
    got = draft_model.propose(context, 6)
    want = DraftModel(model, SamplingParams()).propose(context[start:], 6)
    assert (got.tokens, got.parents) == (want.tokens, want.parents)


class SlowPreparation(PromptLookup):
    """A prompt lookup whose preparation takes PREPARE_S seconds, in PIECES pieces, noting the pieces it ran."""

    PREPARE_S = 2.0
    PIECES = 20

    def __init__(self) -> None:
        super().__init__()
        self.ran = 0  # pieces of its preparation run

    def prepare(self, context: Sequence[int]) -> None:
        for _ in self.prepare_pieces(context, len(context)):
            pass

    def prepare_pieces(self, context: Sequence[int], tokens: int) -> Iterator[int]:
        for piece in range(self.PIECES):
            time.sleep(self.PREPARE_S / self.PIECES)  # a draft model's forward over a piece of a long prompt
            self.ran += 1
            yield piece


@pytest.mark.parametrize("executor_kind", ["thread", "event loop"])
@pytest.mark.parametrize("ends", ["one token asked for", "a stop token first"])
async def test_an_answer_that_ends_at_its_first_token_does_not_wait_for_the_preparation(
    make_checkpoint: Callable[..., Path], executor_kind: str, ends: str
) -> None:
    """No step drafts after the prefill's token: the stream ends without waiting for the drafters' preparation for
    the prompt (it waited for a draft model's whole pass), and the preparation is abandoned, not run to its end."""
    directory = make_checkpoint("llama")
    first = local_greedy(directory, PROMPT, 1)
    n, stops = (1, ()) if ends == "one token asked for" else (20, tuple(first))
    drafter = SlowPreparation()
    verifier = WaitingVerifier(full(directory))
    executor = ThreadPoolExecutor(max_workers=1) if executor_kind == "thread" else DraftExecutor(threaded=False)
    try:
        t0 = time.perf_counter()
        out = decode(
            verifier, PROMPT, n, SamplingParams(), torch.Generator(), {"slow": drafter}, FixedPolicy("slow", 4), stops,
            draft_executor=executor,
        )  # fmt: skip
        tokens = [emitted.token async for emitted in out]
        elapsed = time.perf_counter() - t0
        await asyncio.sleep(0.3)  # the loop runs on: a piece not started is not run
    finally:
        await asyncio.to_thread(executor.shutdown)  # the piece running on the thread ends, no later one starts
    assert tokens == first
    assert elapsed < SlowPreparation.PREPARE_S / 2
    assert drafter.ran < SlowPreparation.PIECES  # abandoned: not run to its end


def test_a_head_catches_up_while_the_next_step_is_in_flight(make_checkpoint: Callable[..., Path]) -> None:
    """An EAGLE head fed the prompt's pairs by ``catch_up`` (before or after the verifier commits its next step)
    proposes what a head fed by its first proposal does, and the catch-up did that work."""
    directory = make_checkpoint("llama", layers=4)
    model = full(directory)
    torch.manual_seed(1)
    head = DraftHead(default_config(Checkpoint(directory)), torch.device("cpu"), torch.float32).eval()
    for commit_first in (False, True):
        verifier = LocalSequence(model)
        verifier.keep_features((4,))
        verifier.run(PROMPT)
        caught = EagleDrafter(head, lambda: model, verifier, SamplingParams())
        if commit_first:  # the step went and came back before the drafting thread got to it
            verifier.run([7, 11])
        caught.catch_up([*PROMPT, 7])
        assert len(caught.cache) == len(PROMPT)  # the prompt's pairs, whatever the verifier holds by now
        if not commit_first:
            verifier.run([7, 11])
        fresh = EagleDrafter(head, lambda: model, verifier, SamplingParams())
        context = [*PROMPT, 7, 11, 30]
        got, want = caught.propose(context, 8), fresh.propose(context, 8)
        assert len(got) == 8
        assert (got.tokens, got.parents) == (want.tokens, want.parents)
    stale = EagleDrafter(head, lambda: model, verifier, SamplingParams())
    stale.catch_up([*PROMPT[:-1], 99, 7])  # not the verifier's tokens: nothing is fed
    assert len(stale.cache) == 0


class SlowReader:
    """A drafter reading the verifier's features whose catch-up ends only once ``release`` is set."""

    name = "slow"

    def __init__(self) -> None:
        self.release = threading.Event()
        self.caught_up: int | None = None  # the context it caught up with
        self.asked: list[tuple[int, int | None]] = []  # (context length, caught up by then) at each proposal

    def catch_up(self, context: Sequence[int]) -> None:
        if not self.release.wait(10):
            raise TimeoutError("the catch-up was never released")
        self.caught_up = len(context)

    def propose(self, context: Sequence[int], budget: int) -> Draft:
        self.asked.append((len(context), self.caught_up))
        return Draft.empty()


class ReleasesAtDecodeStep(WaitingVerifier):
    """A local verifier that releases the reader's catch-up when its ``at``-th decode step is sent."""

    def __init__(self, model: FullModel, reader: SlowReader, at: int) -> None:
        super().__init__(model)
        self.reader, self.at, self.steps = reader, at, -1  # the prefill is step 0's predecessor

    async def before(self, tokens: Sequence[int]) -> None:
        self.steps += 1
        if self.steps == self.at:
            self.reader.release.set()
            await asyncio.sleep(0.05)  # the step's round trip: the catch-up finishes meanwhile


async def test_after_a_long_prompt_the_feature_reader_is_asked_once_caught_up(
    make_checkpoint: Callable[..., Path],
) -> None:
    """The catch-up runs on the drafting thread during the first decode steps (two of them here), which go out
    without the reader; it is asked from then on, and greedy output stays one-token greedy."""
    directory = make_checkpoint("llama")
    prompt = (PROMPT * 20)[: CATCH_UP_MIN_TOKENS + 20]
    reader = SlowReader()
    verifier = ReleasesAtDecodeStep(full(directory), reader, at=2)
    tokens = await decode_on_a_drafting_thread(verifier, prompt, 8, {"slow": reader}, FixedPolicy("slow", 4))
    assert reader.caught_up == len(prompt) + 1  # the prompt and its first token
    assert reader.asked, "the reader was never asked"
    assert all(caught == len(prompt) + 1 for _, caught in reader.asked)  # never before it had caught up
    assert reader.asked[0][0] >= len(prompt) + 3  # two decode steps went out without it
    assert tokens == local_greedy(directory, prompt, 8)


def test_a_short_context_starts_no_catch_up() -> None:
    assert start_catch_up({"slow": SlowReader()}, PROMPT, ThreadPoolExecutor(max_workers=1)) is None


class RankedPolicy(BlindPolicy):
    """Ask ``drafters`` in this order, each at ``budget`` tokens, every step."""

    def __init__(self, drafters: Sequence[str], budget: int) -> None:
        self.choices = [*(Choice(name, budget, math.inf) for name in drafters), Choice(None, 0, 0.0)]

    def ranked(self, context_tokens: int = 0, waits: Mapping[str, float] | None = None) -> list[Choice]:
        return self.choices


class ThreadRecordingMix(MixedDrafter):
    """A mix of lookups that records, at each proposal, its thread and whether ``reader`` had caught up."""

    def __init__(self, reader: SlowReader) -> None:
        super().__init__([PromptLookup(), NgramPool()])
        self.reader = reader
        self.asked: list[tuple[int, int | None]] = []  # (thread id, the reader's caught-up context)

    def propose(self, context: Sequence[int], budget: int) -> Draft:
        self.asked.append((threading.get_ident(), self.reader.caught_up))
        return super().propose(context, budget)


def test_a_mix_of_lookups_is_cheap_and_a_mix_with_a_draft_model_is_not(make_checkpoint: Callable[..., Path]) -> None:
    assert is_cheap(MixedDrafter([PromptLookup(), NgramPool()]))
    model = full(make_checkpoint("llama", layers=2, seed=99))
    assert not is_cheap(MixedDrafter([PromptLookup(), NgramPool(), DraftModel(model, SamplingParams())]))


async def test_a_mix_of_lookups_drafts_inline_while_a_feature_reader_catches_up(
    make_checkpoint: Callable[..., Path],
) -> None:
    """A mix of lookups proposes on the decoding thread, so the steps that go out while the feature reader
    catches up on the drafting thread still carry its drafts; greedy output stays one-token greedy."""
    directory = make_checkpoint("llama")
    prompt = (PROMPT * 20)[: CATCH_UP_MIN_TOKENS + 20]
    reader = SlowReader()
    mix = ThreadRecordingMix(reader)
    verifier = ReleasesAtDecodeStep(full(directory), reader, at=2)
    policy = RankedPolicy(["slow", "mix"], 4)
    tokens = await decode_on_a_drafting_thread(verifier, prompt, 12, {"slow": reader, "mix": mix}, policy)
    here = threading.get_ident()
    assert mix.asked[0] == (here, None)  # asked before the reader had caught up, on this thread
    assert all(thread == here for thread, _ in mix.asked)
    assert reader.asked
    assert all(caught == len(prompt) + 1 for _, caught in reader.asked)
    assert tokens == local_greedy(directory, prompt, 12)
