"""Loading the pieces of a split model: each role reads only its own tensors from the checkpoint.

:func:`load_trunk` builds what the untrusted cloud holds (the middle layers, spread over one or more
devices), :func:`load_edge` what the trusted edge holds (embedding, head and tail layers, final norm, LM
head) and :func:`load_full` a whole model on one machine. Each reads its tensors straight onto its
device through transformers' own loader (so the family's renames and fused-expert conversions apply),
quantizing its decoder layers at load when asked; :func:`resolve_dtype` picks the compute dtype.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import convert_and_load_state_dict_in_model
from transformers.modeling_utils import LoadStateDictConfig

from splitspec.devices import spread_layers
from splitspec.exceptions import CheckpointError
from splitspec.models.checkpoint import Checkpoint
from splitspec.models.dtype_choices import AUTO
from splitspec.models.family import Skeleton, published_dtype, skeleton
from splitspec.models.precision import dtype_name, resolve_compute_dtype
from splitspec.models.quantization import dequantized_at_load, plan_quantization, published_method, unused_tensors
from splitspec.models.split import SplitPlan
from splitspec.models.stack import EdgeModel, FullModel, LayerStack

log = logging.getLogger(__name__)

_CPU = torch.device("cpu")


def resolve_dtype(
    ckpt: Checkpoint, name: str, device: torch.device, what: str = "model", quantize: str | None = None
) -> tuple[torch.dtype, str]:
    """The compute dtype and its name (the raw wire codec carries it; protocol.codec's bf16 and int8 carry their
    own): ``name`` when pinned, else (``auto``) the checkpoint's published dtype as
    :func:`~splitspec.models.precision.resolve_compute_dtype` fits it to ``device``; but a quantized role
    (``quantize``, or a checkpoint published quantized) computes under ``auto`` in the published dtype
    whatever the device: its quantized layers are built for it and its unquantized parts load in it, as
    transformers loads them (a half-precision upcast to float32 on a CPU without native half matrix
    instructions applies to plain weights only; both ends resolve alike, so their wire dtypes agree). An FP8
    checkpoint dequantized at load on ``device`` (:func:`~splitspec.models.quantization.dequantized_at_load`)
    has plain weights after its load, and follows the plain rule."""
    published = published_method(ckpt.config)
    keeps_quantized = published is not None and not dequantized_at_load(published, (device,))
    if name == AUTO and (quantize is not None or keeps_quantized):
        dtype = published_dtype(ckpt.config)
        log.info("%s: quantized, computes in the checkpoint's own %s", what, dtype_name(dtype))
    else:
        dtype = resolve_compute_dtype(name, published_dtype(ckpt.config), device, what)
    return dtype, dtype_name(dtype)


def _materialize_buffers(skel: Skeleton, modules: Sequence[nn.Module], device: torch.device) -> None:
    """Non-persistent buffers (rotary frequencies, embedding scales) from the family's own initializer."""
    for root in modules:
        for module in root.modules():
            meta = [n for n, b in module.named_buffers(recurse=False) if b is not None and b.is_meta]
            if not meta:
                continue
            for name in meta:
                module._buffers[name] = torch.empty_like(getattr(module, name), device=device)
            with torch.no_grad():
                skel.lm._init_weights(module)  # loaded parameters carry _is_hf_initialized: untouched


def _module_prefixes(skel: Skeleton, modules: Sequence[nn.Module]) -> tuple[str, ...]:
    """The tensor-name prefix of each module, e.g. "model.layers.3." (the checkpoint's names start with them)."""
    qualified = {id(m): name for name, m in skel.lm.named_modules()}
    return tuple(f"{qualified[id(m)]}." for m in modules)


def trunk_tensor_names(ckpt: Checkpoint, plan: SplitPlan) -> list[str]:
    """The checkpoint's tensors under the trunk layers, sorted: what :func:`load_trunk` reads for its layers."""
    skel = skeleton(ckpt.config, published_dtype(ckpt.config))
    prefixes = _module_prefixes(skel, [skel.layers[i] for i in plan.trunk_layers])
    names = ckpt.tensor_names
    absent = [p.rstrip(".") for p in prefixes if not any(n.startswith(p) for n in names)]
    if absent:
        raise CheckpointError(f"{ckpt.directory} has no tensors for trunk layer(s) {', '.join(absent[:3])}")
    return [n for n in names if n.startswith(prefixes)]


