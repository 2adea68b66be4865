"""Runnable pieces of a split model, taken from the family's own transformers model.

* :class:`LayerStack` runs a contiguous range of decoder layers over one step of query tokens,
  computing rotary embeddings from position ids (per layer type where the family has several)
  and the attention mask from parent indices (with each layer's sliding window).
* :class:`EdgeModel` is what the trusted edge holds: embedding, head layers, tail layers, final
  norm and LM head. :func:`load_trunk` builds what the untrusted cloud holds: the middle layers.
* :class:`FullModel` is a whole model on one machine (drafting, federated workers, baselines,
  privacy audits): the one way this package runs a whole model.

Each piece lives on a device (``device=`` of the loaders; a trunk may spread its layers over
several): its tensors are read straight onto it, and a step's rotary table, position ids and
masks are built there. Token ids, positions and parents come in as host tensors.

Every piece is a module of :func:`splitspec.models.family.skeleton` (the family's ``*ForCausalLM``
on the meta device); each role reads only its own tensors from the checkpoint, through
transformers' own loader (so its renames and fused-expert conversions apply).
"""

from __future__ import annotations

import copy
import ctypes
import ctypes.util
import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import convert_and_load_state_dict_in_model
from transformers.modeling_utils import LoadStateDictConfig

from splitspec.devices import spread_layers
from splitspec.exceptions import CheckpointError
from splitspec.models.checkpoint import Checkpoint
from splitspec.models.family import Skeleton, published_dtype, skeleton
from splitspec.models.fixed_decode import FixedShapeDecode
from splitspec.models.kv_cache import KVCache
from splitspec.models.masks import step_masks
from splitspec.models.precision import AUTO, dtype_name, resolve_compute_dtype
from splitspec.models.quantization import plan_quantization, published_method
from splitspec.models.row_attention import (
    ROWS_KWARG,
    RowAttention,
    attention_configs,
    keep_sdpa_off_cudnn,
    use_row_attention,
)
from splitspec.models.split import SplitPlan
from splitspec.models.static_kv import StaticKVCache

log = logging.getLogger(__name__)

PositionEmbeddings = tuple[torch.Tensor, torch.Tensor]  # (cos, sin), each (1, q, head_dim)
_CPU = torch.device("cpu")


def module_device(module: nn.Module) -> torch.device:
    """Where a loaded module's parameters live."""
    return next(module.parameters()).device


