"""The drafting thread's queue: under load, other sequences' drafts wait there, so asking a drafter that runs on
it costs the wait too; cheap lookups propose inline and never wait behind a draft model."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import pytest
import torch

from splitspec.decoding.aside import DraftExecutor
from splitspec.decoding.controller import BlindPolicy, Choice, SpeculationController
from splitspec.decoding.drafters import Draft, Drafter
from splitspec.decoding.local import LocalSequence
from splitspec.decoding.loop import decode
from splitspec.decoding.sampling import SamplingParams
from splitspec.models.checkpoint import Checkpoint
from splitspec.models.loading import load_full

PROMPT = [5, 9, 17, 3, 44, 2, 8, 5, 9, 17, 3, 61]


def wait_until(condition: Callable[[], bool]) -> None:
    for _ in range(500):
        if condition():
            return
        time.sleep(0.01)
    raise AssertionError("timed out")


def test_expected_wait_counts_the_jobs_ahead_at_the_mean_job_time() -> None:
    executor = DraftExecutor()
    try:
        assert executor.expected_wait() == 0.0  # nothing queued, nothing timed
        executor.submit(time.sleep, 0.05).result(timeout=5)
        wait_until(lambda: executor.expected_wait() == 0.0)  # timed, but nothing ahead of a new job
        release = threading.Event()
        running = executor.submit(release.wait, 5)
        queued = executor.submit(time.sleep, 0)
        # two jobs ahead of a third, each expected to take the one job timed so far (50 ms and a little more)
        assert 0.1 <= executor.expected_wait() < 0.5
        release.set()
        assert running.result(timeout=5)
        queued.result(timeout=5)
        wait_until(lambda: executor.expected_wait() == 0.0)
    finally:
        executor.shutdown()


def _refuse() -> None:
    raise ValueError("no draft")


async def test_an_unthreaded_executor_runs_each_job_on_the_event_loop_once_the_caller_yields() -> None:
    """As a drafting thread would, it runs a job once its caller awaits (a step is sent before its aside
    proposals run), and the result or error reaches the caller through the future."""
    executor = DraftExecutor(threaded=False)
    try:
        here = threading.get_ident()
        ran_on: list[int] = []

        def job(x: int) -> int:
            ran_on.append(threading.get_ident())
            return x * 2

        future = executor.submit(job, 21)
        assert not future.done()  # the caller has not yielded yet
        assert ran_on == []
        assert not executor.idle  # a job is outstanding
        await asyncio.sleep(0)
        assert future.result(timeout=0) == 42
        assert ran_on == [here]  # on the event loop's thread
        assert await asyncio.get_running_loop().run_in_executor(executor, job, 4) == 8  # as the decode loop asks
        assert ran_on == [here, here]
        failed = executor.submit(_refuse)
        await asyncio.sleep(0)
        assert isinstance(failed.exception(timeout=0), ValueError)
        dropped = executor.submit(job, 5)
        dropped.cancel()  # its caller went away before it ran (a closed request's aside proposal)
        await asyncio.sleep(0)
        assert ran_on == [here, here]  # not run
        assert executor.idle
        assert executor.expected_wait() == 0.0
    finally:
        executor.shutdown()


def test_an_unthreaded_executor_outside_an_event_loop_runs_a_job_at_once() -> None:
    executor = DraftExecutor(threaded=False)
    try:
        assert executor.submit(sum, [1, 2, 3]).result(timeout=0) == 6
    finally:
        executor.shutdown()


def test_the_mean_job_time_follows_the_jobs() -> None:
    executor = DraftExecutor(job_decay=0.5)
    try:
        executor.submit(time.sleep, 0.2).result(timeout=5)
        for _ in range(6):
            executor.submit(time.sleep, 0).result(timeout=5)
        release = threading.Event()
        executor.submit(release.wait, 5)
        try:
            assert executor.expected_wait() < 0.02  # the slow job has aged out
        finally:
            release.set()
    finally:
        executor.shutdown()


def paying_controller() -> SpeculationController:
    """Two drafters accepted at 0.8 a depth, one draft token costing 1 ms, over steps of 50 ms plus 2 ms a token."""
    ctl = SpeculationController(["dear", "cheap"], budgets=(1, 2, 4))
    for q in (1, 2, 3, 5):
        for _ in range(20):
            ctl.observe_step(q, 0.05 + 0.002 * q)
    for i in range(40):
        for name in ("dear", "cheap"):
            ctl.observe_draft(name, 4, 4 if i % 5 else 0, 4, 0.004)
    return ctl


def test_a_queue_on_the_drafting_thread_makes_its_drafters_dearer_and_not_the_others() -> None:
    ctl = paying_controller()
    quiet = ctl.ranked()
    assert {c.drafter for c in quiet[:2]} == {"dear", "cheap"}  # both pay alone
    # 200 ms behind other sequences' drafts: the dear one falls below sequential, the cheap one does not wait
    busy = ctl.ranked(0, {"dear": 0.2})
    assert [c.drafter for c in busy] == ["cheap", None, "dear"]
    dear = next(c for c in busy if c.drafter == "dear")
    assert dear.expected_tokens_per_s < next(c for c in quiet if c.drafter == "dear").expected_tokens_per_s
    assert ctl.value("dear", 4, 0, 0.2) < ctl.value("dear", 4) == ctl.value("dear", 4, 0, 0.0)


def test_the_asking_order_counts_the_wait() -> None:
    ctl = paying_controller()
    # a short wait keeps both above sequential, but the drafter that need not wait is asked first
    order = [c.drafter for c in ctl.ranked(0, {"cheap": 0.01})]
    assert order[:2] == ["dear", "cheap"]
    order = [c.drafter for c in ctl.ranked(0, {"dear": 0.01})]
    assert order[:2] == ["cheap", "dear"]


class Named:
    """A drafter proposing its fixed continuation, noting the thread each proposal ran on."""

    def __init__(self, name: str, tokens: list[int], *, cheap: bool) -> None:
        self.name = name
        self.tokens = tokens
        self.shadow = cheap  # cheap and deterministic: proposes inline
        self.threads: list[str] = []

    def propose(self, context: Sequence[int], budget: int) -> Draft:
        self.threads.append(threading.current_thread().name)
        chain = self.tokens[:budget]
        return Draft(chain, list(range(-1, len(chain) - 1)))


class Recording(BlindPolicy):
    """Asks the drafters in a fixed order, noting the waits it was told of."""

    def __init__(self, order: list[str]) -> None:
        self.order = order
        self.waits: list[dict[str, float]] = []

    def ranked(self, context_tokens: int = 0, waits: Mapping[str, float] | None = None) -> list[Choice]:
        self.waits.append(dict(waits or {}))
        return [*(Choice(name, 2, 1.0) for name in self.order), Choice(None, 0, 0.0)]


@pytest.fixture
def verifier(make_checkpoint: Callable[..., Path]) -> LocalSequence:
    return LocalSequence(load_full(Checkpoint(make_checkpoint("llama")), torch.float32))


async def test_cheap_drafters_propose_inline_and_dear_ones_on_the_drafting_thread(verifier: LocalSequence) -> None:
    executor = DraftExecutor()
    cheap, dear = Named("cheap", [], cheap=True), Named("dear", [1, 2], cheap=False)  # the cheap one has nothing
    drafters: dict[str, Drafter] = {"cheap": cheap, "dear": dear}
    try:
        params, generator = SamplingParams(temperature=0.8), torch.Generator().manual_seed(0)  # no aside
        out = decode(
            verifier, PROMPT, 6, params, generator, drafters, Recording(["cheap", "dear"]), draft_executor=executor
        )
        assert len([e async for e in out]) == 6
    finally:
        executor.shutdown()
    here = threading.current_thread().name
    assert cheap.threads
    assert set(cheap.threads) == {here}
    assert dear.threads
    assert all(name.startswith("edge-draft") for name in dear.threads)


async def test_the_loop_tells_the_policy_the_wait_of_the_drafters_on_the_thread(verifier: LocalSequence) -> None:
    executor = DraftExecutor()
    release = threading.Event()
    drafters: dict[str, Drafter] = {"cheap": Named("cheap", [], cheap=True), "dear": Named("dear", [], cheap=False)}
    policy = Recording([])  # sequential steps only: nothing joins the queue behind the job below
    try:
        executor.submit(time.sleep, 0.03).result(timeout=5)
        executor.submit(release.wait, 5)  # another sequence's draft, running
        params, generator = SamplingParams(), torch.Generator().manual_seed(0)
        assert (
            len(
                [
                    e
                    async for e in decode(
                        verifier, PROMPT, 4, params, generator, drafters, policy, draft_executor=executor
                    )
                ]
            )
            == 4
        )
        waits = policy.waits
        assert len(waits) == 3
        assert all(set(w) == {"dear"} and 0.03 <= w["dear"] < 0.5 for w in waits)
        release.set()
        wait_until(lambda: executor.expected_wait() == 0.0)
        policy.waits.clear()
        generator = torch.Generator().manual_seed(0)
        assert (
            len(
                [
                    e
                    async for e in decode(
                        verifier, PROMPT, 4, params, generator, drafters, policy, draft_executor=executor
                    )
                ]
            )
            == 4
        )
        assert policy.waits == [{}, {}, {}]  # nothing ahead: no wait
    finally:
        release.set()
        executor.shutdown()
