"""Proposals of several sequences advanced in lockstep: each round, one batched forward for all of them.

A stepwise drafter (the draft model, :meth:`~splitspec.decoding.drafters.DraftModel.propose_steps`) proposes as
a generator: it yields each forward it needs, a :class:`~splitspec.models.draft_forward.DraftForward` (its
catch-up step, then one per level of its tree), is sent that forward's logits, and returns its draft.
:func:`finish` runs one proposal's forwards one by one, as a drafter always has. :func:`finish_together` runs
the proposals of several sequences at once: every round, each proposal still running has yielded its next
forward, and those forwards run as one (:func:`~splitspec.models.draft_forward.run_draft_forwards`).

Under load, a tail batch delivers several sequences' steps at once, and each then drafts its next step: the
engine's drafting executor hands those proposals here together (decoding/aside.py), so a draft model's forward
is paid once per batch of sequences rather than once per sequence.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Generic, TypeAlias, TypeVar, cast

import torch

from splitspec.models import draft_forward
from splitspec.models.draft_forward import DraftForward

T = TypeVar("T")

Steps: TypeAlias = Generator[DraftForward, torch.Tensor, T]  # yields forwards, is sent their logits, returns T


def at_once(value: T) -> Steps[T]:
    """Steps that need no forward: ``value`` at once (a drafter scoring its tree without the draft model)."""
    yield from ()
    return value


def finish(steps: Steps[T]) -> T:
    """Run ``steps`` to the end, each forward alone; its result."""
    try:
        request = next(steps)
        while True:
            request = steps.send(draft_forward.run_draft_forward(request))
    except StopIteration as stop:
        result: T = stop.value
        return result


@dataclass(frozen=True)
class Outcome(Generic[T]):
    """How one of :func:`finish_together`'s proposals ended."""

    value: T | None  # its result, unless it failed
    error: Exception | None  # what it raised (a forward's error is raised inside it first)
    seconds: float  # its own work plus its share of each batched forward, by query rows

    def result(self) -> T:
        """Its result, or what it raised, raised again."""
        if self.error is not None:
            raise self.error
        return cast(T, self.value)


def finish_together(jobs: Sequence[Steps[T]]) -> list[Outcome[T]]:
    """Run every one of ``jobs`` to the end, their forwards of each round batched; each one's :class:`Outcome`,
    in order. Their forwards must be over distinct caches: one proposal per sequence."""
    ended: dict[int, tuple[T | None, Exception | None]] = {}
    seconds = [0.0] * len(jobs)
    waiting: dict[int, DraftForward] = {}

    def advance(i: int, resume: Callable[[], DraftForward]) -> None:
        t0 = time.perf_counter()
        try:
            waiting[i] = resume()
        except StopIteration as stop:
            ended[i] = (stop.value, None)
        except Exception as exc:  # this proposal failed; the others go on
            ended[i] = (None, exc)
        finally:
            seconds[i] += time.perf_counter() - t0

    for i, job in enumerate(jobs):
        advance(i, partial(next, job))
    while waiting:
        order = list(waiting)
        requests = [waiting.pop(i) for i in order]
        t0 = time.perf_counter()
        try:
            results = draft_forward.run_draft_forwards(requests)
        except Exception as exc:  # each proposal in the batch gets the forward's error where it waits
            for i in order:
                advance(i, partial(jobs[i].throw, exc))
            continue
        elapsed = time.perf_counter() - t0
        rows = sum(r.queries for r in requests)
        for i, request, logits in zip(order, requests, results, strict=True):
            seconds[i] += elapsed * request.queries / rows
            advance(i, partial(jobs[i].send, logits))
    return [Outcome(*ended[i], seconds[i]) for i in range(len(jobs))]
