"""Drafters catch up with the prompt while the prefill's round trip is in flight.

A draft model must run the whole prompt through its own cache before its first proposal, and an
n-gram pool must index it; done on the first decode step, that work (tens of milliseconds for a
2,000-token prompt on a CPU) is added to the step's round trip. During the prefill the edge sits
idle, waiting for the trunk: :func:`start_prepare` starts every :class:`~splitspec.decoding.drafters.Preparable`
drafter's ``prepare(context)`` on the draft executor before the prefill is sent, and the decode
loop awaits it before its first draft. The executor runs one job at a time, so a later proposal
never overlaps a preparation.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor

from splitspec.decoding.drafters import Drafter, Preparable

log = logging.getLogger(__name__)


def prepare_all(drafters: Sequence[Preparable], context: tuple[int, ...]) -> None:
    for drafter in drafters:
        drafter.prepare(context)


def start_prepare(
    drafters: Mapping[str, Drafter], context: Sequence[int], executor: Executor | None
) -> asyncio.Future[None] | None:
    """Start preparing ``drafters`` for ``context`` on ``executor``; None when there is nothing to run
    there (no preparable drafter, or no executor: the first proposal then does the work itself)."""
    preparable = [d for d in drafters.values() if isinstance(d, Preparable)]
    if executor is None or not preparable:
        return None
    snapshot = tuple(context)  # the loop appends to its context while this runs
    return asyncio.get_running_loop().run_in_executor(executor, prepare_all, preparable, snapshot)


async def finish_prepare(prepared: asyncio.Future[None] | None) -> None:
    """Wait for :func:`start_prepare`'s work (a no-op for None); its failure is raised here."""
    if prepared is not None:
        await prepared
