"""Attention masks for one step of query tokens, rebuilt from compact parent indices.

A step carries q query tokens; token i has parent ``parents[i]`` (an earlier token of the step,
or -1 for the committed prefix). Token i may attend to the whole committed prefix, to its
ancestors within the step, and to itself: never to a sibling branch, never to a later token.
We always pass this explicit mask: relying on ``is_causal=True`` with a populated cache lets
drafted tokens see what they must not, silently.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def chain(q: int) -> list[int]:
    """Parents of a plain sequence of q tokens: -1, 0, 1, ..."""
    return list(range(-1, q - 1))


def is_chain(parents: torch.Tensor) -> bool:
    """True when the step is a plain sequence: token i's parent is i - 1."""
    q = parents.shape[0]
    return bool(torch.equal(parents.to(torch.long), torch.arange(-1, q - 1)))


def ancestor_matrix(parents: torch.Tensor) -> torch.Tensor:
    """(q, q) bool: ``out[i, j]`` is True iff j is i or an ancestor of i within the step."""
    q = parents.shape[0]
    if q == 1:  # a decode step: the token sees itself
        return torch.ones(1, 1, dtype=torch.bool)
    if is_chain(parents):
        return torch.ones(q, q, dtype=torch.bool).tril()
    out = torch.zeros(q, q, dtype=torch.bool)
    for i, p in enumerate(parents.tolist()):
        if p >= 0:
            out[i] = out[p]
        out[i, i] = True
    return out


def depths(parents: torch.Tensor) -> torch.Tensor:
    """(q,) long: depth of each query token (0 for a child of the committed prefix)."""
    if is_chain(parents):
        return torch.arange(parents.shape[0])
    return torch.tensor(list_depths(parents.tolist()), dtype=torch.long)


def step_positions(past_length: int, parents: Sequence[int]) -> list[int]:
    """Position id of each query token of a step given as a list of parents: past_length + its depth. In plain
    Python: the edge builds each step from lists on its event loop, where every small tensor op hands the GIL to
    the worker threads and waits to get it back."""
    return [past_length + d for d in list_depths(parents)]


def list_depths(parents: Sequence[int]) -> list[int]:
    """Depth of each query token (0 for a child of the committed prefix), from a list of parents."""
    out: list[int] = []
    for p in parents:
        out.append(0 if p < 0 else out[p] + 1)
    return out


def step_mask(
    parents: torch.Tensor,
    positions: torch.Tensor,
    past_length: int,
    dtype: torch.dtype,
    sliding_window: int | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Additive mask (1, 1, q, past_length + q) on ``device``: 0 where attention is allowed, dtype-min elsewhere.

    The one-step case of :func:`ragged_masks` (one row, no padding). The committed prefix holds
    positions 0 .. past_length-1 in order. With ``sliding_window`` w, a query at position p also
    stops seeing keys at positions <= p - w.
    """
    q = parents.shape[0]
    masks = ragged_masks([parents], [positions], [past_length], {sliding_window}, past_length, q, dtype, device)
    return masks[sliding_window]


def step_masks(
    parents: torch.Tensor,
    positions: torch.Tensor,
    past_length: int,
    windows: set[int | None],
    dtype: torch.dtype,
    device: torch.device | None,
) -> dict[int | None, torch.Tensor | None]:
    """A step's mask per sliding window, as its layers take them: None where it needs none (one query token
    with the whole prefix in view), else :func:`step_mask`'s (1, 1, q, past_length + q)."""
    q = parents.shape[0]
    needed = {w for w in windows if not (q == 1 and (w is None or past_length < w))}
    built = ragged_masks([parents], [positions], [past_length], needed, past_length, q, dtype, device) if needed else {}
    return {w: built.get(w) for w in windows}


def ragged_masks(
    parents: Sequence[torch.Tensor],
    positions: Sequence[torch.Tensor],
    past: Sequence[int],
    windows: set[int | None],
    past_max: int,
    q_max: int,
    dtype: torch.dtype,
    device: torch.device | None,
) -> dict[int | None, torch.Tensor]:
    """Additive masks (B, 1, q_max, past_max + q_max) for B rows, one per sliding window: the one mask builder.

    Row b's query i (i < q_b) may see the row's committed prefix (columns < past[b]) and, among the
    step's columns (past_max onwards), itself and its ancestors (:func:`ancestor_matrix`); a
    sliding window w also hides keys at positions <= p - w. Everything else, padding included, is
    masked. ``parents`` and ``positions`` (each (q_b,)) are host tensors (they came off the wire);
    the masks are built on the host and copied once.
    """
    batch = len(parents)
    lengths = torch.tensor([p.shape[0] for p in parents])  # (B,)
    committed = torch.tensor(list(past))  # (B,)
    tree = torch.zeros(batch, q_max, q_max, dtype=torch.bool)  # (B, q_max, q_max)
    query_pos = torch.zeros(batch, q_max, dtype=torch.long)  # (B, q_max)
    for b, (row_parents, row_positions) in enumerate(zip(parents, positions, strict=True)):
        q = row_parents.shape[0]
        tree[b, :q, :q] = ancestor_matrix(row_parents)
        query_pos[b, :q] = row_positions.to(torch.long)
    real_query = torch.arange(q_max)[None, :] < lengths[:, None]  # (B, q_max)
    prefix = torch.arange(past_max)[None, :] < committed[:, None]  # (B, past_max)
    allowed = torch.cat([prefix[:, None, :].expand(batch, q_max, past_max), tree], dim=2) & real_query[:, :, None]
    allowed = allowed.to(device, non_blocking=True)  # (B, q_max, past_max + q_max)
    query_pos = query_pos.to(device, non_blocking=True)
    # key positions: the prefix's column j holds position j; the step's columns hold the step's positions
    key_pos = torch.cat([torch.arange(past_max, device=device).expand(batch, past_max), query_pos], dim=1)
    floor = torch.finfo(dtype).min
    masks: dict[int | None, torch.Tensor] = {}
    for window in windows:
        seen = allowed if window is None else allowed & (key_pos[:, None, :] > query_pos[:, :, None] - window)
        mask = torch.zeros(batch, 1, q_max, past_max + q_max, dtype=dtype, device=device)
        masks[window] = mask.masked_fill_(~seen[:, None], floor)
    return masks