class LayerStack(nn.Module):
    """Decoder layers ``layer_indices`` of a model, run over one step with an explicit tree mask.

    The layers may sit on several devices (contiguous runs: a trunk bigger than one accelerator);
    the hidden state moves at each device boundary, and each device gets its own rotary module,
    position ids and masks for the step.
    """

    def __init__(self, skel: Skeleton, layer_indices: range) -> None:
        super().__init__()
        self.layer_indices = layer_indices
        self.layers = nn.ModuleList([skel.layers[i] for i in layer_indices])
        self.devices = [module_device(layer) for layer in self.layers]  # one per layer
        self.rotary = skel.rotary
        rotary_device = next((b.device for b in skel.rotary.buffers()), _CPU)
        self._rotary_on = {  # the skeleton's rotary where it was loaded, a copy on every other device
            d: skel.rotary if d == rotary_device else copy.deepcopy(skel.rotary).to(d)
            for d in (rotary_device, *self.devices)
        }
        self.rotary_per_layer_type = skel.rotary_per_layer_type
        self.layer_types = [skel.layer_type(i) for i in layer_indices]
        self.windows = [skel.layer_window(i) for i in layer_indices]
        self._skeleton = skel
        self.hidden_size = int(skel.config.hidden_size)
        self.fixed_decode: FixedShapeDecode | None = None  # see enable_fixed_decode
        use_row_attention(attention_configs(self.layers))  # batched steps attend row by row (run_layer)
        keep_sdpa_off_cudnn(self.devices)  # no cuDNN plan build per new step shape on CUDA

    def enable_fixed_decode(self, compile_mode: str | None = None, backend: str = "inductor") -> FixedShapeDecode:
        """Run one-token steps on a :class:`StaticKVCache` through the fixed-shape decode step,
        compiled with ``compile_mode`` (see :mod:`splitspec.models.fixed_decode`) or eager when None."""
        self.fixed_decode = FixedShapeDecode(self, compile_mode, backend)
        return self.fixed_decode

    def first(self, count: int) -> LayerStack:
        """A stack of this stack's first ``count`` layers (same modules, no copy)."""
        start = self.layer_indices.start
        return LayerStack(self._skeleton, range(start, start + count)).eval()

    @property
    def input_device(self) -> torch.device:
        """Where a step's input hidden state goes."""
        return self.devices[0] if self.devices else _CPU

    @property
    def output_device(self) -> torch.device:
        """Where a step's output hidden state comes out."""
        return self.devices[-1] if self.devices else _CPU

    def position_embeddings(self, hidden: torch.Tensor, pos: torch.Tensor) -> dict[str, PositionEmbeddings]:
        """(cos, sin) per layer type for positions ``pos`` (1, q), on ``hidden``'s device."""
        rotary = self._rotary_on[hidden.device]
        if self.rotary_per_layer_type:
            return {t: rotary(hidden, pos, t) for t in set(self.layer_types)}
        shared = rotary(hidden, pos)
        return {t: shared for t in set(self.layer_types)}

    def _step_inputs(
        self, hidden: torch.Tensor, positions: torch.Tensor, parents: torch.Tensor, past: int
    ) -> tuple[torch.Tensor, dict[str, PositionEmbeddings], dict[int | None, torch.Tensor | None]]:
        """Position ids (1, q), (cos, sin) per layer type and the mask per window, on ``hidden``'s device."""
        device = hidden.device
        pos = positions.to(device, torch.long, non_blocking=True)[None]  # (1, q)
        masks = step_masks(parents, positions, past, set(self.windows), hidden.dtype, device)
        return pos, self.position_embeddings(hidden, pos), masks

    def run(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        parents: torch.Tensor,
        cache: KVCache | None,
        layers: Iterable[int] | None = None,
    ) -> list[torch.Tensor]:
        """hidden (B, q, H) through the local ``layers`` (default all) -> one (B, q, H) output per layer.

        Gradients flow when the caller enables them (privacy audits train through this); the
        cache, when given, receives q entries per layer but is not committed here.
        """
        past = 0 if cache is None else len(cache)
        inputs: dict[torch.device, tuple[torch.Tensor, dict[str, PositionEmbeddings], dict[Any, Any]]] = {}
        outs: list[torch.Tensor] = []
        for j in range(len(self.layers)) if layers is None else layers:
            hidden = hidden.to(self.devices[j], non_blocking=True)  # moves only at a device boundary
            if hidden.device not in inputs:
                inputs[hidden.device] = self._step_inputs(hidden, positions, parents, past)
            pos, rope, masks = inputs[hidden.device]
            hidden = self.run_layer(j, hidden, pos, rope, masks, cache)
            outs.append(hidden)
        return outs

    def run_committed(
        self, hidden: torch.Tensor, positions: torch.Tensor, parents: torch.Tensor, cache: KVCache | None
    ) -> list[torch.Tensor]:
        """:meth:`run` over every layer as one step of ``cache``: its q entries are committed, or rolled back
        when the step fails (None: no cache, as in training) -> one (B, q, H) output per layer."""
        try:
            outs = self.run(hidden, positions, parents, cache)
        except BaseException:
            if cache is not None:
                cache.rollback()
            raise
        if cache is not None:
            cache.commit()
        return outs

    def run_layer(
        self,
        j: int,
        hidden: torch.Tensor,
        pos: torch.Tensor,
        rope: Mapping[str, PositionEmbeddings],
        masks: Mapping[Any, torch.Tensor | None],
        cache: Any,
        rows: Mapping[Any, RowAttention] | None = None,
    ) -> torch.Tensor:
        """hidden (B, q, H) through local layer ``j`` with its window's mask and its type's rotary:
        the one place a decoder layer is called (per-session, batched and fixed-shape steps).
        ``rows``: a batch of sessions' steps attends row by row, with each row's mask for the window."""
        extra = {} if rows is None else {ROWS_KWARG: rows[self.windows[j]]}
        out: torch.Tensor = self.layers[j](
            hidden,
            attention_mask=masks[self.windows[j]],
            position_ids=pos,
            past_key_values=cache,
            position_embeddings=rope[self.layer_types[j]],
            **extra,
        )
        return out

    @torch.inference_mode()
    def forward(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        parents: torch.Tensor,
        cache: KVCache,
        capture: int | None = None,
    ) -> torch.Tensor:
        """hidden (1, q, H), positions (q,), parents (q,) -> hidden (1, q, H); appends q entries to cache.

        ``capture``: a local layer whose output is wanted too (a draft head's feature from the middle of
        the model); the result is then (1, q, 2H), the stack's output followed by that layer's."""
        if not len(self.layers):
            return hidden
        fixed = self.fixed_decode
        try:
            if (
                capture is None
                and fixed is not None
                and isinstance(cache, StaticKVCache)
                and fixed.applies(hidden, cache)
            ):
                hidden = fixed(hidden, positions, cache)
            else:
                outs = self.run(hidden, positions, parents, cache)
                hidden = outs[-1] if capture is None else torch.cat([outs[-1], outs[capture].to(outs[-1].device)], -1)
        except BaseException:
            cache.rollback()
            raise
        cache.commit()
        return hidden

    @torch.inference_mode()
    def forward_visible(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        visible: torch.Tensor,
        key_positions: torch.Tensor,
        cache: KVCache,
    ) -> torch.Tensor:
        """hidden (1, q, H) at ``positions`` (q,) -> hidden (1, q, H), where query i sees exactly the keys
        ``visible[i]`` marks (q, len(cache) + q) bool, less those a layer's sliding window hides (keys at
        ``key_positions`` (len(cache) + q,) <= position - window): a draft tree grown level by level keeps its
        earlier levels in the cache, and a node sees its own ancestors only. Appends q entries to the cache."""
        if not len(self.layers):
            return hidden
        floor = torch.finfo(hidden.dtype).min
        inputs: dict[torch.device, tuple[torch.Tensor, dict[str, PositionEmbeddings], dict[Any, torch.Tensor]]] = {}
        try:
            for j in range(len(self.layers)):
                hidden = hidden.to(self.devices[j], non_blocking=True)  # moves only at a device boundary
                device = hidden.device
                if device not in inputs:
                    pos = positions.to(device, torch.long)[None]  # (1, q)
                    seen, keys = visible.to(device), key_positions.to(device, torch.long)
                    masks: dict[Any, torch.Tensor] = {}
                    for w in set(self.windows):
                        window = seen if w is None else seen & (keys[None, :] > pos[0, :, None] - w)
                        additive = torch.zeros(window.shape, dtype=hidden.dtype, device=device)
                        masks[w] = additive.masked_fill_(~window, floor)[None, None]  # (1, 1, q, past + q)
                    inputs[device] = (pos, self.position_embeddings(hidden, pos), masks)
                pos, rope, masks = inputs[device]
                hidden = self.run_layer(j, hidden, pos, rope, masks, cache)
        except BaseException:
            cache.rollback()
            raise
        cache.commit()
        return hidden


