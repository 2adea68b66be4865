"""Attention for a batch of sessions' steps, each row over its own session's KV cache.

:func:`~splitspec.models.batched.forward_batch` packs several sessions' query tokens end to end into
one (1, N, H) sequence, so the projections and MLPs run as one product. Attention is the part whose
input differs per row: each row attends over its own committed keys and its step's. Padding every
row's prefix to the longest (and transformers then repeating it per query head) costs two copies of
O(rows x context) per layer and step, growing with the context. Instead a stack's layers attend
through :func:`row_attention`, registered with transformers' ``AttentionInterface``:

* given a :class:`RowAttention` (the batched forward passes one per sliding window), it runs the
  family's own attention function row by row, each row's slice of the queries over views of that
  row's cache and with the mask the row's step would get alone, and packs the outputs back into
  (1, N, heads, d);
* without one (a lone step, a fixed-shape decode, a draft head), it is the family's function
  unchanged.

So soft-capping, sinks and scaling stay the family's, and each row computes what its step computes
alone, with the same shapes. Where the family attends with sdpa, the function run is
:func:`grouped_sdpa`: transformers' sdpa without its per-head copy of the keys on a CPU.

On CUDA, :func:`keep_sdpa_off_cudnn` takes cuDNN out of torch's sdpa backends (every stack on a CUDA
device calls it): cuDNN's attention builds an execution plan for every new query/key shape it sees,
tens to hundreds of milliseconds each, and a split step's shape is new on nearly every step (the
context grows, a speculative step's width and tree mask change).
"""

from __future__ import annotations

import functools
import itertools
import logging
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface, PretrainedConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

log = logging.getLogger(__name__)

ROWS_KWARG = "splitspec_rows"  # the keyword a decoder layer passes through to its attention function
_PREFIX = "splitspec_rows:"  # registered name = prefix + the family's own implementation


