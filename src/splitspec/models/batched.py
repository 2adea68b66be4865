"""One forward through a :class:`~splitspec.models.stack.LayerStack` for the steps of several sessions.

Each row of the batch is one session's step: its own query tokens (ragged lengths, padded to the
longest), positions, parents and KV cache. The rows are padded into one (B, q_max, H) batch; the
layers see, through :class:`BatchedCaches`, each session's committed keys and values padded to
the longest prefix, followed by the step's own keys. Row b's additive mask (B, 1, q_max,
past_max + q_max) applies that session's step-mask rule (:func:`~splitspec.models.masks.ragged_masks`,
the builder a lone step uses too) to its real columns and masks everything else, so a padded key
gets exactly zero weight and every row computes what the session's step computes alone. Padded
query rows attend to nothing real; their outputs are dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from splitspec.models.kv_cache import KVCache
from splitspec.models.masks import ragged_masks
from splitspec.models.stack import LayerStack


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


class BatchedCaches:
    """transformers' ``update(key, value, layer_idx)`` over the caches of a batch's rows.

    Each row's real keys (B, kv, q_b, d) are appended to its own cache; what is returned is every
    row's committed prefix padded to ``past_max``, then the step's keys padded to ``q_max``.
    """

    def __init__(self, caches: Sequence[KVCache], lengths: Sequence[int], past: Sequence[int]) -> None:
        self.caches = caches
        self.lengths = lengths  # query tokens per row
        self.past = past  # committed entries per row
        self.past_max = max(past)

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """key, value (B, kv, q_max, d) -> all keys, values (B, kv, past_max + q_max, d)."""
        batch, heads, q_max, dim = key.shape
        past_max = self.past_max
        keys = key.new_empty((batch, heads, past_max + q_max, dim))
        values = value.new_empty((batch, heads, past_max + q_max, dim))
        keys[:, :, past_max:] = key
        values[:, :, past_max:] = value
        for b, (cache, q, past) in enumerate(zip(self.caches, self.lengths, self.past, strict=True)):
            all_k, all_v = cache.update(key[b : b + 1, :, :q], value[b : b + 1, :, :q], layer_idx)  # (1, kv, past+q, d)
            keys[b, :, :past] = all_k[0, :, :past]
            values[b, :, :past] = all_v[0, :, :past]
            if past < past_max:  # masked padding gets zero weight, but must be finite (0 x NaN is NaN)
                keys[b, :, past:past_max] = 0
                values[b, :, past:past_max] = 0
        return keys, values

    def commit(self) -> None:
        for cache in self.caches:
            cache.commit()

    def rollback(self) -> None:
        for cache in self.caches:
            cache.rollback()


def batch_masks(
    rows: Sequence[BatchRow],
    windows: set[int | None],
    past_max: int,
    q_max: int,
    dtype: torch.dtype,
    device: torch.device,
) -> dict[int | None, torch.Tensor]:
    """Additive masks (B, 1, q_max, past_max + q_max) for the rows, one per sliding window of the
    stack's layers (:func:`~splitspec.models.masks.ragged_masks`, the one mask builder)."""
    parents = [row.parents for row in rows]
    positions = [row.positions for row in rows]
    return ragged_masks(parents, positions, [len(row.cache) for row in rows], windows, past_max, q_max, dtype, device)


@torch.inference_mode()
def forward_batch(stack: LayerStack, rows: Sequence[BatchRow]) -> list[torch.Tensor]:
    """Run every row's step through ``stack`` in one forward -> each row's output (1, q, H) on the output device
    ((1, q, 2H) for a row with a ``capture`` layer).

    The caches receive their rows' entries and are committed on success, rolled back on failure.
    """
    if len(rows) == 1:  # a lone step takes the per-session path: no padding, and no mask for a decode step
        row = rows[0]
        return [stack(row.hidden, row.positions, row.parents, row.cache, row.capture)]
    lengths = [row.positions.shape[0] for row in rows]
    past = [len(row.cache) for row in rows]
    q_max = max(lengths)
    if q_max == 1:  # decode steps only: no padding
        hidden = torch.cat([row.hidden for row in rows])  # (B, 1, H)
        positions = torch.cat([row.positions for row in rows]).to(torch.long)[:, None]  # (B, 1)
    else:
        first = rows[0].hidden
        hidden = first.new_zeros((len(rows), q_max, first.shape[2]))  # (B, q_max, H)
        positions = torch.zeros((len(rows), q_max), dtype=torch.long)  # (B, q_max)
        for b, (row, q) in enumerate(zip(rows, lengths, strict=True)):
            hidden[b, :q] = row.hidden[0]
            positions[b, :q] = row.positions.to(torch.long)
    caches = BatchedCaches([row.cache for row in rows], lengths, past)
    if not len(stack.layers):
        return [row.hidden for row in rows]
    inputs: dict[
        torch.device, tuple[torch.Tensor, dict[str, tuple[torch.Tensor, torch.Tensor]], dict[int | None, torch.Tensor]]
    ] = {}
    captured: dict[int, torch.Tensor] = {}  # row -> its capture layer's output (1, q, H)
    try:
        for j in range(len(stack.layers)):
            hidden = hidden.to(stack.devices[j], non_blocking=True)  # moves only at a device boundary
            if hidden.device not in inputs:
                pos = positions.to(hidden.device, non_blocking=True)
                masks = batch_masks(rows, set(stack.windows), caches.past_max, q_max, hidden.dtype, hidden.device)
                inputs[hidden.device] = (pos, stack.position_embeddings(hidden, pos), masks)
            pos, rope, masks = inputs[hidden.device]
            hidden = stack.run_layer(j, hidden, pos, rope, masks, caches)
            for b, (row, q) in enumerate(zip(rows, lengths, strict=True)):
                if row.capture == j:
                    captured[b] = hidden[b : b + 1, :q]
    except BaseException:
        caches.rollback()
        raise
    caches.commit()
    outs = [hidden[b : b + 1, :q] for b, q in enumerate(lengths)]
    return [
        out if b not in captured else torch.cat([out, captured[b].to(out.device)], -1) for b, out in enumerate(outs)
    ]
