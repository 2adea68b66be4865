"""Dear drafters judged aside: proposed while a greedy step's round trip is in flight, then scored.

A draft model's proposal costs several of its forwards (the demo's: 7-13 ms on a 2,000-token
context). A cold controller that probes it on a step pays that on the step's critical path, and
where the model is near break-even the probes cost more than they win: on 2,000-token code with
32-token answers, ``auto`` with the draft model decoded at 0.92-0.95x of ``auto`` without it.

While a step's round trip is in flight the edge sits idle, and a greedy step's tokens do not
depend on its draft. So a drafter that declares itself dear to ask (``aside = True``: the draft
model, a mixed tree holding it, an EAGLE head) and that its controller has not judged often enough
(:meth:`~splitspec.decoding.controller.SpeculationController.wants_shadow`) is not asked on the
step: it proposes on the drafting thread during the round trip instead, and
once the step is verified its proposal is scored against the step's tokens exactly as a shadow
proposal is (:func:`~splitspec.decoding.shadow.score_proposal`). Its cost is measured there too.
The cheap deterministic drafters not asked (prompt lookup, n-grams) are scored there at every
step, so their estimates follow the text even while a drafter ranked above them is chosen.

A mode of one drafter (``--speculate draft``) asks it on the steps as before: its user chose it.
Only on a :class:`DraftExecutor` with nothing queued or running and no other sequence decoding:
under load the drafting thread and the interpreter are busy with other sequences, which a shadow
must not delay (the drafter is then asked on the step, as before). Greedy decoding without logits
processors only, as every shadow.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any, ParamSpec, TypeVar

from splitspec.decoding.controller import PROBE_BUDGET, BlindPolicy, Choice, SpeculationPolicy
from splitspec.decoding.dear_gate import DearGate
from splitspec.decoding.drafters import Draft, Drafter, Stepwise, is_cheap, is_dear
from splitspec.decoding.estimates import Ema
from splitspec.decoding.lockstep import Steps, finish_together
from splitspec.decoding.shadow import score_proposal
from splitspec.models.batcher import BatchLog

P = ParamSpec("P")
T = TypeVar("T")

log = logging.getLogger(__name__)


def timed_propose(drafter: Drafter, context: Sequence[int], budget: int) -> tuple[Draft, float]:
    """The drafter's proposal and the seconds it took to make it."""
    t0 = time.perf_counter()
    draft = drafter.propose(context, budget)
    return draft, time.perf_counter() - t0