def _load_modules(
    ckpt: Checkpoint, skel: Skeleton, modules: Sequence[nn.Module], dtype: torch.dtype, device: torch.device
) -> None:
    """Read exactly the tensors of ``modules`` onto ``device`` and load them through transformers' own converters.

    Each tensor is read when it is converted, straight onto ``device`` (a one-device ``device_map``:
    without one, transformers' loader would move every tensor to the host first), and quantized
    there by the skeleton's quantizer when it has one."""
    prefixes = _module_prefixes(skel, modules)
    lm = skel.lm
    quantizer = skel.quantizer
    planned = _planned_dtypes(modules)
    conversions: list[Any] = get_model_conversion_mapping(lm, None, quantizer)  # renames, fusions, dequantizers
    load_config = LoadStateDictConfig(
        dtype=dtype,
        dtype_plan=lm._get_dtype_plan(dtype),
        weight_mapping=conversions,
        device_map={"": str(device)},
        hf_quantizer=quantizer,
    )
    # quantizing on the host: one module at a time, and the heap its temporaries freed handed back
    # after each, so the load's peak is what it keeps plus one layer's temporaries
    on_host = quantizer is not None and device.type == "cpu"
    groups = [(p,) for p in prefixes] if on_host else [prefixes]
    problems: list[str] = []
    unused = unused_tensors(quantizer, ckpt.tensor_names)
    for group in groups:
        names = [n for n in ckpt.tensor_names if n.startswith(group) and n not in unused]
        with ckpt.open_slices(names, device, pread=on_host) as state:
            info, _ = convert_and_load_state_dict_in_model(lm, state, load_config)
        # what transformers' own load forgives: the family's ignore patterns, and old checkpoints' per-layer
        # rotary_emb.inv_freq buffers (Llama-2 era conversions)
        lm._adjust_missing_and_unexpected_keys(info)
        if on_host:
            _return_freed_host_memory()
        problems += [
            *(f"unexpected tensor {k}" for k in sorted(info.unexpected_keys)),
            *(f"{k} has shape {tuple(got)}, expected {tuple(want)}" for k, got, want in sorted(info.mismatched_keys)),
            *(f"{k}: {str(v).splitlines()[-1]}" for k, v in info.conversion_errors.items()),
            *info.error_msgs,
        ]
    for prefix, module in zip(prefixes, modules, strict=True):
        problems += [f"{prefix}{n} is missing" for n, p in module.named_parameters() if p.is_meta]
    if problems:
        raise CheckpointError(f"{ckpt.directory} does not match its config: {'; '.join(problems[:5])}")
    _cast_to_planned(planned)
    for module in modules:
        module.requires_grad_(False)
    _materialize_buffers(skel, modules, device)
    for module in modules:
        module.to(device)  # a no-op when the converters kept the tensors where they were read


_FLOATS = (torch.float32, torch.float16, torch.bfloat16)  # the compute dtypes (float8 weights stay as loaded)


def _planned_dtypes(modules: Sequence[nn.Module]) -> dict[tuple[nn.Module, str], torch.dtype]:
    """Each floating parameter's dtype in the skeleton (the compute dtype, or float32 where the family keeps one)."""
    return {
        (owner, name): param.dtype
        for root in modules
        for owner in root.modules()
        for name, param in owner.named_parameters(recurse=False)
        if param.dtype in _FLOATS
    }


def _cast_to_planned(planned: dict[tuple[nn.Module, str], torch.dtype]) -> None:
    """Give every loaded floating parameter its skeleton's dtype back.

    transformers' dequantizing fp8 load leaves the tensors its weight converter passes through (norms,
    embedding, LM head) in the checkpoint's dtype: a bfloat16 checkpoint loaded in float32 had float32
    projections beside bfloat16 norms, and its first forward failed on the dtype mismatch (``from_pretrained``
    itself fails the same way)."""
    for (owner, name), dtype in planned.items():
        param = owner._parameters.get(name)
        if type(param) is nn.Parameter and param.dtype in _FLOATS and param.dtype != dtype:
            owner._parameters[name] = nn.Parameter(param.data.to(dtype), requires_grad=param.requires_grad)


def _quantized_skeleton(
    ckpt: Checkpoint,
    dtype: torch.dtype,
    attn_implementation: str | None,
    quantize: str | None,
    devices: Sequence[torch.device],
) -> Skeleton:
    """The skeleton a role loads into: converted for its quantization (``--quantize`` or as published), if any."""
    quantization, config = plan_quantization(ckpt.config, quantize, dtype, devices)
    if quantization is None:
        return skeleton(ckpt.config, dtype, attn_implementation)
    skel = skeleton(config, dtype, attn_implementation, quantization.quantizer)
    log.info("weights quantized: %s%s", quantization.method, " (as published)" if quantization.pre_quantized else "")
    return skel


def _finish(skel: Skeleton) -> None:
    """The quantizer's ``postprocess_model``, once every piece of the role is loaded."""
    if skel.quantizer is not None:
        skel.quantizer.postprocess_model(skel.lm)


