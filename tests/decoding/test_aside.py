"""Dear drafters judged aside: a lone greedy sequence scores them during its round trips instead of asking them
on the step, until judged; under other sequences, or when sampling, they are asked on the step as before."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from splitspec.decoding.aside import AsidePlan, AsideProposal, DraftExecutor, plan_aside, start_aside
from splitspec.decoding.controller import PROBE_BUDGET, SHADOW_UNTIL, Choice, FixedPolicy, SpeculationController
from splitspec.decoding.drafters import Draft, Drafter
from splitspec.decoding.local import LocalSequence
from splitspec.decoding.loop import decode
from splitspec.decoding.sampling import SamplingParams
from splitspec.models.checkpoint import Checkpoint
from splitspec.models.loading import load_full
from tests.conftest import local_greedy

PROMPT = [5, 9, 17, 3, 44, 2, 8, 5, 9, 17, 3, 61]
NEW_TOKENS = 40


class SlowLink:
    """A local verifier whose every forward is 5 ms of its own work (a head forward), then a 30 ms round trip
    (``sent`` is called as it starts), noting when one is in flight."""

    def __init__(self, directory: Path, round_trip_s: float = 0.03) -> None:
        self.inner = LocalSequence(load_full(Checkpoint(directory), torch.float32))
        self.round_trip_s = round_trip_s
        self.in_flight = False
        self.forwards = 0

    async def forward(
        self,
        tokens: Sequence[int],
        parents: Sequence[int] | None = None,
        logits_from: int = 0,
        *,
        sent: Callable[[], None] | None = None,
    ) -> torch.Tensor:
        self.forwards += 1
        time.sleep(0.005)  # the edge's own part of the step, before anything is sent
        self.in_flight = True
        if sent is not None:
            sent()
        try:
            await asyncio.sleep(self.round_trip_s)
            return await self.inner.forward(tokens, parents, logits_from)
        finally:
            self.in_flight = False

    def keep(self, indices: Sequence[int]) -> None:
        self.inner.keep(indices)

    def reset(self) -> None:
        self.inner.reset()


class Oracle:
    """A dear drafter (``aside``) that knows the greedy answer: it proposes its next tokens, noting for each
    proposal whether the verifier's round trip was in flight."""

    name = "dear"
    aside = True

    def __init__(self, prompt: list[int], answer: list[int], link: SlowLink) -> None:
        self.text = [*prompt, *answer]
        self.link = link
        self.during_round_trip: list[bool] = []

    def propose(self, context: Sequence[int], budget: int) -> Draft:
        self.during_round_trip.append(self.link.in_flight)  # aside: started once the step was sent, not before
        following = self.text[len(context) : len(context) + budget]
        return Draft(following, list(range(-1, len(following) - 1)))


class Nothing:
    """A cheap drafter that never has anything to offer: ``auto``'s other option beside the dear one."""

    name = "nothing"
    shadow = True

    def propose(self, context: Sequence[int], budget: int) -> Draft:
        return Draft.empty()


def test_the_draft_executor_is_idle_with_nothing_queued_and_one_sequence_decoding() -> None:
    executor = DraftExecutor()
    try:
        assert executor.idle
        release = threading.Event()
        job = executor.submit(release.wait, 5)
        assert not executor.idle  # running
        queued = executor.submit(int, "7")
        release.set()
        assert queued.result(timeout=5) == 7
        assert job.result(timeout=5)
        for _ in range(100):  # the done callbacks run right after the results are set
            if executor.idle:
                break
            threading.Event().wait(0.01)
        assert executor.idle
        with executor.decoding():
            assert executor.idle  # the sequence asking is the only one
            with executor.decoding():
                assert not executor.idle  # another sequence decodes too
            assert executor.idle
    finally:
        executor.shutdown()


async def run(
    directory: Path, executor: DraftExecutor, params: SamplingParams, generator: torch.Generator
) -> tuple[list[int], Oracle, SpeculationController]:
    link = SlowLink(directory)
    answer = local_greedy(directory, PROMPT, NEW_TOKENS)
    oracle = Oracle(PROMPT, answer, link)
    controller = SpeculationController(["dear", "nothing"])
    drafters: dict[str, Drafter] = {"dear": oracle, "nothing": Nothing()}  # auto: more than one drafter
    with executor.decoding():
        out = decode(link, PROMPT, NEW_TOKENS, params, generator, drafters, controller, draft_executor=executor)
        tokens = [emitted.token async for emitted in out]
    return tokens, oracle, controller


async def test_a_lone_greedy_sequence_judges_a_dear_drafter_during_its_round_trips(
    make_checkpoint: Callable[..., Path],
) -> None:
    directory = make_checkpoint("llama")
    executor = DraftExecutor()
    try:
        tokens, oracle, controller = await run(directory, executor, SamplingParams(), torch.Generator())
    finally:
        executor.shutdown()
    assert tokens == local_greedy(directory, PROMPT, NEW_TOKENS)
    asides = oracle.during_round_trip.index(False)  # proposals made before the first one asked on a step
    assert asides >= 4
    assert all(oracle.during_round_trip[:asides])  # judged aside, never on the step meanwhile
    assert not controller.wants_shadow("dear")  # ... until judged often enough (SHADOW_UNTIL)
    assert SHADOW_UNTIL == 4.0
    # then, judged perfect, it is asked on the steps: decoding took far fewer steps than tokens
    assert len(oracle.during_round_trip) - asides < NEW_TOKENS // 2


