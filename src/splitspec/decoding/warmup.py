"""Drafters catch up with the prompt while the prefill's round trip is in flight.

A draft model must run the whole prompt through its own cache before its first proposal, and an
n-gram pool must index it; done on the first decode step, that work (tens of milliseconds for a
2,000-token prompt on a CPU) is added to the step's round trip. During the prefill the edge sits
idle, waiting for the trunk: :func:`start_prepare` starts every :class:`~splitspec.decoding.drafters.Preparable`
drafter's ``prepare(context)`` on the draft executor as soon as the prefill is sent (the forward's
``sent``: after the edge's head forward over the prompt, which a preparation beside it slowed by
about 10 % on an edge with one core), and the decode loop awaits it before its first decode step. An
answer that ends at its first token (a stop token, one token asked for) does not wait for it:
:func:`abandon_prepare` cancels it, and it stops at its next piece (a piece running on the drafting
thread ends first, on the drafter's own state). The executor runs one job at a time, so a later proposal
never overlaps a preparation. An executor that runs its jobs on the event loop (a CPU engine's,
:class:`~splitspec.decoding.aside.DraftExecutor` with ``threaded=False``) gets the prompt in pieces of
:data:`PREPARE_PIECE_TOKENS`, the loop free between two: a 900-token prompt's preparation in one piece held
every other sequence's steps for 20 ms or more.

A drafter that reads the verifier's features (an EAGLE head: :class:`~splitspec.decoding.drafters.CatchesUp`)
cannot start before the prefill's features are in, and feeding it a long prompt's pairs on the first
decode step cost that step 141-178 ms after 2,000 tokens of code (``benchmarks/auto_floor.py --head``).
:func:`start_catch_up` starts that work on the draft executor once the prefill is back; the loop does
not ask those drafters until it is done, so it runs during the first decode steps' round trips. After a
short context (at most :data:`CATCH_UP_MIN_TOKENS`) the first proposal does it instead: the demo head
caught up with 64 tokens in 2.6 ms and 128 in 4.2 ms (256: 8.1 ms, 1,000: 43.5 ms) on this project's
2-core machine, less than a step without the drafter costs. Every other drafter that proposes on the
executor waits too: a proposal queued behind the catch-up would hold its step back as long.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Executor

from splitspec.decoding.aside import DraftExecutor
from splitspec.decoding.drafters import CatchesUp, Drafter, Preparable, prepare_pieces

log = logging.getLogger(__name__)

CATCH_UP_MIN_TOKENS = 128  # contexts up to this long are caught up with by the first proposal itself, tokens
PREPARE_PIECE_TOKENS = 128  # prompt tokens one preparation job takes on an event-loop executor (demo draft: 3 ms)


def prepare_all(drafters: Sequence[Preparable], context: tuple[int, ...], stop: threading.Event | None = None) -> None:
    """Prepare ``drafters`` for ``context`` one after the other, stopping between two pieces once ``stop`` is set
    (a piece: the drafter's own, :func:`~splitspec.decoding.drafters.prepare_pieces`, a draft model's chunk)."""
    for drafter in drafters:
        if stop is None:
            drafter.prepare(context)
            continue
        for _ in prepare_pieces(drafter, context, max(1, len(context))):  # as ``prepare`` cuts it
            if stop.is_set():
                return


def start_prepare(
    drafters: Mapping[str, Drafter], context: Sequence[int], executor: Executor | None
) -> asyncio.Future[None] | None:
    """Start preparing ``drafters`` for ``context`` on ``executor``; None when there is nothing to run
    there (no preparable drafter, or no executor: the first proposal then does the work itself)."""
    preparable = [d for d in drafters.values() if isinstance(d, Preparable)]
    if executor is None or not preparable:
        return None
    snapshot = tuple(context)  # the loop appends to its context while this runs
    future: asyncio.Future[None]
    if isinstance(executor, DraftExecutor) and not executor.threaded:
        future = asyncio.ensure_future(_prepare_in_pieces(preparable, snapshot, executor))  # cancelled between pieces
    else:
        stop = threading.Event()  # a job running on the thread stops at its next piece once the future is cancelled
        future = asyncio.get_running_loop().run_in_executor(executor, prepare_all, preparable, snapshot, stop)
        future.add_done_callback(lambda done: stop.set() if done.cancelled() else None)
    future.add_done_callback(_retrieve)  # abandoned (abandon_prepare), it leaves no unretrieved failure behind
    return future


async def _prepare_in_pieces(drafters: Sequence[Preparable], context: tuple[int, ...], executor: Executor) -> None:
    """Prepare ``drafters`` for ``context`` one after the other, one job per piece of about
    :data:`PREPARE_PIECE_TOKENS` tokens (:func:`~splitspec.decoding.drafters.prepare_pieces`: a windowed draft model
    prepares only the window its first proposal reads, the others growing prefixes of ``context``)."""
    loop = asyncio.get_running_loop()
    for drafter in drafters:
        pieces = prepare_pieces(drafter, context, PREPARE_PIECE_TOKENS)
        # each piece a job of its own, run once this task yields: the other sequences' ready work runs between two
        while await loop.run_in_executor(executor, _next_piece, pieces):
            pass


def _next_piece(pieces: Iterator[int]) -> bool:
    """Run the next piece of a preparation; False once there is none."""
    return next(pieces, None) is not None


async def finish_prepare(prepared: asyncio.Future[None] | None) -> None:
    """Wait for :func:`start_prepare`'s work (a no-op for None); its failure is raised here."""
    if prepared is not None:
        await prepared


def abandon_prepare(prepared: asyncio.Future[None] | None) -> None:
    """Give up :func:`start_prepare`'s work, which no draft will use (a no-op for None or once it is done): a piece
    not started is not run; a piece running on the drafting thread ends there first (a forward cannot be
    interrupted), on the drafter's own state, before any later job of that one-at-a-time executor starts."""
    if prepared is not None:
        prepared.cancel()


def catch_up_all(drafters: Sequence[CatchesUp], context: tuple[int, ...]) -> None:
    for drafter in drafters:
        drafter.catch_up(context)


def start_catch_up(
    drafters: Mapping[str, Drafter], context: Sequence[int], executor: Executor | None
) -> asyncio.Future[None] | None:
    """Start the feature readers' catch-up with ``context`` (the prompt and its first token) on ``executor``, after
    the prefill; None when there is nothing to start (no such drafter, no executor, or a short context)."""
    readers = [d for d in drafters.values() if isinstance(d, CatchesUp)]
    if executor is None or not readers or len(context) <= CATCH_UP_MIN_TOKENS:
        return None
    future = asyncio.get_running_loop().run_in_executor(executor, catch_up_all, readers, tuple(context))
    future.add_done_callback(_retrieve)  # a generation that ends first leaves no unretrieved failure behind
    return future


def catching_up(future: asyncio.Future[None] | None) -> bool:
    """Whether :func:`start_catch_up`'s work still occupies the draft executor (its failure is raised once done)."""
    if future is None:
        return False
    if not future.done():
        return True
    future.result()  # raises what the catch-up raised
    return False


def _retrieve(future: asyncio.Future[None]) -> None:
    if not future.cancelled():
        future.exception()
