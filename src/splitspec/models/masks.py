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

    Query i sees the committed prefix (the past_length positions just before the step's first one, in order:
    0 .. past_length-1 for a model's cache, a window's for a draft head's) and, among the step's
    tokens, itself and its ancestors (:func:`ancestor_matrix`). With ``sliding_window`` w, a query at
    position p also stops seeing keys at positions <= p - w. ``parents`` and ``positions`` (each (q,))
    are host tensors (they came off the wire); the mask is built on the host and copied once.
    """
    return _mask(~ancestor_matrix(parents), positions, past_length, dtype, sliding_window, device)


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
    masks: dict[int | None, torch.Tensor | None] = dict.fromkeys(windows)
    needed = [w for w in windows if not (q == 1 and (w is None or past_length < w))]
    if needed:
        hidden = ~ancestor_matrix(parents)  # (q, q): the step's keys a query does not see
        for w in needed:
            masks[w] = _mask(hidden, positions, past_length, dtype, w, device)
    return masks


def visible_masks(
    visible: torch.Tensor,
    key_positions: torch.Tensor,
    positions: torch.Tensor,
    windows: set[int | None],
    dtype: torch.dtype,
    device: torch.device | None,
) -> dict[int | None, torch.Tensor | None]:
    """A draft tree wave's additive masks (1, 1, q, past + q) per sliding window, on ``device``: query i sees
    the keys ``visible[i]`` marks ((q, past + q) bool), less those a window w hides (keys at ``key_positions``
    (past + q,) <= the query's position (``positions`` (q,)) - w). A tree grown level by level keeps its
    earlier levels in the cache, so what a node sees is not a prefix plus its step's ancestors (:func:`step_masks`)."""
    floor = torch.finfo(dtype).min
    seen = visible.to(device)  # (q, past + q)
    keys = key_positions.to(device, torch.long)  # (past + q,)
    query = positions.to(device, torch.long)  # (q,)
    masks: dict[int | None, torch.Tensor | None] = {}
    for w in windows:
        window = seen if w is None else seen & (keys[None, :] > query[:, None] - w)
        additive = torch.zeros(window.shape, dtype=dtype, device=device)
        masks[w] = additive.masked_fill_(~window, floor)[None, None]
    return masks


def _mask(
    hidden: torch.Tensor,
    positions: torch.Tensor,
    past_length: int,
    dtype: torch.dtype,
    sliding_window: int | None,
    device: torch.device | None,
) -> torch.Tensor:
    """:func:`step_mask` given the step's hidden pairs ``hidden`` (q, q) bool."""
    q = hidden.shape[0]
    floor = torch.finfo(dtype).min
    mask = torch.zeros(q, past_length + q, dtype=dtype)  # (q, past + q)
    mask[:, past_length:].masked_fill_(hidden, floor)
    if sliding_window is not None:
        query_pos = positions.to(torch.long)  # (q,)
        # the prefix's keys sit just before the step's first position: 0 .. past - 1 for a model's cache, from the
        # window's start for an EAGLE head's (it assumed 0 and hid keys in the window once the window moved on)
        first = int(query_pos.min()) - past_length
        key_pos = torch.cat([torch.arange(first, first + past_length), query_pos])  # (past + q,)
        mask.masked_fill_(key_pos[None, :] <= query_pos[:, None] - sliding_window, floor)
    return mask.to(device, non_blocking=True)[None, None]