@pytest.mark.parametrize("case", ["another sequence decoding", "sampling"])
async def test_a_dear_drafter_is_asked_on_the_step_when_it_cannot_be_judged_aside(
    make_checkpoint: Callable[..., Path], case: str
) -> None:
    directory = make_checkpoint("llama")
    executor = DraftExecutor()
    greedy = case != "sampling"
    params = SamplingParams() if greedy else SamplingParams(temperature=0.8)
    try:
        if greedy:
            with executor.decoding():  # the other sequence
                tokens, oracle, _ = await run(directory, executor, params, torch.Generator())
            assert tokens == local_greedy(directory, PROMPT, NEW_TOKENS)
        else:
            _, oracle, _ = await run(directory, executor, params, torch.Generator().manual_seed(3))
    finally:
        executor.shutdown()
    assert oracle.during_round_trip  # asked
    assert not any(oracle.during_round_trip)  # and only on the steps: nothing ran beside a round trip


class Wrong:
    """A cheap deterministic drafter (``shadow``) whose guess is never the answer's, noting when it proposes."""

    name = "cheap"
    shadow = True

    def __init__(self, link: SlowLink, never: int) -> None:
        self.link = link
        self.never = never  # a token the answer does not hold
        self.during_round_trip: list[bool] = []

    def propose(self, context: Sequence[int], budget: int) -> Draft:
        time.sleep(0.01)  # its own cost: a free drafter is worth asking on every step, whatever its acceptance
        self.during_round_trip.append(self.link.in_flight)
        return Draft([self.never], [-1])


async def test_a_lone_greedy_sequence_scores_cheap_drafters_aside_at_every_step(
    make_checkpoint: Callable[..., Path],
) -> None:
    directory = make_checkpoint("llama")
    # a 120 ms round trip: on a machine loaded past its cores (CI, two test workers and more) the draft thread was
    # scheduled only after a 30 ms one had ended, so the proposals it counts here came after the round trip
    link = SlowLink(directory, round_trip_s=0.12)
    answer = local_greedy(directory, PROMPT, NEW_TOKENS)
    wrong = Wrong(link, min(set(range(100)) - set(answer)))
    controller = SpeculationController(["cheap"])
    executor = DraftExecutor()
    try:
        with executor.decoding():
            out = decode(link, PROMPT, NEW_TOKENS, SamplingParams(), torch.Generator(), {"cheap": wrong}, controller,
                         draft_executor=executor)  # fmt: skip
            tokens = [emitted.token async for emitted in out]
    finally:
        executor.shutdown()
    assert tokens == answer
    assert not controller.wants_shadow("cheap")  # judged long ago ...
    # ... and still asked at every step after the prefill but the last (room for its token alone)
    assert len(wrong.during_round_trip) == link.forwards - 2
    # asked on a few steps while its optimistic prior ranked it; otherwise proposing during the round trip, far
    # beyond the SHADOW_UNTIL judgments after which a step stops scoring it inline
    assert sum(wrong.during_round_trip) >= 4 * SHADOW_UNTIL
    assert controller._stats["cheap"].accepted[0] == 0.0  # and scored: rejected every time


def test_the_plan_keeps_unjudged_dear_drafters_off_the_step_and_scores_cheap_ones_aside() -> None:
    link = SlowLink.__new__(SlowLink)  # never forwards: the drafters only carry their flags here
    drafters: dict[str, Drafter] = {"dear": Oracle([], [], link), "cheap": Wrong(link, 0)}
    controller = SpeculationController(["dear", "cheap"])
    executor = DraftExecutor()
    try:
        plan = plan_aside(drafters, controller, executor)
        assert plan.off_step == {"dear"}
        assert plan.shadows == ("dear", "cheap")
        for _ in range(5):  # judged aside often enough (SHADOW_UNTIL): asked on the steps from now on
            controller.observe_draft("dear", 1, 1, 1, 0.01, chosen=False)
        assert plan_aside(drafters, controller, executor) == AsidePlan(frozenset(), ("cheap",))
        assert plan_aside(drafters, FixedPolicy("dear", 4), executor) == AsidePlan()  # it learns nothing
        assert plan_aside(drafters, controller, ThreadPoolExecutor(max_workers=1)) == AsidePlan()  # idle unknown
        with executor.decoding(), executor.decoding():
            assert plan_aside(drafters, controller, executor) == AsidePlan()  # another sequence decodes
        alone = SpeculationController(["dear"])  # --speculate draft: the drafter its user chose is asked on the steps
        assert plan_aside({"dear": drafters["dear"]}, alone, executor) == AsidePlan()
    finally:
        executor.shutdown()


