"""Warm-up: run every step width once at load, so that nothing measures a cold start.

On a GPU the first call of each kernel shape pays lazy kernel loading, cuBLAS set-up and
algorithm choice. On an H200 (``benchmarks/results/gpu/h200-2026-12-04/``, 2026-12-04),
after the demo's first steps the edge's speculation controller predicted a 3-token step at 498 ms
and a 9-token one at 1,315 ms, and the draft model's first proposal took 821 ms, against 5-8 ms
once warm. The controller takes such times for what steps and drafts cost: it judged drafting too
dear and, a 16-token answer never re-probing it, drafted nothing afterwards (``--speculate draft``
accepted 1.00 token per step on the GPU, 2-3 on a CPU). So the trunk server and the edge runtime
run their layers once at each width a step can have, after a short context, on a scratch cache,
before the first request; the draft model's and the draft head's proposals are warmed the same way
(:func:`splitspec.decoding.drafters.warm_up_draft_model`, :func:`splitspec.decoding.eagle.warm_up_draft_head`).
``benchmarks/draft_cold_start.py`` measures what the drafters do after a start.

Measured on the H200 after this warm-up (``benchmarks/results/gpu/h200-2026-12-04b/``): the draft model then
drafted on 6-7 of 8 steps of every answer (0-1 before), but each fresh engine's first proposals still took
110-160 ms and 9-token steps stayed predicted at 540-730 ms; the likely rest of the cause is cuDNN's attention
plan per new shape, which the warm-up's shapes cannot cover and which
:func:`splitspec.models.row_attention.keep_sdpa_off_cudnn` takes away.

A CPU has no such cold start: on this project's 2-core machine the demo edge's first warm-up took
83 ms and its fourth 70 ms (the trunk's 45 and 46 ms, the draft model's 18 and 16 ms), so there
the warm-up would only delay every start, and only an accelerator's is warmed (:func:`pays_cold_start`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

import torch

from splitspec.devices import synchronize
from splitspec.models.kv_cache import KVCache
from splitspec.models.masks import chain, step_positions
from splitspec.models.stack import EdgeModel, LayerStack

# query tokens of the warm-up steps: one token (a greedy step), and one plus each of the speculation
# controller's budgets (decoding.controller.DEFAULT_BUDGETS: a step carries its token and the draft)
WARM_UP_WIDTHS = (1, 2, 3, 4, 5, 7, 9, 13, 17)
WARM_UP_CONTEXT = 8  # tokens before the warm-up steps: each step attends to a past, as a decode step does


def pays_cold_start(devices: Iterable[torch.device]) -> bool:
    """Whether layers on ``devices`` should be warmed up: any of them an accelerator (not the CPU)."""
    return any(device.type != "cpu" for device in devices)


def tree_parents(width: int) -> list[int]:
    """Parents of a ``width``-node binary draft tree (node i's is (i - 1) // 2; the root's -1, the committed
    context): its steps take the tree-mask path a draft tree's do, not a chain's."""
    return [-1] + [(i - 1) // 2 for i in range(1, width)]


def _step(past: int, parents: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A step's positions and parents (q,) int32 after ``past`` committed tokens."""
    positions = step_positions(past, parents)
    return torch.tensor(positions, dtype=torch.int32), torch.tensor(parents, dtype=torch.int32)


@torch.inference_mode()
def warm_up_stack(stack: LayerStack, dtype: torch.dtype, widths: Sequence[int] = WARM_UP_WIDTHS) -> float:
    """Run ``stack`` on a scratch cache: a :data:`WARM_UP_CONTEXT`-token prefill, then a draft-tree step of each
    width (committed, so each step has a longer past). Returns the seconds it took."""
    t0 = time.perf_counter()
    if len(stack.layers):
        cache = KVCache()
        device = stack.input_device
        hidden = torch.zeros(1, WARM_UP_CONTEXT, stack.hidden_size, dtype=dtype, device=device)  # (1, C, H)
        stack(hidden, *_step(0, chain(WARM_UP_CONTEXT)), cache)
        for width in widths:
            step = torch.zeros(1, width, stack.hidden_size, dtype=dtype, device=device)  # (1, q, H)
            stack(step, *_step(len(cache), tree_parents(width)), cache)
        synchronize(stack.output_device)
    return time.perf_counter() - t0


@torch.inference_mode()
def warm_up_edge(model: EdgeModel, widths: Sequence[int] = WARM_UP_WIDTHS) -> float:
    """:func:`warm_up_stack` for the edge: the embedding, the head layers, the tail layers and the LM head, each
    width's step through all of them. Returns the seconds it took."""
    t0 = time.perf_counter()
    head, tail = KVCache(), KVCache()
    device = model.device
    ids = torch.zeros(WARM_UP_CONTEXT, dtype=torch.long, device=device)  # (C,)
    context_positions, context_parents = _step(0, chain(WARM_UP_CONTEXT))
    model.run_tail(
        model.run_head(ids, context_positions, context_parents, head), context_positions, context_parents, tail
    )
    for width in widths:
        positions, parents = _step(len(head), tree_parents(width))
        hidden = model.run_head(torch.zeros(width, dtype=torch.long, device=device), positions, parents, head)
        model.run_tail(hidden, positions, parents, tail)  # (q, V)
    synchronize(device)
    return time.perf_counter() - t0
