"""Linear layers with their weights prepacked for oneDNN: a faster CPU trunk.

PyTorch's CPU ``nn.Linear`` calls MKL's sgemm, which repacks the weight matrix on every call. For
the few rows of a decode batch that repacking dominates: on a 2-core AMD EPYC, a (16 x 1024) x
(1024 x 2816) float32 product took 1.86 ms through ``F.linear`` and 0.72 ms through oneDNN with the
weight reordered once, at load, into oneDNN's blocked layout (2.6x; 1.7x for one row, 1.5x for
256). This is what ``torch.compile``'s CPU freezing and Intel's extension do to linear layers;
here the trunk's ``nn.Linear`` modules are swapped for :class:`PackedLinear` once, after loading.

The results differ from MKL's in the last bits (about 1e-7 relative), as any other kernel's would.
A packed module serves inference only: its weight is an opaque oneDNN tensor, with no gradient,
``state_dict`` entry or device move.

oneDNN builds and keeps kernels for every row count it is called with, and never frees them:
measured with torch 2.13 (oneDNN 3.12), about 1 MB of resident memory per new row count for a
(256 x 576) weight, with oneDNN's primitive cache on or off. A server's row counts are ragged
(sequences x their query tokens), so a gateway grew by about 10 MB at every trunk restart (the
replays make new counts) and would grow until it had seen them all. The rows are therefore padded
to one of a few sizes (:func:`row_bucket`): exact up to 16, then 8 sizes per doubling, at most
12.5 % padding. Padded rows are zeros; their outputs are dropped.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch
from torch import nn

BATCH_HINT = 16  # rows the weight layout is chosen for: a decode batch (1-64 rows measured within 1.2x of best)
EXACT_ROWS = 16  # row counts up to this run as they are; above it they are padded to a bucket
PROBE_ROWS = (1, 4, 16)  # row counts at which where_faster times a linear both ways: decode, speculation, a batch
PROBE_CALLS = 15  # timed calls per way and row count (interleaved; their median counts)
BUCKETS_PER_DOUBLING = 8  # sizes per doubling of the row count above EXACT_ROWS: at most 1/8 padding


def row_bucket(rows: int) -> int:
    """The row count ``rows`` is padded to: itself up to 16, then the next multiple of 1/8 of the
    power of two below it (17 -> 18, 100 -> 104, 129 -> 144), so ``n`` rows make O(log n) shapes."""
    if rows <= EXACT_ROWS:
        return rows
    step = max(1, (1 << (rows.bit_length() - 1)) // BUCKETS_PER_DOUBLING)
    return -(-rows // step) * step


def prepack_available() -> bool:
    """True when this torch build has oneDNN and the packed-linear operators."""
    ops = torch.ops.mkldnn
    return bool(torch.backends.mkldnn.is_available()) and all(
        hasattr(ops, name) for name in ("_reorder_linear_weight", "_linear_pointwise")
    )


def prepack_obstacle(piece: str, on_cpu: bool, dtype: torch.dtype, quantized: bool, compiled: bool) -> str | None:
    """Why ``piece``'s ("trunk", "edge") linear layers cannot be prepacked; None when they can."""
    if not on_cpu:
        return f"it applies to a {piece} wholly on the CPU"
    if dtype != torch.float32:
        return f"it applies to float32 weights, the {piece} computes in {dtype}"
    if quantized:
        return f"it applies to float32 weights, the {piece}'s are quantized"
    if compiled:
        return "--compile builds its own kernels"
    if not prepack_available():
        return "this torch build lacks oneDNN's packed-linear operators"
    return None


class PackedLinear(nn.Module):
    """``y = x W^T + b`` for x (..., in_features), with W reordered once for oneDNN."""

    def __init__(self, linear: nn.Linear, batch_hint: int = BATCH_HINT) -> None:
        super().__init__()
        weight = linear.weight.detach()  # (out_features, in_features)
        if weight.device.type != "cpu" or weight.dtype != torch.float32:
            raise ValueError(f"only float32 CPU weights are prepacked, got {weight.dtype} on {weight.device}")
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.packed: torch.Tensor  # (out_features, in_features) in oneDNN's opaque blocked layout
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint), persistent=False)
        bias = None if linear.bias is None else linear.bias.detach().clone()  # (out_features,)
        self.bias: torch.Tensor | None
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.numel() // self.in_features  # rows
        padded = row_bucket(n)
        if padded == n:
            out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
            return out  # (..., out_features)
        rows = torch.cat([x.reshape(n, self.in_features), x.new_zeros(padded - n, self.in_features)])  # (padded, in)
        out = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")
        return out[:n].reshape(*x.shape[:-1], self.out_features)  # (..., out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def prepack_linears(*modules: nn.Module, batch_hint: int = BATCH_HINT, where_faster: bool = False) -> int:
    """Swap every ``nn.Linear`` inside ``modules`` for a :class:`PackedLinear`; return how many.

    ``where_faster``: only the linears whose shape (in, out, bias) :func:`packed_is_faster` finds faster on
    this CPU, measured once per shape across all of ``modules`` (an edge's head and tail share their
    shapes). The oneDNN call costs more than MKL's for a small weight: on an Intel Xeon, a (3 x 256) x
    (256 x 256) product took 31 us packed against 12 us through ``F.linear``, while the (16 x 1024) x
    (1024 x 2816) products of a real trunk run 2.6x faster packed (docs/trunk-batching.md).
    """
    decided: dict[tuple[int, int, bool], bool] = {}

    def swap(parent: nn.Module) -> int:
        swapped = 0
        for name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear):
                swapped += swap(child)
                continue
            shape = (child.in_features, child.out_features, child.bias is not None)
            if where_faster and shape not in decided:
                decided[shape] = packed_is_faster(child, batch_hint)
            if not where_faster or decided[shape]:
                setattr(parent, name, PackedLinear(child, batch_hint))
                swapped += 1
        return swapped

    return sum(swap(module) for module in modules)


def packed_is_faster(linear: nn.Linear, batch_hint: int = BATCH_HINT) -> bool:
    """Whether ``linear`` computes faster prepacked than through MKL on this CPU, at the row counts of
    :data:`PROBE_ROWS` (summed medians of :data:`PROBE_CALLS` interleaved calls each)."""
    packed = PackedLinear(linear, batch_hint)
    return fastest([linear, packed], linear.in_features) == 1


def fastest(
    modules: Sequence[nn.Module], in_features: int, rows: Sequence[int] = PROBE_ROWS, calls: int = PROBE_CALLS
) -> int:
    """The index of the module of ``modules`` (each (..., in_features) -> (..., out)) whose summed median time
    over ``rows`` row counts is least: the calls alternate between them, after one warm-up call each."""
    seconds = [0.0] * len(modules)
    with torch.inference_mode():
        for n in rows:
            x = torch.randn(1, n, in_features)  # (1, n, in)
            times: list[list[float]] = [[] for _ in modules]
            for module in modules:
                module(x)  # warm-up: oneDNN builds its kernel for this row count
            for _ in range(calls):
                for i, module in enumerate(modules):
                    t0 = time.perf_counter()
                    module(x)
                    times[i].append(time.perf_counter() - t0)
            for i, measured in enumerate(times):
                seconds[i] += statistics.median(measured)
    return min(range(len(modules)), key=seconds.__getitem__)
