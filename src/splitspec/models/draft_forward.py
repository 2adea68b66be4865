"""One forward of a draft model over one sequence's own cache, and several sequences' as one batched forward.

A draft model's proposal is a few forwards: a catch-up step (the tokens the verifier accepted since the last
proposal) and one forward per level of its tree (:mod:`~splitspec.decoding.tree_run`). A drafter describes
each as a :class:`DraftForward`; :func:`run_draft_forward` runs one as the drafter always has, and
:func:`run_draft_forwards` runs the forwards of several sequences that share one model as one
:func:`~splitspec.models.batched.forward_batch` (ragged rows, each over its own cache with the mask it gets
alone) and one LM-head product for all their rows (:meth:`~splitspec.models.stack.ModelEnds.row_logits`).

Why: the demo's draft model is tiny (2 layers of 128), so a forward is hundreds of small torch calls whatever
its rows; on a CPU a lone forward of 1-4 rows costs about what a batch of several sequences' rows does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from splitspec.models.batched import BatchRow, forward_batch
from splitspec.models.kv_cache import KVCache
from splitspec.models.stack import FullModel

ALONE_QUERIES = 32  # a forward of more query tokens (a long catch-up) runs alone: a batch pads every row to it


@dataclass(frozen=True)
class DraftForward:
    """One forward of ``model`` after ``cache``'s entries: a step of the committed sequence (``parents``) or a
    draft tree's wave (``visible`` and ``key_positions``). Its q entries join the cache, committed."""

    model: FullModel
    cache: KVCache
    ids: torch.Tensor  # (q,) long: the tokens
    positions: torch.Tensor  # (q,) int32
    parents: torch.Tensor | None = None  # (q,) int32: a step's tree over the cached prefix (a chain: catch-up)
    visible: torch.Tensor | None = None  # (q, past + q) bool: a wave's keys each query sees
    key_positions: torch.Tensor | None = None  # (past + q,) int32: the position of every key
    logits_from: int = 0  # logits are wanted for queries logits_from .. q - 1, tokens

    def __post_init__(self) -> None:
        if (self.parents is None) == (self.visible is None or self.key_positions is None):
            raise ValueError("a draft forward is either a step (parents) or a wave (visible and key_positions)")
        if not 0 <= self.logits_from < self.ids.shape[0]:
            raise ValueError(f"logits_from {self.logits_from} is not a query of {self.ids.shape[0]}")

    @property
    def queries(self) -> int:
        return int(self.ids.shape[0])


@torch.inference_mode()
def run_draft_forward(request: DraftForward) -> torch.Tensor:
    """One forward alone -> logits (q - logits_from, V) float32."""
    model, visible, keys = request.model, request.visible, request.key_positions
    if visible is not None and keys is not None:
        logits = model.forward_visible(request.ids, request.positions, visible, keys, request.cache)  # (q, V)
        return logits[request.logits_from :]
    step: torch.Tensor = model(request.ids, request.positions, _parents(request), request.cache, request.logits_from)
    return step


@torch.inference_mode()
def run_draft_forwards(requests: Sequence[DraftForward]) -> list[torch.Tensor]:
    """Each request's logits (q - logits_from, V) float32, as :func:`run_draft_forward` gives them: those of one
    model with at most :data:`ALONE_QUERIES` queries as one batched forward, the others alone. The requests'
    caches must be distinct."""
    if len({id(r.cache) for r in requests}) != len(requests):
        raise ValueError("two draft forwards over one cache cannot run in one batch")
    out: dict[int, torch.Tensor] = {}  # request index -> its logits
    groups: dict[int, list[int]] = {}
    for i, request in enumerate(requests):
        if request.queries > ALONE_QUERIES:
            out[i] = run_draft_forward(request)
        else:
            groups.setdefault(id(request.model), []).append(i)
    for members in groups.values():
        if len(members) == 1:
            out[members[0]] = run_draft_forward(requests[members[0]])
            continue
        model = requests[members[0]].model
        rows = [_batch_row(requests[i]) for i in members]
        hidden = forward_batch(model.layers, rows)  # each (1, q_b, H)
        wanted = [h[:, requests[i].logits_from :] for h, i in zip(hidden, members, strict=True)]
        for i, logits in zip(members, model.row_logits(wanted), strict=True):
            out[i] = logits[0]  # (q_b - logits_from, V)
    return [out[i] for i in range(len(requests))]


def _parents(request: DraftForward) -> torch.Tensor:
    """A step's parents; a wave's stand-in (unread: its visible mask stands in, BatchRow.masks)."""
    if request.parents is not None:
        return request.parents
    return torch.full((request.queries,), -1, dtype=torch.int32)


def _batch_row(request: DraftForward) -> BatchRow:
    return BatchRow(
        hidden=request.model.embed(request.ids[None]),  # (1, q, H)
        positions=request.positions,
        parents=_parents(request),
        cache=request.cache,
        visible=request.visible,
        key_positions=request.key_positions,
    )
