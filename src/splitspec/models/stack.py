"""Runnable pieces of a split model, taken from the family's own transformers model.

* :class:`LayerStack` runs a contiguous range of decoder layers over one step of query tokens,
  computing rotary embeddings from position ids (per layer type where the family has several)
  and the attention mask from parent indices (with each layer's sliding window).
* :class:`EdgeModel` is what the trusted edge holds: embedding, head layers, tail layers, final
  norm and LM head; the untrusted cloud holds a :class:`LayerStack` of the middle layers.
* :class:`FullModel` is a whole model on one machine (drafting, federated workers, baselines,
  privacy audits): the one way this package runs a whole model.

Each piece lives on a device (``device=`` of the loaders; a trunk may spread its layers over
several): its tensors are read straight onto it, and a step's rotary table, position ids and
masks are built there. Token ids, positions and parents come in as host tensors.

Every piece is a module of :func:`splitspec.models.family.skeleton` (the family's ``*ForCausalLM``
on the meta device); :mod:`splitspec.models.loading` builds each role's pieces from its own tensors.
"""

from __future__ import annotations

import contextlib
import copy
import threading
from collections.abc import Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

from splitspec.models.family import Skeleton
from splitspec.models.fixed_decode import FixedShapeDecode
from splitspec.models.kv_cache import KVCache
from splitspec.models.masks import step_masks, visible_masks
from splitspec.models.row_attention import (
    ROWS_KWARG,
    RowAttention,
    attention_configs,
    keep_sdpa_off_cudnn,
    use_row_attention,
)
from splitspec.models.split import SplitPlan
from splitspec.models.static_kv import StaticKVCache

PositionEmbeddings = tuple[torch.Tensor, torch.Tensor]  # (cos, sin), each (1, q, head_dim)
_CPU = torch.device("cpu")


# one lock for every rotary that updates its frequencies in place from the positions of a call (see
# rope_reads_positions): two threads calling one such module would read each other's frequencies
_DATA_DEPENDENT_ROPE = threading.Lock()


def rope_reads_positions(rotary: nn.Module) -> bool:
    """Whether transformers' ``rotary`` recomputes its frequencies from the largest position of each call (as its
    ``dynamic_rope_update`` does for longrope and the dynamic types), for any of its layer types."""
    rope_type = getattr(rotary, "rope_type", "default")
    types = list(rope_type.values()) if isinstance(rope_type, dict) else [rope_type]
    return any(isinstance(t, str) and ("dynamic" in t or t == "longrope") for t in types)


def _dynamic_prefixes(rotary: nn.Module) -> tuple[str, ...]:
    """The attribute prefixes of ``rotary``'s dynamic-NTK tables ("" for a rotary of one type, "<layer type>_" per
    layer type that has one): empty when it has none."""
    rope_type = getattr(rotary, "rope_type", "default")
    if isinstance(rope_type, dict):
        return tuple(f"{t}_" for t, r in rope_type.items() if isinstance(r, str) and "dynamic" in r)
    return ("",) if isinstance(rope_type, str) and "dynamic" in rope_type else ()


def _reset_dynamic_rope(rotary: nn.Module, prefixes: Sequence[str]) -> None:
    """Put ``rotary``'s dynamic-NTK tables back to their state at load (the original frequencies, the original
    length cached), so that its next call computes what it computes for the call's positions alone.

    transformers' dynamic update is stateful: it grows its frequencies whenever a call's largest position passes
    the largest one seen so far and keeps them until a call falls back under the original length, so one
    session's long prompt changed every later session's tables (a 40-token sequence after a 60-token one, with
    an original length of 32, was off by 2.0 in its logits). From this state, its update recomputes the
    frequencies from the call's own largest position P (``seq_len`` P + 1) when that passes the original length
    and keeps the original ones otherwise: what a sequence alone gets at each of its steps."""
    original_len = getattr(rotary, "original_max_seq_len", None)
    for prefix in prefixes:
        original = getattr(rotary, f"{prefix}original_inv_freq", None)
        if original is None or original_len is None:
            continue
        rotary.register_buffer(f"{prefix}inv_freq", original, persistent=False)  # replaced, never written, by a growth
        setattr(rotary, f"{prefix}max_seq_len_cached", original_len)