def _once_caller_yields(callback: Callable[[], None]) -> None:
    """Run ``callback`` on this thread's event loop once the caller yields, as a callback of its own (after the
    callbacks ready before it); with no event loop on this thread, nothing runs after: at once."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        callback()
    else:
        loop.call_soon(callback)


class DraftExecutor(ThreadPoolExecutor):
    """The one drafting thread of an engine, knowing whether any work is queued or running on it, how long
    its jobs take and how many sequences are decoding with it; with the engine's :class:`DearGate`.

    ``threaded=False``: each job runs on the caller's event loop, as a callback of its own once the caller yields
    (after the callbacks ready before it), where the thread would run it once the caller awaits: a step's aside
    proposals, started before the step is sent, still run after the send. On a CPU a drafting thread waits for
    the interpreter lock after each torch call (:func:`splitspec.devices.compute_on_threads`). There, the
    stepwise proposals asked for (:meth:`propose`) before the first of them runs run together, in lockstep, their
    draft model's forwards batched (:mod:`~splitspec.decoding.lockstep`): a tail batch resumes several sequences
    at once, and each drafts its next step."""

    def __init__(
        self,
        thread_name_prefix: str = "edge-draft",
        job_decay: float = 0.9,
        gate: DearGate | None = None,
        threaded: bool = True,
    ) -> None:
        super().__init__(max_workers=1, thread_name_prefix=thread_name_prefix)
        self.threaded = threaded
        self._lock = threading.Lock()  # submit runs on the event loop, completion on the thread
        self._outstanding = 0  # jobs submitted and not yet finished
        self._decoding = 0  # sequences inside decoding()
        self._job_decay = job_decay  # per-job decay of the mean job time: it follows the load
        self._job_s = Ema()  # mean seconds of a job running on the thread (not its wait in the queue)
        self.gate = gate or DearGate()  # whether dear drafters pay while several sequences decode (event loop only)
        self._lockstep: list[tuple[Steps[Draft], Future[tuple[Draft, float]]]] = []  # proposals to run together
        self.lockstep_log = BatchLog()  # proposals run together (rows) and the milliseconds they took

    @contextmanager
    def decoding(self) -> Iterator[None]:
        """Count a sequence decoding with this thread while inside."""
        with self._lock:
            self._decoding += 1
        try:
            yield
        finally:
            with self._lock:
                self._decoding -= 1

    def submit(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Future[T]:
        with self._lock:
            self._outstanding += 1
        if not self.threaded:
            job: Future[T] = Future()

            def run() -> None:
                if not job.set_running_or_notify_cancel():  # its caller went away (a closed request): not run
                    self._finished(None)
                    return
                try:
                    job.set_result(self._timed(fn, *args, **kwargs))
                except Exception as exc:  # the caller reads it from the future, as from the thread
                    job.set_exception(exc)
                finally:
                    self._finished(None)

            _once_caller_yields(run)  # a step sent first, its proposals aside after
            return job
        try:
            future = super().submit(self._timed, fn, *args, **kwargs)
        except BaseException:
            self._finished(None)
            raise
        future.add_done_callback(self._finished)
        return future

    def propose(self, drafter: Drafter, context: Sequence[int], budget: int) -> Future[tuple[Draft, float]]:
        """``drafter``'s proposal for ``context`` and its seconds (:func:`timed_propose`), made here. On the event
        loop a :class:`~splitspec.decoding.drafters.Stepwise` drafter's proposal joins the others asked for before
        the first of them runs, once the caller yields, and its seconds are its own work and its share of the
        batched forwards. One proposal per sequence at a time: their forwards are over distinct caches."""
        if self.threaded or not isinstance(drafter, Stepwise):
            return self.submit(timed_propose, drafter, context, budget)
        job: Future[tuple[Draft, float]] = Future()
        with self._lock:
            self._outstanding += 1
        self._lockstep.append((drafter.propose_steps(context, budget), job))
        if len(self._lockstep) == 1:
            _once_caller_yields(self._run_lockstep)  # with the proposals asked for before it runs
        return job

    def _run_lockstep(self) -> None:
        queued, self._lockstep = self._lockstep, []
        jobs = []
        for steps, job in queued:
            if job.set_running_or_notify_cancel():
                jobs.append((steps, job))
            else:  # its caller went away (a closed request): not run
                steps.close()
                self._finished(None)
        if not jobs:
            return
        t0 = time.perf_counter()
        outcomes = finish_together([steps for steps, _ in jobs])
        self.lockstep_log.observe(len(jobs), (time.perf_counter() - t0) * 1e3)
        for (_, job), outcome in zip(jobs, outcomes, strict=True):
            with self._lock:
                self._job_s.update(outcome.seconds, self._job_decay)
            self._finished(None)
            if outcome.error is not None:  # the caller reads it from the future, as from the thread
                job.set_exception(outcome.error)
            else:
                job.set_result((outcome.result(), outcome.seconds))

    def _timed(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            seconds = time.perf_counter() - t0
            with self._lock:
                self._job_s.update(seconds, self._job_decay)

    def _finished(self, _: Future[Any] | None) -> None:
        with self._lock:
            self._outstanding -= 1

    def expected_wait(self) -> float:
        """Seconds a job submitted now would wait before it runs: the jobs queued or running ahead of it at the
        mean job time (0 before any job was timed, or with none outstanding)."""
        with self._lock:
            if self._outstanding == 0 or math.isnan(self._job_s.value):
                return 0.0
            return self._outstanding * self._job_s.value

    def allows_dear(self) -> bool:
        """Whether a step starting now may ask a dear drafter (:class:`DearGate`; always for a lone sequence)."""
        with self._lock:
            decoding = self._decoding
        return self.gate.allows(decoding, time.monotonic())

    @property
    def idle(self) -> bool:
        """No job queued or running, and no other sequence decoding: the edge waits for one round trip. With
        other sequences in flight, their drafts, forwards and I/O want the interpreter a shadow would take."""
        with self._lock:
            return self._outstanding == 0 and self._decoding <= 1


@dataclass(frozen=True)
class AsidePlan:
    """What one greedy step does beside its round trip."""

    off_step: frozenset[str] = frozenset()  # dear drafters not asked on the step: not judged often enough yet
    shadows: tuple[str, ...] = ()  # drafters that propose during the round trip when not asked, then are scored


def plan_aside(drafters: Mapping[str, Drafter], controller: SpeculationPolicy, executor: Executor | None) -> AsidePlan:
    """The step's :class:`AsidePlan` (the loop asks only on greedy steps without processors): nothing unless
    ``executor`` is an idle :class:`DraftExecutor`. Then the dear drafters still to be judged are kept off the
    step and judged aside, and the cheap deterministic ones (``shadow = True``) are scored aside at every step,
    not only until judged: their estimates then follow the text (prose that turns repetitive, say) while a
    drafter ranked above them keeps being chosen."""
    if isinstance(controller, BlindPolicy) or not isinstance(executor, DraftExecutor) or not executor.idle:
        return AsidePlan()  # a policy that learns nothing has nothing to score
    # a dear drafter is kept off the step only where another one could be asked instead: a mode of one drafter
    # (``--speculate draft``) asks it on the steps, as its user chose
    choice = len(drafters) > 1
    dear = [n for n, d in drafters.items() if choice and is_dear(d) and controller.wants_shadow(n)]
    cheap = [name for name, d in drafters.items() if is_cheap(d)]
    return AsidePlan(frozenset(dear), (*dear, *cheap))


@dataclass
class AsideProposal:
    drafter: str
    future: asyncio.Future[tuple[Draft, float]]  # the proposal and its seconds, from the drafting thread


def start_aside(
    drafters: Mapping[str, Drafter],
    aside: Sequence[str],
    asked: set[str],
    choices: Sequence[Choice],
    context: Sequence[int],
    budget_cap: int,
    executor: Executor | None,
    propose: Callable[[Drafter, Sequence[int], int], tuple[Draft, float]],
    started: list[AsideProposal],
) -> None:
    """Start every one of ``aside`` not ``asked`` this step proposing for ``context`` on ``executor`` (one after
    the other, the largest budget first), each at its ranked budget (:data:`PROBE_BUDGET` when not ranked), at
    most ``budget_cap``; each proposal is appended to ``started``. The decode loop calls it once the step is sent.

    Largest first: the draft model and a mix holding it both propose for this context, and a greedy draft model
    serves a smaller budget from the larger tree it grew for the same context
    (:meth:`~splitspec.decoding.drafters.DraftModel.propose`)."""
    if executor is None or budget_cap < 1:
        return
    loop = asyncio.get_running_loop()
    snapshot = list(context)  # the loop extends its context once the step is verified
    budgets = {
        name: min(next((c.budget for c in choices if c.drafter == name), PROBE_BUDGET), budget_cap)
        for name in aside
        if name not in asked
    }
    for name, budget in sorted(budgets.items(), key=lambda item: -item[1]):  # stable: ties keep their order
        future = loop.run_in_executor(executor, propose, drafters[name], snapshot, budget)
        future.add_done_callback(_retrieve)  # a generation closed mid-step never awaits it
        started.append(AsideProposal(name, future))


def _retrieve(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


async def score_aside(started: Sequence[AsideProposal], controller: SpeculationPolicy, target: Sequence[int]) -> None:
    """Wait for the aside proposals and score each against ``target``, the tokens the greedy step emitted. The loop
    awaits it once the step's tokens are out: a proposal that outlasts the round trip holds the next step back,
    not the step's own tokens."""
    for proposal in started:
        draft, seconds = await proposal.future
        score_proposal(controller, proposal.drafter, draft, seconds, target)


def score_aside_when_done(
    started: Sequence[AsideProposal], controller: SpeculationPolicy, target: Sequence[int]
) -> None:
    """:func:`score_aside` without waiting: each proposal is scored on the event loop once done (the answer is
    complete, and its end is not held for them; the controller outlives it). A failed one is logged, not raised."""
    target = list(target)
    for proposal in started:
        proposal.future.add_done_callback(partial(_score_when_done, controller, proposal.drafter, target))


def _score_when_done(
    controller: SpeculationPolicy, drafter: str, target: list[int], future: asyncio.Future[tuple[Draft, float]]
) -> None:
    if future.cancelled():
        return
    error = future.exception()
    if error is not None:
        log.warning("drafter %r failed proposing aside after its answer was complete", drafter, exc_info=error)
        return
    draft, seconds = future.result()
    score_proposal(controller, drafter, draft, seconds, target)