class ModelEnds(nn.Module):
    """Embedding, final norm and LM head, with the family's scaling and soft-capping."""

    def __init__(self, skel: Skeleton) -> None:
        super().__init__()
        self.config: PretrainedConfig = skel.config
        self.embed_tokens = skel.embed
        self.norm = skel.norm
        self.lm_head: nn.Module = skel.lm_head  # an nn.Linear, or its prepacked form (models/prepack.py)
        self._skeleton = skel

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype  # the embedding: the LM head may be a prepacked module

    @property
    def device(self) -> torch.device:
        """Where this piece computes, and where its logits are returned."""
        return self.embed_tokens.weight.device

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token ids (B, q) -> the stream before layer 0 (B, q, H)."""
        hidden: torch.Tensor = self.embed_tokens(token_ids.to(self.device, torch.long, non_blocking=True))
        if self._skeleton.embedding_multiplier is not None:
            hidden = hidden * self._skeleton.embedding_multiplier
        return hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The stream after the last layer (B, q, H) -> logits (B, q, V) in float32."""
        logits: torch.Tensor = self.lm_head(self.norm(hidden))
        return self._skeleton.finish_logits(logits).float()

    def row_logits(self, streams: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Several rows' streams (1, n_b, H) -> each row's logits (1, n_b, V) float32, through one LM-head product:
        its weight is read once per batch, not once per row (the demo's 256 x 8192 head over 8 rows of 2
        positions: 6.7 ms row by row, 1.2 ms at once on this project's 2-core CPU)."""
        if len(streams) == 1:
            return [self.logits(streams[0])]
        joined = self.logits(torch.cat(list(streams), dim=1))  # (1, sum n_b, V)
        return list(joined.split([s.shape[1] for s in streams], dim=1))


class EdgeModel(ModelEnds):
    """The edge's pieces: embedding, head layers, tail layers, final norm, LM head."""

    def __init__(self, skel: Skeleton, plan: SplitPlan) -> None:
        super().__init__(skel)
        self.head = LayerStack(skel, plan.head_layers)
        self.tail = LayerStack(skel, plan.tail_layers)

    @torch.inference_mode()
    def run_head(
        self, token_ids: torch.Tensor, positions: torch.Tensor, parents: torch.Tensor, cache: KVCache
    ) -> torch.Tensor:
        """token_ids (q,) -> hidden (1, q, H) after the head layers."""
        out: torch.Tensor = self.head(self.embed(token_ids[None]), positions, parents, cache)
        return out

    @torch.inference_mode()
    def run_tail(
        self, hidden: torch.Tensor, positions: torch.Tensor, parents: torch.Tensor, cache: KVCache
    ) -> torch.Tensor:
        """hidden (1, q, H) from the trunk -> logits (q, V) in float32."""
        return self.logits(self.tail(hidden, positions, parents, cache))[0]


class FullModel(ModelEnds):
    """A whole model in one process (drafting, workers, local verification), on the same stacks."""

    def __init__(self, skel: Skeleton) -> None:
        super().__init__(skel)
        self.layers = LayerStack(skel, range(len(skel.layers)))

    @torch.inference_mode()
    def forward(
        self, token_ids: torch.Tensor, positions: torch.Tensor, parents: torch.Tensor, cache: KVCache
    ) -> torch.Tensor:
        """token_ids (q,) -> logits (q, V) float32; appends q entries to ``cache``."""
        hidden = self.layers(self.embed(token_ids[None]), positions, parents, cache)
        return self.logits(hidden)[0]

    @torch.inference_mode()
    def forward_visible(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        visible: torch.Tensor,
        key_positions: torch.Tensor,
        cache: KVCache,
    ) -> torch.Tensor:
        """token_ids (q,) -> logits (q, V) float32, query i seeing the keys ``visible`` marks (see
        :meth:`LayerStack.forward_visible`); appends q entries to ``cache``."""
        hidden = self.layers.forward_visible(self.embed(token_ids[None]), positions, visible, key_positions, cache)
        return self.logits(hidden)[0]


# -- loading --------------------------------------------------------------------------------------


def resolve_dtype(
    ckpt: Checkpoint, name: str, device: torch.device, what: str = "model", quantize: str | None = None
) -> tuple[torch.dtype, str]:
    """The compute dtype and its name (the raw wire codec carries it; protocol.codec's bf16 and int8 carry their
    own): ``name`` when pinned, else (``auto``) the checkpoint's published dtype as
    :func:`~splitspec.models.precision.resolve_compute_dtype` fits it to ``device``; but a quantized role
    (``quantize``, or a checkpoint published quantized) computes under ``auto`` in the published dtype
    whatever the device: its quantized layers are built for it and its unquantized parts load in it, as
    transformers loads them (a half-precision upcast to float32 on a CPU without native half matrix
    instructions applies to plain weights only; both ends resolve alike, so their wire dtypes agree)."""
    if name == AUTO and (quantize is not None or published_method(ckpt.config) is not None):
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
    for group in groups:
        names = [n for n in ckpt.tensor_names if n.startswith(group)]
        with ckpt.open_slices(names, device, pread=on_host) as state:
            info, _ = convert_and_load_state_dict_in_model(lm, state, load_config)
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
    for module in modules:
        module.requires_grad_(False)
    _materialize_buffers(skel, modules, device)
    for module in modules:
        module.to(device)  # a no-op when the converters kept the tensors where they were read


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