async def test_aside_proposals_start_with_the_largest_budget() -> None:
    """A greedy draft model serves a smaller budget from the larger tree it grew for the same context, so the
    largest asks go first; unranked drafters get PROBE_BUDGET, and nothing exceeds the cap."""
    order: list[tuple[str, int]] = []

    def propose(drafter: Drafter, context: Sequence[int], budget: int) -> tuple[Draft, float]:
        order.append((drafter.name, budget))
        return Draft.empty(), 0.0

    drafters: dict[str, Drafter] = {name: Named(name) for name in ("mix", "draft", "lookup", "asked")}
    choices = [Choice("mix", 3, 1.0), Choice("draft", 12, 1.0), Choice("asked", 16, 1.0)]
    started: list[AsideProposal] = []
    with ThreadPoolExecutor(max_workers=1) as executor:
        start_aside(drafters, ["mix", "draft", "lookup", "asked"], {"asked"}, choices, [1, 2], 8, executor,
                    propose, started)  # fmt: skip
        await asyncio.gather(*(p.future for p in started))
    assert order == [("draft", 8), ("mix", 3), ("lookup", PROBE_BUDGET)]
    assert [p.drafter for p in started] == ["draft", "mix", "lookup"]


class Named:
    """A drafter with a name only (start_aside hands it to the propose function it is given)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def propose(self, context: Sequence[int], budget: int) -> Draft:
        return Draft.empty()


class SlowOracle(Oracle):
    """:class:`Oracle` whose every proposal takes SLOW_S seconds: far longer than the link's round trip."""

    SLOW_S = 1.0

    def propose(self, context: Sequence[int], budget: int) -> Draft:
        draft = super().propose(context, budget)
        time.sleep(self.SLOW_S)
        return draft


def slow_aside(
    directory: Path, prompt: list[int], n: int
) -> tuple[SlowLink, SlowOracle, SpeculationController, dict[str, Drafter]]:
    link = SlowLink(directory)
    oracle = SlowOracle(prompt, local_greedy(directory, prompt, n), link)
    controller = SpeculationController(["dear", "nothing"])
    return link, oracle, controller, {"dear": oracle, "nothing": Nothing()}


async def test_a_step_s_tokens_do_not_wait_for_an_aside_proposal_that_outlasts_its_round_trip(
    make_checkpoint: Callable[..., Path],
) -> None:
    """The first decode step (one token: no step time is measured yet) judges the dear drafter aside, its proposal
    taking far longer than the round trip: the step's token comes when the step is verified, and the proposal is
    scored after it, before the next step."""
    directory = make_checkpoint("llama")
    link, oracle, controller, drafters = slow_aside(directory, PROMPT, 3)
    executor = DraftExecutor()
    arrivals: list[float] = []
    try:
        with executor.decoding():
            out = decode(link, PROMPT, 3, SamplingParams(), torch.Generator(), drafters, controller,
                         draft_executor=executor)  # fmt: skip
            tokens = []
            async for emitted in out:
                arrivals.append(time.perf_counter())
                tokens.append(emitted.token)
    finally:
        executor.shutdown()
    assert tokens == local_greedy(directory, PROMPT, 3)
    assert oracle.during_round_trip == [True]  # judged aside, during the first step's round trip
    assert arrivals[1] - arrivals[0] < SlowOracle.SLOW_S / 2  # the step's token came without waiting for it
    assert controller._stats["dear"].reached[0] > 0.0  # and it was scored


@pytest.mark.parametrize("ends", ["a stop token", "the caller closes the stream"])
async def test_an_answer_s_end_does_not_wait_for_its_last_step_s_aside_proposal(
    make_checkpoint: Callable[..., Path], ends: str
) -> None:
    """The step that completes the answer judged the dear drafter aside: the stream ends without waiting for the
    proposal, which is still scored once done (the controller outlives the answer)."""
    directory = make_checkpoint("llama")
    prompt = PROMPT[1:]
    answer = local_greedy(directory, prompt, 2)
    assert answer[0] != answer[1]  # the stop token is the second one
    link, oracle, controller, drafters = slow_aside(directory, prompt, 2)
    stops = (answer[1],) if ends == "a stop token" else ()
    executor = DraftExecutor()
    try:
        with executor.decoding():
            t0 = time.perf_counter()
            out = decode(link, prompt, 20, SamplingParams(), torch.Generator(), drafters, controller, stops,
                         draft_executor=executor)  # fmt: skip
            tokens = [(await anext(out)).token, (await anext(out)).token]
            if ends == "a stop token":
                tokens += [emitted.token async for emitted in out]
            else:
                assert isinstance(out, AsyncGenerator)
                await out.aclose()
            elapsed = time.perf_counter() - t0
        deadline = time.monotonic() + 10 * SlowOracle.SLOW_S
        while not controller._stats["dear"].reached and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
    finally:
        executor.shutdown()
    assert tokens == answer
    assert oracle.during_round_trip == [True]
    assert elapsed < SlowOracle.SLOW_S / 2
    assert controller._stats["dear"].reached[0] > 0.0  # scored once done