def _return_freed_host_memory() -> None:
    """Give the OS back the heap pages a quantizing load freed (glibc's ``malloc_trim``).

    Each tensor quantized on the host was read into a buffer of its own (tens of MB, under glibc's
    mmap threshold once the first one is freed), so glibc keeps the freed pages in its heap: an NF4
    trunk's RSS stayed 8x its weights. Not glibc (macOS, musl): no such call, nothing to return."""
    name = ctypes.util.find_library("c")
    trim = getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    if trim is None:
        log.debug("no malloc_trim in this C library: freed host memory stays with the allocator")
        return
    trim(0)


def _ends_modules(ckpt: Checkpoint, skel: Skeleton) -> list[nn.Module]:
    """Embedding, final norm, rotary and LM head; the LM head is the embedding when tied."""
    modules = [skel.embed, skel.norm, skel.rotary]
    if ckpt.has("lm_head.weight"):
        return [*modules, skel.lm_head]
    if not getattr(skel.config, "tie_word_embeddings", False):
        raise CheckpointError(f"{ckpt.directory} has no lm_head.weight and does not tie embeddings")
    return modules


def _tie(skel: Skeleton) -> None:
    if skel.lm_head.weight.is_meta:
        skel.lm_head.weight = skel.embed.weight


def _load_ends_and_layers(
    ckpt: Checkpoint,
    layer_ids: Sequence[int] | None,
    dtype: torch.dtype | None,
    attn_implementation: str | None,
    device: torch.device,
    quantize: str | None,
) -> Skeleton:
    """A skeleton with the embedding, final norm, LM head and the given decoder layers (all when None) on ``device``."""
    dtype = published_dtype(ckpt.config) if dtype is None else dtype
    skel = _quantized_skeleton(ckpt, dtype, attn_implementation, quantize, (device,))
    layers = list(skel.layers) if layer_ids is None else [skel.layers[i] for i in layer_ids]
    _load_modules(ckpt, skel, [*_ends_modules(ckpt, skel), *layers], dtype, device)
    _tie(skel)
    _finish(skel)
    return skel


def load_trunk(
    ckpt: Checkpoint,
    plan: SplitPlan,
    dtype: torch.dtype | None = None,
    attn_implementation: str | None = None,
    devices: Sequence[torch.device] = (_CPU,),
    quantize: str | None = None,
) -> LayerStack:
    """The cloud's piece: only the trunk layers' tensors are read, each straight onto its device.

    Several ``devices`` split the trunk's layer range into contiguous runs, one per device.
    ``quantize`` ("nf4", "int8") quantizes them at load (see :mod:`splitspec.models.quantization`).
    """
    dtype = published_dtype(ckpt.config) if dtype is None else dtype
    placed = spread_layers(plan.trunk_layers, devices)
    skel = _quantized_skeleton(ckpt, dtype, attn_implementation, quantize, list(dict.fromkeys(placed)))
    for device in dict.fromkeys(placed):
        layers = [skel.layers[i] for i, d in zip(plan.trunk_layers, placed, strict=True) if d == device]
        extra = [skel.rotary] if device == placed[0] else []
        _load_modules(ckpt, skel, [*layers, *extra], dtype, device)
    _finish(skel)
    log.info(
        "trunk layers %d..%d loaded (%d tensors read, %s) on %s",
        plan.trunk_layers.start,
        plan.trunk_layers.stop - 1,
        len(ckpt.read_names),
        dtype,
        ", ".join(f"{d}: {placed.count(d)} layers" for d in dict.fromkeys(placed)),
    )
    return LayerStack(skel, plan.trunk_layers).eval()


def load_edge(
    ckpt: Checkpoint,
    plan: SplitPlan,
    dtype: torch.dtype | None = None,
    attn_implementation: str | None = None,
    device: torch.device = _CPU,
    quantize: str | None = None,
) -> EdgeModel:
    """The edge's piece on ``device``: embedding, head and tail layers, final norm, LM head. No trunk tensor is read.

    ``quantize`` quantizes its decoder layers at load (the embedding and LM head stay as stored)."""
    layer_ids = (*plan.head_layers, *plan.tail_layers)
    skel = _load_ends_and_layers(ckpt, layer_ids, dtype, attn_implementation, device, quantize)
    return EdgeModel(skel, plan).eval()


def load_full(
    ckpt: Checkpoint,
    dtype: torch.dtype | None = None,
    attn_implementation: str | None = None,
    device: torch.device = _CPU,
    quantize: str | None = None,
) -> FullModel:
    """Every piece of a checkpoint on ``device``, for running it whole on one machine."""
    skel = _load_ends_and_layers(ckpt, None, dtype, attn_implementation, device, quantize)
    return FullModel(skel).eval()
