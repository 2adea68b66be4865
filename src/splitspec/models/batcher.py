"""Continuous batching of per-sequence steps through one layer stack: the trunk's and the edge's.

Steps of different sequences that are waiting when the compute worker comes free run together.
One iteration runs every waiting small step (at most ``small_step_tokens`` query tokens: decode
steps and draft trees) in one batched forward, their tokens packed end to end
(:func:`~splitspec.models.batched.forward_batch`) and hands their results back at once; then one
chunk of the oldest big step (a prefill) in a forward of its own, sized by
:class:`~splitspec.models.prefill_chunks.ChunkSizer` (at most ``prefill_chunk_tokens``; about one
decode batch's time while decode traffic is live). Small steps that arrive during a chunk run
before the next chunk, so a big prefill is spread over iterations and a decode step waits for at
most one chunk. Each sequence has at most one step in flight (the trunk refuses a second step of a
session; an edge sequence waits for its logits), so rows of a batch always belong to different
sequences.

Gathering: sequences that decode together send their next steps within a few milliseconds of each
other, and a worker that started on the first arrival would run a batch of one or two rows (on a
CPU nearly the price of a full batch) while the rest queue behind it. So a free worker waits for
the active sequences (a step delivered in the last :data:`ACTIVE_S` second) whose next step is due
within the window, for at most ``gather`` times a decode batch's measured forward time, then runs
whatever has come. A sequence's next step is due one *away time* after its last delivery: the time
it last spent between a delivery and its next step (its round trip through the rest of the system);
a sequence with none measured yet counts as due. Sequences out of phase (many streams, each at
another point of its round trip) are then not waited for: waiting for all the active ones cost the
trunk 53-61 ms a step at 32 streams (its compute: 32). A lone sequence never waits (it is the only
active one). The forwards run on one worker thread, off the event loop, or on the event loop itself
(``threaded=False``: on a CPU, where a worker thread waits for the interpreter lock after every torch
call; see :func:`splitspec.devices.compute_on_threads`).

:class:`RowBatcher` is the policy; what one forward computes (:meth:`RowBatcher.run_rows`) and
what is recorded of it (:meth:`RowBatcher.observe_batch`) belong to its user: the trunk server
(:class:`splitspec.cloud.batcher.StepBatcher`) and the edge engine
(:mod:`splitspec.edge.engine`: its head and its tail).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import weakref
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from splitspec.models.batched import BatchRow
from splitspec.models.kv_cache import KVCache
from splitspec.models.masks import is_chain
from splitspec.models.prefill_chunks import ChunkSizer

log = logging.getLogger(__name__)

ACTIVE_S = 1.0  # a sequence whose step was delivered this recently counts as one whose next step is coming


@dataclass(eq=False)  # identity: its fields hold tensors
class _Pending:
    """A submitted step and how far it has got."""

    hidden: torch.Tensor  # (1, q, H) on the host
    positions: torch.Tensor  # (q,)
    parents: torch.Tensor  # (q,)
    cache: KVCache
    future: asyncio.Future[tuple[torch.Tensor, float, float]]
    queued: float  # time.perf_counter() at submission
    started: float | None = None  # when its first forward began
    done: int = 0  # query tokens computed so far
    compute_ms: float = 0.0  # forwards it took part in, milliseconds
    outputs: list[torch.Tensor] = field(default_factory=list)
    error: Exception | None = None  # its forward failed
    outputs_from: int = 0  # outputs wanted from this query index on (see BatchRow)
    capture: int | None = None  # a local layer whose output is wanted too (see BatchRow)

    @property
    def tokens(self) -> int:
        return int(self.positions.shape[0])

    def next_row(self, chunk: int) -> BatchRow:
        """The row for its next ``chunk`` tokens (all of them for a small step)."""
        end = min(self.tokens, self.done + chunk)
        if self.done == 0 and end == self.tokens:
            return BatchRow(self.hidden, self.positions, self.parents, self.cache, self.outputs_from, self.capture)
        # a chain cut into chunks: each chunk's first token hangs off what is now the committed prefix
        parents = torch.arange(-1, end - self.done - 1, dtype=self.parents.dtype)
        wanted = min(end - self.done, max(0, self.outputs_from - self.done))  # within this chunk
        part = self.hidden[:, self.done : end]
        return BatchRow(part, self.positions[self.done : end], parents, self.cache, wanted, self.capture)


class RowBatcher:
    """Queues steps from all sequences and runs them in batched forwards on one worker thread (or the event loop).

    A subclass says what one forward computes (:meth:`run_rows`) and may record each batch
    (:meth:`observe_batch`).
    """

    def __init__(
        self,
        max_batch_steps: int = 64,
        small_step_tokens: int = 64,
        prefill_chunk_tokens: int = 256,
        gather: float = 0.5,
        thread_name: str = "batch",
        max_big_steps: int = 1,  # big steps (prefills) whose chunks share one forward; the trunk runs one at a time
        threaded: bool = True,  # forwards on a worker thread; False = on the event loop (devices.compute_on_threads)
    ) -> None:
        if gather < 0:
            raise ValueError(f"the gathering window is a non-negative fraction of a batch's time, got {gather}")
        self.gather = gather
        self.max_batch_steps = max_batch_steps
        self.small_step_tokens = small_step_tokens
        self.max_big_steps = max(1, max_big_steps)
        self.chunks = ChunkSizer(prefill_chunk_tokens)
        self._pending: list[_Pending] = []
        # each sequence's cache -> when its last step was delivered (weak: a closed sequence's cache is freed)
        self._delivered: weakref.WeakKeyDictionary[KVCache, float] = weakref.WeakKeyDictionary()
        # each sequence's cache -> its last away time: from a delivery to its next step, seconds
        self._away: weakref.WeakKeyDictionary[KVCache, float] = weakref.WeakKeyDictionary()
        self._thread_name = thread_name
        self.threaded = threaded
        self._wake = asyncio.Event()
        self._executor: ThreadPoolExecutor | None = None  # the worker thread, while started
        self._task: asyncio.Task[None] | None = None

    def run_rows(self, rows: list[BatchRow]) -> list[torch.Tensor]:
        """One forward over ``rows`` (on the worker thread, or the event loop) -> each row's output (1, q, ...): the
        caches receive their rows' entries (committed on success, rolled back on failure)."""
        raise NotImplementedError

    def observe_batch(self, steps: int, tokens: int, compute_ms: float) -> None:
        """One forward of ``steps`` rows and ``tokens`` query tokens took ``compute_ms`` (where it ran)."""

    @property
    def running(self) -> bool:
        return self._task is not None

    @property
    def failed(self) -> bool:
        """Started and not stopped, yet its worker has ended (crashed): every step submitted now is refused."""
        return self._task is not None and self._task.done()

    def start(self) -> None:
        """Start the worker (in the running event loop); a stopped batcher may be started again."""
        self._wake = asyncio.Event()
        if self.threaded:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=self._thread_name)
        self._task = asyncio.create_task(self._run_forever())
        self._task.add_done_callback(_report_crash)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
        for p in self._pending:  # nobody will compute them now
            if not p.future.done():
                p.future.set_exception(RuntimeError("the batcher stopped"))
        self._pending.clear()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    async def submit(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        parents: torch.Tensor,
        cache: KVCache,
        outputs_from: int = 0,
        capture: int | None = None,
    ) -> tuple[torch.Tensor, float, float]:
        """Queue one sequence's step -> its output (1, q, ...) from :meth:`run_rows`, compute ms and queue wait ms.

        ``outputs_from``: a :meth:`run_rows` that honours it returns only the outputs from that query index on;
        ``capture``: one that honours it appends that local layer's output to the step's (see BatchRow).
        A batcher not started, stopping or stopped raises RuntimeError: nobody would compute the step.
        """
        if self._task is None or self._task.done():
            raise RuntimeError("the batcher is not running")
        future: asyncio.Future[tuple[torch.Tensor, float, float]] = asyncio.get_running_loop().create_future()
        now = time.perf_counter()
        delivered = self._delivered.get(cache)
        if delivered is not None:
            self._away[cache] = now - delivered
        pending = _Pending(hidden, positions, parents, cache, future, now, outputs_from=outputs_from, capture=capture)
        self._pending.append(pending)
        self._wake.set()
        return await future

    def _plan(self) -> tuple[list[_Pending], list[_Pending], int | None]:
        """This iteration's small steps (oldest first), the big steps that get a chunk each, and the chunk
        (None: a tree, which cannot be cut, goes whole and alone)."""
        small = [p for p in self._pending if p.tokens <= self.small_step_tokens][: self.max_batch_steps]
        big = [p for p in self._pending if p.tokens > self.small_step_tokens]
        if not big:
            return small, [], None
        if not is_chain(big[0].parents):
            return small, big[:1], None
        chains = [p for p in big if is_chain(p.parents)][: self.max_big_steps]
        # several prefills share the iteration's budget: one forward of all, each cut to its share. A
        # chunk is kept small so that a decode step arriving waits for one chunk at most; with no other
        # sequence active (none waiting, none delivered within ACTIVE_S) no decode step can arrive
        now = time.perf_counter()
        decoding = self._active(now) - {p.cache for p in chains}
        budget = self.chunks.next_chunk(now) if decoding else self.chunks.max_tokens
        return small, chains, max(self.chunks.min_tokens, budget // len(chains))

    async def _run_forever(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._pending:
                await self._gather()
                self._drop_abandoned()
                if not self._pending:
                    break
                small, big, chunk = self._plan()
                if small:  # first, and delivered before any chunk runs
                    await self._run(small, None)
                if big:
                    await self._run(big, chunk if chunk is not None else big[0].tokens)  # a tree goes whole

    def _drop_abandoned(self) -> None:
        """Forget the steps whose caller stopped waiting (its submit was cancelled: a client went away), before they
        take a batch's place or another chunk. Their caches are left as they are: the edge starts a cancelled
        sequence's caches afresh, and the trunk closes the sessions of a connection that went away."""
        self._pending = [p for p in self._pending if not p.future.done()]

    def _active(self, now: float) -> set[KVCache]:
        """Sequences with a step waiting or delivered within :data:`ACTIVE_S` (older entries are dropped)."""
        for cache in [c for c, at in self._delivered.items() if now - at > ACTIVE_S]:
            del self._delivered[cache]
        return set(self._delivered.keys()) | {p.cache for p in self._pending}

    def _due(self, now: float, deadline: float, window: float) -> bool:
        """Whether an active sequence with no step waiting is due to send one by ``deadline``: one away
        time after its last delivery (unmeasured: due; overdue by more than the ``window``: not)."""
        for cache in self._active(now) - {p.cache for p in self._pending}:  # delivered, none waiting
            away = self._away.get(cache)
            if away is None or now - window <= self._delivered[cache] + away <= deadline:
                return True
        return False

    async def _gather(self) -> None:
        """Wait (at most ``gather`` decode batches' time) for the next steps of the sequences due meanwhile."""
        window = None if self.chunks.decode_ms is None else self.gather * self.chunks.decode_ms / 1e3
        if not window:
            return
        deadline = time.perf_counter() + window
        while (now := time.perf_counter()) < deadline and self._due(now, deadline, window):
            self._wake.clear()
            try:
                async with asyncio.timeout(deadline - now):
                    await self._wake.wait()
            except TimeoutError:
                return

    async def _run(self, group: list[_Pending], chunk: int | None) -> None:
        """One forward on the worker thread or the event loop (``chunk`` tokens of a big step, or whole small
        steps), then deliver the steps it finished."""
        try:
            if not self.threaded:
                self._forward(group, chunk)
                # and yield: the steps just computed (and replies, other parts' batches) run before the next
                # iteration plans, as while a worker thread computes; else a prefill's chunks would run back to back
                await asyncio.sleep(0)
            elif self._executor is None:
                raise RuntimeError("the batcher is not started")
            else:
                await asyncio.get_running_loop().run_in_executor(self._executor, self._forward, group, chunk)
        except Exception as exc:  # a bug of ours outside the forward: fail its steps
            log.exception("batching iteration failed")
            for p in group:
                p.done, p.error = p.tokens, exc
        for p in group:
            if p.done == p.tokens:
                self._pending.remove(p)
                self._deliver(p)

    def _forward(self, group: list[_Pending], chunk: int | None) -> None:
        """Run ``group`` (on the worker thread, or the event loop): its steps' next rows in one forward."""
        rows = [p.next_row(chunk or p.tokens) for p in group]
        t0 = time.perf_counter()
        try:
            host = self.run_rows(rows)
        except Exception as exc:  # every step of the failed forward fails (the trunk drops their sessions)
            for p in group:
                p.done, p.error = p.tokens, exc
            return
        end = time.perf_counter()
        ms = (end - t0) * 1e3
        tokens = sum(r.positions.shape[0] for r in rows)
        self.observe_batch(len(rows), tokens, ms)
        if chunk is None:
            self.chunks.observe_decode(ms, end)
        else:
            self.chunks.observe_chunk(tokens, ms)
        for p, row, out in zip(group, rows, host, strict=True):
            p.started = t0 if p.started is None else p.started
            p.done += row.positions.shape[0]
            p.compute_ms += ms
            p.outputs.append(out)
        for p in group if chunk is not None else ():
            if p.done == p.tokens and len(p.outputs) > 1:
                p.cache.last_step = p.tokens  # a keep_last on the next step indexes the whole step
                # joined here, not on the event loop: 8 MB for 2,000 x 1024 float32 stalled every session's I/O
                p.outputs = [torch.cat(p.outputs, dim=1)]  # (1, q, H)

    def _deliver(self, p: _Pending) -> None:
        self._delivered[p.cache] = time.perf_counter()
        if p.future.done():  # its connection went away meanwhile
            return
        if p.error is not None:
            p.future.set_exception(p.error)
            return
        out = p.outputs[0]  # (1, q, H): a chunked step's outputs were joined on the worker thread
        queue_ms = ((p.started or p.queued) - p.queued) * 1e3
        p.future.set_result((out, p.compute_ms, queue_ms))


def _report_crash(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("the batching loop stopped", exc_info=task.exception())


class BatchLog:
    """The forwards one of the engine's workers ran: per batch size (rows), how many and their total time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # the worker thread writes, the event loop reads
        self.forwards: Counter[int] = Counter()  # rows -> forwards of that many rows
        self.total_ms: dict[int, float] = {}  # rows -> their total compute, milliseconds

    def observe(self, rows: int, ms: float) -> None:
        with self._lock:
            self.forwards[rows] += 1
            self.total_ms[rows] = self.total_ms.get(rows, 0.0) + ms

    def snapshot(self) -> dict[int, tuple[int, float]]:
        """rows -> (forwards, mean compute ms per forward), sorted by rows."""
        with self._lock:
            return {rows: (n, self.total_ms[rows] / n) for rows, n in sorted(self.forwards.items())}