class RowKeys:
    """Each row's keys and values for each layer, as its cache returned them: (1, kv, past_b + q_b, d) views."""

    def __init__(self) -> None:
        self.rows: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # layer index -> per row
        self.attended: set[int] = set()  # layers whose attention ran row by row (see forward_batch's check)

    def put(self, layer_idx: int, row: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        per_row = self.rows.setdefault(layer_idx, [])
        if row != len(per_row):
            raise RuntimeError(f"row {row}'s keys of layer {layer_idx} arrived out of order")
        per_row.append((keys, values))


def row_starts(lengths: Sequence[int]) -> list[int]:
    """Where each row's tokens start in a batch's packed sequence (the rows end to end, in order)."""
    return [0, *itertools.accumulate(lengths)][: len(lengths)]


@dataclass(frozen=True)
class RowAttention:
    """What a layer's attention needs to attend row by row: the rows' lengths and starts, their keys and masks."""

    lengths: Sequence[int]  # query tokens per row, packed end to end in the step's sequence
    starts: Sequence[int]  # each row's first token in that sequence (row_starts of lengths, once per batch)
    keys: RowKeys  # filled by the layers' cache updates
    masks: Sequence[torch.Tensor | None]  # per row: additive (1, 1, q_b, past_b + q_b), None = sees all


def row_attention(
    base: Callable[..., tuple[torch.Tensor, torch.Tensor | None]],
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """query (1, heads, N, d), the rows packed -> (1, N, heads, d); ``key``/``value`` are the step's own (ignored
    for rows)."""
    rows: RowAttention | None = kwargs.pop(ROWS_KWARG, None)
    if rows is None:
        return base(module, query, key, value, attention_mask, **kwargs)
    layer_idx = int(module.layer_idx)  # type: ignore[arg-type]  # the attention's own index
    per_row = rows.keys.rows[layer_idx]
    rows.keys.attended.add(layer_idx)
    outs = []
    for b, (start, q) in enumerate(zip(rows.starts, rows.lengths, strict=True)):
        row_keys, row_values = per_row[b]
        row_query = query[:, :, start : start + q]  # (1, heads, q, d)
        out, _ = base(module, row_query, row_keys, row_values, rows.masks[b], **kwargs)  # (1, q, heads, d)
        outs.append(out)
    return torch.cat(outs, 1), None  # (1, N, heads, d)


def _family_eager(module: nn.Module, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The family's own ``eager_attention_forward`` (Gemma 2's soft-caps), found beside its attention class."""
    eager: Callable[..., tuple[torch.Tensor, torch.Tensor | None]] = sys.modules[
        type(module).__module__
    ].eager_attention_forward
    return eager(module, *args, **kwargs)


def grouped_sdpa(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' sdpa attention on a CPU, without its copies and per-call checks: query heads attend to the
    key/value head they share in place. A step of several query tokens (always masked here) lets torch group
    them (``enable_gqa``) where transformers copies every key and value per query head first (``repeat_kv``):
    2-4x faster at 200-1,000 keys. One query token's heads are packed beside their key/value head, as
    transformers does, at a third of its call's overhead. The same result either way.

    query (B, heads, q, d), key/value (B, kv, T, d) -> (B, q, heads, d). An accelerator (whose fast kernels
    want no mask with ``enable_gqa``), an unmasked step of several tokens (causal), soft-capping (which sdpa
    refuses) and a position bias take transformers' function."""
    batch, heads, q, dim = query.shape
    plain = (
        query.device.type == "cpu"
        and (attention_mask is not None or q == 1)
        and kwargs.get("softcap") is None
        and kwargs.get("position_bias") is None
    )
    if not plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    groups = int(getattr(module, "num_key_value_groups", 1))
    options: dict[str, Any] = {"dropout_p": kwargs.get("dropout", 0.0), "scale": kwargs.get("scaling")}
    if q == 1 and groups > 1:
        packed = query.reshape(batch, heads // groups, groups, dim)  # (B, kv, groups, d): head h = kv * groups + g
        out = torch.nn.functional.scaled_dot_product_attention(packed, key, value, attn_mask=attention_mask, **options)
        return out.reshape(batch, 1, heads, dim), None
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, enable_gqa=groups > 1, **options
    )  # (B, heads, q, d)
    return out.transpose(1, 2).contiguous(), None


def keep_sdpa_off_cudnn(devices: Iterable[torch.device]) -> bool:
    """Take cuDNN out of torch's sdpa backends (process-wide) when any of ``devices`` is CUDA; True if it did.

    torch 2.11 ran sdpa through cuDNN's attention on the H200 (its profile shows
    ``aten::_cudnn_attention_forward``; others saw the same on sm_100), and cuDNN builds an execution plan
    for each query/key shape it has not seen: 55-440 ms each as others measured (FunASR issue 3704,
    flashinfer PR 5245). A split step's shape is new on nearly every step: the context grows by the tokens
    accepted, and a speculative step's width and mask vary. On that H200 (2026-12-04) the demo edge
    predicted a 9-token tree step at 540-730 ms however long it ran, against 5-8 ms for a warm draft
    proposal, and ``bench speculative`` accepted one token per step in every mode; this is the likely
    cause, not yet confirmed on a GPU with cuDNN off. Flash and memory-efficient attention take any shape at no
    set-up cost. The results are the same up to floating-point rounding; a torch flag, the choice holds
    for the whole process (every model in it)."""
    if not any(device.type == "cuda" for device in devices) or not torch.backends.cuda.cudnn_sdp_enabled():
        return False
    torch.backends.cuda.enable_cudnn_sdp(False)
    log.info("sdpa: cuDNN attention off for this process (a plan built per new step shape); flash/efficient run")
    return True


def _base_function(name: str) -> Callable[..., tuple[torch.Tensor, torch.Tensor | None]]:
    """The function ``name`` stands for: the family's eager attention, :func:`grouped_sdpa` for sdpa, or
    another that transformers registered."""
    if name == "eager":
        return _family_eager
    if name == "sdpa":
        return grouped_sdpa
    base: Callable[..., tuple[torch.Tensor, torch.Tensor | None]] = ALL_ATTENTION_FUNCTIONS[name]
    return base


def use_row_attention(configs: Sequence[PretrainedConfig]) -> None:
    """Make the attention of layers built with ``configs`` go through :func:`row_attention` (idempotent)."""
    for config in configs:
        current = config._attn_implementation or "sdpa"
        if current.startswith(_PREFIX):
            continue
        name = _PREFIX + current
        if name not in ALL_ATTENTION_FUNCTIONS:
            AttentionInterface.register(name, functools.partial(row_attention, _base_function(current)))
        config._attn_implementation = name


def attention_configs(layers: Iterable[nn.Module]) -> list[PretrainedConfig]:
    """The distinct configs the attention modules of ``layers`` read their implementation from."""
    found: dict[int, PretrainedConfig] = {}
    for layer in layers:
        for module in layer.modules():
            config = getattr(module, "config", None)
            if isinstance(config, PretrainedConfig):
                found[id(config)] = config
    return list(found.values())
