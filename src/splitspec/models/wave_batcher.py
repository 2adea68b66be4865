"""Draft trees of several sequences grown in lockstep: their forwards run as one batch.

An edge engine's draft model drafts for every sequence it serves, each over its own cache. A
proposal is a few small forwards: a catch-up step over the tokens the verifier accepted, then one
per level of its tree (a wave, :mod:`splitspec.decoding.tree_run`). Through a 2-layer model of
256 features a CPU spends such a forward in per-module Python, not in arithmetic, so sixteen
sequences' waves run as one batch (:func:`~splitspec.models.batched.forward_batch`, each row over
its own cache with its own mask) cost a fraction of sixteen forwards. One at a time, they also
queue behind each other on the drafting thread.

So each proposal runs on a drafting thread of its own, inside :meth:`WaveBatcher.drafting`, and
hands each forward to :meth:`WaveBatcher.forward`, which waits. A batch runs once every proposal
in progress is waiting for a forward (or has finished): the trees grow in lockstep, a level per
batch, and the thread whose forward completes the set computes the batch for all. A proposal
alone (one sequence, or a caller outside :meth:`~WaveBatcher.drafting`) runs its forwards at once.
``patience_s`` bounds how long a waiting forward waits for proposals that have not yet asked for
theirs (one still building its tree in Python, say); then what is waiting runs.

Each row computes what its forward computes alone (:mod:`splitspec.models.row_attention`), so
batching changes no draft beyond floating-point summation order.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from splitspec.models.batched import BatchRow, forward_batch
from splitspec.models.batcher import BatchLog
from splitspec.models.kv_cache import KVCache
from splitspec.models.masks import chain
from splitspec.models.stack import FullModel

PATIENCE_S = 0.05  # longest a waiting forward waits for proposals that have not asked for theirs, seconds


@dataclass(eq=False)  # identity: its fields hold tensors
class _Wave:
    row: BatchRow
    logits: torch.Tensor | None = None  # (q, V) float32, once run
    error: BaseException | None = None  # its batch failed
    done: bool = False


class WaveBatcher:
    """Runs the forwards of a draft model's concurrent proposals as batches (see the module docstring)."""

    def __init__(self, model: FullModel, max_rows: int = 64, patience_s: float = PATIENCE_S) -> None:
        if max_rows < 1 or patience_s < 0:
            raise ValueError(f"max_rows ({max_rows}) must be >= 1 and patience_s ({patience_s}) >= 0")
        self.model = model
        self.max_rows = max_rows  # rows of one batched forward, at most
        self.patience_s = patience_s
        self._cond = threading.Condition()
        self._drafting = 0  # proposals in progress (inside drafting())
        self._waiting: list[_Wave] = []
        self._running = False  # a thread is computing a batch
        self.log = BatchLog()  # the batched forwards by rows, and their compute

    @contextmanager
    def drafting(self) -> Iterator[None]:
        """Count a proposal in progress while inside: a batch waits for its next forward, or for its end."""
        with self._cond:
            self._drafting += 1
        try:
            yield
        finally:
            with self._cond:
                self._drafting -= 1
                self._cond.notify_all()  # those waiting may now be every proposal left

    def forward(
        self,
        cache: KVCache,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        visible: torch.Tensor,
        key_positions: torch.Tensor,
    ) -> torch.Tensor:
        """The draft model's :meth:`~splitspec.models.stack.FullModel.forward_visible` over ``cache``, run in a
        batch with the other proposals' forwards: token_ids (q,) -> logits (q, V) float32; appends q entries."""
        q = int(token_ids.shape[0])
        with torch.inference_mode():
            hidden = self.model.embed(token_ids[None])  # (1, q, H)
        # parents are not read: ``visible`` says what each query sees
        parents = torch.tensor(chain(q), dtype=torch.int32)
        wave = _Wave(BatchRow(hidden, positions, parents, cache, visible=visible, key_positions=key_positions))
        deadline = time.monotonic() + self.patience_s
        with self._cond:
            self._waiting.append(wave)
            self._cond.notify_all()
            while not wave.done:
                now = time.monotonic()
                if not self._running and (len(self._waiting) >= self._drafting or now >= deadline):
                    batch = self._waiting[: self.max_rows]
                    del self._waiting[: self.max_rows]
                    self._running = True
                    self._cond.release()
                    try:
                        self._run(batch)
                    finally:
                        self._cond.acquire()
                        self._running = False
                        self._cond.notify_all()
                    continue
                self._cond.wait(timeout=max(deadline - now, 1e-3))
        if wave.error is not None:
            raise wave.error
        if wave.logits is None:
            raise RuntimeError("a draft forward finished without logits")
        return wave.logits

    def _run(self, batch: list[_Wave]) -> None:
        """One batched forward over ``batch``'s rows (outside the lock); each wave gets its logits or the error."""
        t0 = time.perf_counter()
        try:
            with torch.inference_mode():
                streams = forward_batch(self.model.layers, [wave.row for wave in batch])  # each (1, q_b, H)
                logits = self.model.row_logits(streams)  # each (1, q_b, V)
        except Exception as error:  # each waiting thread raises it: forward_batch rolled the caches back
            for wave in batch:
                wave.error, wave.done = error, True
            return
        self.log.observe(len(batch), (time.perf_counter() - t0) * 1e3)
        for wave, rows in zip(batch, logits, strict=True):
            wave.logits, wave.done = rows[0], True