def _rotary_lock(needed: bool) -> AbstractContextManager[object]:
    """The lock around a data-dependent rotary call (none when not ``needed``, or under torch.compile's tracing)."""
    if not needed or torch.compiler.is_compiling():
        return contextlib.nullcontext()
    return _DATA_DEPENDENT_ROPE


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
        self.rope_reads_positions = rope_reads_positions(skel.rotary)
        self._dynamic_rope = _dynamic_prefixes(skel.rotary)  # reset before each call: see _reset_dynamic_rope
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
        """(cos, sin) per layer type for positions ``pos`` (1, q), on ``hidden``'s device.

        A rotary whose tables follow the positions it is given (longrope, dynamic NTK: transformers updates its
        frequencies in place from the call's largest position) is called under a lock: stacks sharing it (the
        edge's head and tail) may call it from two threads at once. A dynamic-NTK one is reset first, so its
        tables depend on ``pos`` alone, never on an earlier call's (another session's) positions."""
        rotary = self._rotary_on[hidden.device]
        with _rotary_lock(self.rope_reads_positions):
            if self._dynamic_rope:
                _reset_dynamic_rope(rotary, self._dynamic_rope)
            if self.rotary_per_layer_type:
                return {t: rotary(hidden, pos, t) for t in set(self.layer_types)}
            shared = rotary(hidden, pos)
        return {t: shared for t in set(self.layer_types)}

    def row_position_embeddings(
        self, hidden: torch.Tensor, pos: torch.Tensor, lengths: Sequence[int]
    ) -> dict[str, PositionEmbeddings]:
        """(cos, sin) per layer type for several rows' positions packed end to end ``pos`` (1, N), N = sum of
        ``lengths``: each row's as its step alone gets them. A rotary that reads the call's largest position
        (:attr:`rope_reads_positions`) is run row by row, else a row beside a longer one would switch to its
        frequencies; any other once over all of them."""
        if not self.rope_reads_positions or len(lengths) < 2:
            return self.position_embeddings(hidden, pos)
        parts = [self.position_embeddings(hidden, row) for row in pos.split(list(lengths), dim=1)]  # each (1, q_b)
        return {
            t: (torch.cat([part[t][0] for part in parts], 1), torch.cat([part[t][1] for part in parts], 1))
            for t in parts[0]
        }  # each (1, N, head_dim)

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
        inputs: dict[torch.device, tuple[torch.Tensor, dict[str, PositionEmbeddings], dict[Any, Any]]] = {}
        try:
            for j in range(len(self.layers)):
                hidden = hidden.to(self.devices[j], non_blocking=True)  # moves only at a device boundary
                device = hidden.device
                if device not in inputs:
                    pos = positions.to(device, torch.long)[None]  # (1, q)
                    masks = visible_masks(visible, key_positions, positions, set(self.windows), hidden.dtype, device)
                    inputs[device] = (pos, self.position_embeddings(hidden, pos), dict(masks))
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
        self.logits_width: int | None = None  # another model's vocabulary width its logits take (align_vocabulary)

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

    def align_vocabulary(self, width: int) -> None:
        """Compute logits ``width`` wide, another model's (one tokenizer, embeddings padded otherwise: a draft model
        for its target): columns past ``width`` are cut (ids the other has no row for), columns past this model's
        own are -inf (padding rows: no token), and an id past this model's rows (a padding id the other sampled)
        reads its last row."""
        self.logits_width = None if width == self.vocab_size else width

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token ids (B, q) -> the stream before layer 0 (B, q, H)."""
        if self.logits_width is not None:
            token_ids = token_ids.clamp(max=self.vocab_size - 1)
        hidden: torch.Tensor = self.embed_tokens(token_ids.to(self.device, torch.long, non_blocking=True))
        if self._skeleton.embedding_multiplier is not None:
            hidden = hidden * self._skeleton.embedding_multiplier
        return hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The stream after the last layer (B, q, H) -> logits (B, q, V) in float32."""
        logits: torch.Tensor = self.finish_logits(self.lm_head(self.norm(hidden))).float()  # (B, q, V)
        width = self.logits_width
        if width is None:
            return logits
        if logits.shape[-1] >= width:
            return logits[..., :width].contiguous()
        masked = logits.new_full((*logits.shape[:-1], width - logits.shape[-1]), -float("inf"))
        return torch.cat([logits, masked], dim=-1)  # (B, q, width)

    def finish_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """An LM head's raw output (..., V) -> the family's logits (soft-capping, Granite's scaling), in its dtype:
        what :meth:`logits` applies, for an LM head of another's (a draft head's reduced one)."""
        return self._skeleton.finish_logits(logits)

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
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        parents: torch.Tensor,
        cache: KVCache,
        logits_from: int = 0,
    ) -> torch.Tensor:
        """token_ids (q,) -> logits (q - logits_from, V) float32 of the queries from ``logits_from`` on (a prefill
        wants its last: the LM head runs for those rows only); appends q entries to ``cache``."""
        hidden = self.layers(self.embed(token_ids[None]), positions, parents, cache)  # (1, q, H)
        return self.logits(hidden[:, logits_from:])[0]

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
