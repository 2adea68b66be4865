"""Attention masks for one step of query tokens, rebuilt from compact parent indices.

A step carries q query tokens; token i has parent ``parents[i]`` (an earlier token of the step,
or -1 for the committed prefix). Token i may attend to the whole committed prefix, to its
ancestors within the step, and to itself: never to a sibling branch, never to a later token.
We always pass this explicit mask: relying on ``is_causal=True`` with a populated cache lets
drafted tokens see what they must not, silently.
"""

from __future__ import annotations

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
    out: list[int] = []
    for p in parents.tolist():
        out.append(0 if p < 0 else out[p] + 1)
    return torch.tensor(out, dtype=torch.long)


def step_mask(
    parents: torch.Tensor,
    positions: torch.Tensor,
    past_length: int,
    dtype: torch.dtype,
    sliding_window: int | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Additive mask (1, 1, q, past_length + q) on ``device``: 0 where attention is allowed, dtype-min elsewhere.

    The committed prefix holds positions 0 .. past_length-1 in order. With ``sliding_window`` w,
    a query at position p also stops seeing keys at positions <= p - w. ``parents`` and
    ``positions`` are host tensors (they came off the wire); the tree part is built on the host
    (q x q) and copied once, the rest is built on ``device``.
    """
    q = parents.shape[0]
    tree = ancestor_matrix(parents).to(device, non_blocking=True)  # (q, q)
    allowed = torch.cat([torch.ones(q, past_length, dtype=torch.bool, device=device), tree], dim=1)
    if sliding_window is not None:
        query_positions = positions.to(device, torch.long, non_blocking=True)  # (q,)
        key_positions = torch.cat([torch.arange(past_length, device=device), query_positions])  # (past+q,)
        allowed &= key_positions[None, :] > query_positions[:, None] - sliding_window
    mask = torch.zeros(q, past_length + q, dtype=dtype, device=device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]
