"""One forward through a :class:`~splitspec.models.stack.LayerStack` for the steps of several sessions.

Each row of the batch is one session's step: its own query tokens (ragged lengths), positions, parents
and KV cache. The rows' tokens are packed end to end into one (1, N, H) sequence, N the sum of their
lengths, so the projections and MLPs run as one product over real tokens only (padding every row to
the longest, as this module did before, made a decode step beside a 9-token draft tree cost 9 rows of
every product: on a CPU those products are most of a forward's time). Attention runs row by row
(:mod:`~splitspec.models.row_attention`): each row's slice of the sequence attends over its own cache
(views, no copy) with the mask its step would get alone (:func:`~splitspec.models.masks.step_mask`),
so every row computes what the session's step computes alone.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from splitspec.exceptions import ConfigError
from splitspec.models.kv_cache import KVCache
from splitspec.models.masks import step_masks, visible_masks
from splitspec.models.row_attention import RowAttention, RowKeys, row_starts
from splitspec.models.stack import LayerStack

_NO_MASKS: defaultdict[int | None, None] = defaultdict(lambda: None)  # rows bring their own (RowAttention)


@dataclass(frozen=True)
class BatchRow:
    """One session's step: hidden (1, q, H) on the host, positions (q,), parents (q,), its cache."""

    hidden: torch.Tensor  # (1, q, H)
    positions: torch.Tensor  # (q,) int
    parents: torch.Tensor  # (q,) int
    cache: KVCache
    outputs_from: int = 0  # the step's outputs wanted from this query index on (a prefill wants its last), tokens
    # a local layer whose output the row wants too (a draft head's feature): its output is then (1, q, 2H), the
    # stack's output followed by that layer's; None: (1, q, H)
    capture: int | None = None
    # a draft tree's wave (decoding/tree_run.py): the keys each query sees (q, past + q) bool and every key's
    # position (past + q,), in place of the prefix-plus-ancestors mask of ``parents`` (LayerStack.forward_visible)
    visible: torch.Tensor | None = None
    key_positions: torch.Tensor | None = None

    def masks(
        self, windows: set[int | None], dtype: torch.dtype, device: torch.device
    ) -> dict[int | None, torch.Tensor | None]:
        """The additive masks (1, 1, q, past + q) per sliding window its step gets alone (None: it sees all)."""
        if self.visible is not None and self.key_positions is not None:
            return visible_masks(self.visible, self.key_positions, self.positions, windows, dtype, device)
        return step_masks(self.parents, self.positions, len(self.cache), windows, dtype, device)


class BatchedCaches:
    """transformers' ``update(key, value, layer_idx)`` over the caches of a batch's rows.

    Each row's keys (its slice of the packed step, (1, kv, q_b, d)) are appended to its own cache, and
    what that cache returns (the row's prefix and step, (1, kv, past_b + q_b, d)) goes to
    :class:`RowKeys` for the row's attention. The packed step's keys are returned as they came: row
    attention does not read them.
    """

    def __init__(self, caches: Sequence[KVCache], lengths: Sequence[int], past: Sequence[int]) -> None:
        self.caches = caches
        self.lengths = lengths  # query tokens per row
        self.starts = row_starts(lengths)  # each row's first token in the packed sequence
        self.past = past  # committed entries per row
        self.keys = RowKeys()

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """key, value (1, kv, N, d), the rows packed: each row's entries join its cache -> key, value unchanged."""
        rows = zip(self.caches, self.starts, self.lengths, self.past, strict=True)
        for b, (cache, start, q, past) in enumerate(rows):
            all_k, all_v = cache.update(key[:, :, start : start + q], value[:, :, start : start + q], layer_idx)
            # (1, kv, past + q, d); a static cache's fixed step would return its whole buffer
            self.keys.put(layer_idx, b, all_k[:, :, : past + q], all_v[:, :, : past + q])
        return key, value

    def commit(self) -> None:
        for cache in self.caches:
            cache.commit()

    def rollback(self) -> None:
        for cache in self.caches:
            cache.rollback()


def row_masks(
    rows: Sequence[BatchRow], windows: set[int | None], dtype: torch.dtype, device: torch.device
) -> dict[int | None, list[torch.Tensor | None]]:
    """Each row's additive mask (1, 1, q_b, past_b + q_b) per sliding window of the stack's layers: the mask
    its step gets alone (:meth:`BatchRow.masks`)."""
    per_row = [row.masks(windows, dtype, device) for row in rows]
    return {w: [masks[w] for masks in per_row] for w in windows}


@torch.inference_mode()
def forward_batch(stack: LayerStack, rows: Sequence[BatchRow]) -> list[torch.Tensor]:
    """Run every row's step through ``stack`` in one forward -> each row's output (1, q, H) on the output device
    ((1, q, 2H) for a row with a ``capture`` layer).

    The caches receive their rows' entries and are committed on success, rolled back on failure.
    """
    if len(rows) == 1:  # a lone step takes the per-session path: no padding, and no mask for a decode step
        row = rows[0]
        if row.visible is not None and row.key_positions is not None:
            return [stack.forward_visible(row.hidden, row.positions, row.visible, row.key_positions, row.cache)]
        return [stack(row.hidden, row.positions, row.parents, row.cache, row.capture)]
    lengths = [int(row.positions.shape[0]) for row in rows]
    past = [len(row.cache) for row in rows]
    hidden = torch.cat([row.hidden for row in rows], 1)  # (1, N, H): the rows packed, N = sum of their q
    positions = torch.cat([row.positions for row in rows]).to(torch.long)[None]  # (1, N)
    caches = BatchedCaches([row.cache for row in rows], lengths, past)
    starts = caches.starts
    if not len(stack.layers):
        return [row.hidden for row in rows]
    inputs: dict[torch.device, tuple[torch.Tensor, dict[str, tuple[torch.Tensor, torch.Tensor]], dict[Any, Any]]] = {}
    captured: dict[int, torch.Tensor] = {}  # row -> its capture layer's output (1, q, H)
    try:
        for j in range(len(stack.layers)):
            hidden = hidden.to(stack.devices[j], non_blocking=True)  # moves only at a device boundary
            if hidden.device not in inputs:
                pos = positions.to(hidden.device, non_blocking=True)
                masks = row_masks(rows, set(stack.windows), hidden.dtype, hidden.device)
                attend = {w: RowAttention(lengths, starts, caches.keys, masks[w]) for w in masks}
                inputs[hidden.device] = (pos, stack.row_position_embeddings(hidden, pos, lengths), attend)
            pos, rope, attend = inputs[hidden.device]
            hidden = stack.run_layer(j, hidden, pos, rope, _NO_MASKS, caches, attend)
            for b, (row, start, q) in enumerate(zip(rows, starts, lengths, strict=True)):
                if row.capture == j:
                    captured[b] = hidden[:, start : start + q]
        skipped = sorted(set(caches.keys.rows) - caches.keys.attended)
        if skipped:  # their attention ran over the packed step as one sequence: rows saw each other, not their caches
            raise ConfigError(
                f"decoder layers {skipped} did not attend row by row: this family's layers do not pass splitspec's "
                "attention arguments on, so it cannot batch several sequences' steps"
            )
    except BaseException:
        caches.rollback()
        raise
    caches.commit()
    outs = [hidden[:, start : start + q] for start, q in zip(starts, lengths, strict=True)]  # each (1, q, H)
    return [
        out if b not in captured else torch.cat([out, captured[b].to(out.device)], -1) for b, out in enumerate(outs)
    ]
