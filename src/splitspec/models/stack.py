"""Runnable pieces of a split model, built from transformers' own decoder-layer classes.

* :class:`LayerStack` runs a contiguous range of decoder layers over one step of query tokens,
  computing rotary embeddings from position ids and the attention mask from parent indices.
* :class:`EdgeModel` is what the trusted edge holds: embedding, head layers, tail layers, final
  norm and LM head. :func:`load_trunk` builds what the untrusted cloud holds: the middle layers.

Each piece reads only its own tensors from the checkpoint.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

from splitspec.exceptions import CheckpointError
from splitspec.models.checkpoint import Checkpoint
from splitspec.models.kv_cache import KVCache
from splitspec.models.masks import step_mask
from splitspec.models.split import SplitPlan

log = logging.getLogger(__name__)

_FAMILY_MODULES = {
    "llama": ("transformers.models.llama.modeling_llama", "Llama"),
    "mistral": ("transformers.models.mistral.modeling_mistral", "Mistral"),
    "qwen2": ("transformers.models.qwen2.modeling_qwen2", "Qwen2"),
}


@dataclass(frozen=True)
class Family:
    """The transformers classes of one model family."""

    decoder_layer: type[nn.Module]
    rotary: type[nn.Module]
    norm: type[nn.Module]


def family_of(config: PretrainedConfig) -> Family:
    module_name, prefix = _FAMILY_MODULES[config.model_type]
    module = importlib.import_module(module_name)
    return Family(
        decoder_layer=getattr(module, f"{prefix}DecoderLayer"),
        rotary=getattr(module, f"{prefix}RotaryEmbedding"),
        norm=getattr(module, f"{prefix}RMSNorm"),
    )


def layer_window(config: PretrainedConfig, layer_idx: int) -> int | None:
    """Sliding-window size of a layer, or None for full attention (as transformers decides it)."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return window if layer_types[layer_idx] == "sliding_attention" else None
    return window


def prepare_config(config: PretrainedConfig, attn_implementation: str = "sdpa") -> PretrainedConfig:
    """A copy of ``config`` set up for our layers (attention kernel chosen explicitly)."""
    config = config.__class__.from_dict(config.to_dict())
    config._attn_implementation = attn_implementation
    return config


class LayerStack(nn.Module):
    """Decoder layers ``layer_indices`` of a model, run over one step with an explicit tree mask."""

    def __init__(self, config: PretrainedConfig, layers: Sequence[nn.Module], layer_indices: range) -> None:
        super().__init__()
        family = family_of(config)
        self.layer_indices = layer_indices
        self.layers = nn.ModuleList(layers)
        self.rotary = family.rotary(config)
        self.windows = [layer_window(config, i) for i in layer_indices]

    @torch.inference_mode()
    def forward(
        self, hidden: torch.Tensor, positions: torch.Tensor, parents: torch.Tensor, cache: KVCache
    ) -> torch.Tensor:
        """hidden (1, q, H), positions (q,), parents (q,) -> hidden (1, q, H); appends q entries to cache."""
        pos = positions.to(torch.long)[None]  # (1, q)
        cos_sin = self.rotary(hidden, pos)
        past = len(cache)
        masks = {
            # one query token with the whole prefix in view needs no mask at all
            w: None
            if hidden.shape[1] == 1 and (w is None or past < w)
            else step_mask(parents, positions, past, hidden.dtype, w)
            for w in set(self.windows)
        }
        try:
            for layer, window in zip(self.layers, self.windows, strict=True):
                hidden = layer(
                    hidden,
                    attention_mask=masks[window],
                    position_ids=pos,
                    past_key_values=cache,
                    position_embeddings=cos_sin,
                )
        except BaseException:
            cache.rollback()
            raise
        cache.commit()
        return hidden


def _build_layers(ckpt: Checkpoint, config: PretrainedConfig, indices: range, dtype: torch.dtype) -> LayerStack:
    family = family_of(config)
    layers = []
    for i in indices:
        state = ckpt.read_prefix(f"model.layers.{i}.", dtype)
        with torch.device("meta"):
            layer = family.decoder_layer(config, i)
        try:
            layer.load_state_dict(state, strict=True, assign=True)
        except RuntimeError as exc:
            raise CheckpointError(f"layer {i} of {ckpt.directory} does not match its config: {exc}") from None
        layers.append(layer.eval())
    return LayerStack(config, layers, indices).eval()


def load_trunk(ckpt: Checkpoint, plan: SplitPlan, dtype: torch.dtype, attn_implementation: str = "sdpa") -> LayerStack:
    """The cloud's piece: only the trunk layers' tensors are read."""
    config = prepare_config(ckpt.config, attn_implementation)
    trunk = _build_layers(ckpt, config, plan.trunk_layers, dtype)
    log.info(
        "trunk layers %d..%d loaded (%d tensors read)",
        plan.trunk_layers.start,
        plan.trunk_layers.stop - 1,
        len(ckpt.read_names),
    )
    return trunk


class EdgeModel(nn.Module):
    """The edge's pieces: embedding, head layers, tail layers, final norm, LM head."""

    def __init__(
        self,
        config: PretrainedConfig,
        embed: nn.Embedding,
        head: LayerStack,
        tail: LayerStack,
        norm: nn.Module,
        lm_head: nn.Linear,
    ) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = embed
        self.head = head
        self.tail = tail
        self.norm = norm
        self.lm_head = lm_head

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @torch.inference_mode()
    def run_head(
        self, token_ids: torch.Tensor, positions: torch.Tensor, parents: torch.Tensor, cache: KVCache
    ) -> torch.Tensor:
        """token_ids (q,) -> hidden (1, q, H) after the head layers."""
        hidden = self.embed_tokens(token_ids.to(torch.long)[None])  # (1, q, H)
        out: torch.Tensor = self.head(hidden, positions, parents, cache)
        return out

    @torch.inference_mode()
    def run_tail(
        self, hidden: torch.Tensor, positions: torch.Tensor, parents: torch.Tensor, cache: KVCache
    ) -> torch.Tensor:
        """hidden (1, q, H) from the trunk -> logits (q, V) in float32."""
        hidden = self.tail(hidden, positions, parents, cache)
        logits: torch.Tensor = self.lm_head(self.norm(hidden))  # (1, q, V)
        return logits[0].float()


def _load_ends(
    ckpt: Checkpoint, config: PretrainedConfig, dtype: torch.dtype
) -> tuple[nn.Embedding, nn.Module, nn.Linear]:
    """Embedding, final norm and LM head (tied to the embedding when the checkpoint says so)."""
    family = family_of(config)
    embed_w = ckpt.read(["model.embed_tokens.weight"], dtype)["model.embed_tokens.weight"]
    embed = nn.Embedding.from_pretrained(embed_w, freeze=True, padding_idx=config.pad_token_id)
    norm_args: dict[str, Any] = {"eps": config.rms_norm_eps}
    norm = family.norm(config.hidden_size, **norm_args)
    norm.load_state_dict(ckpt.read_prefix("model.norm.", dtype), strict=True)
    norm = norm.to(dtype)
    lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)
    if ckpt.has("lm_head.weight"):
        lm_head.weight = nn.Parameter(ckpt.read(["lm_head.weight"], dtype)["lm_head.weight"], requires_grad=False)
    elif getattr(config, "tie_word_embeddings", False):
        lm_head.weight = embed.weight
    else:
        raise CheckpointError(f"{ckpt.directory} has no lm_head.weight and does not tie embeddings")
    return embed, norm, lm_head


def load_edge(ckpt: Checkpoint, plan: SplitPlan, dtype: torch.dtype, attn_implementation: str = "sdpa") -> EdgeModel:
    """The edge's piece: embedding, head and tail layers, final norm, LM head. No trunk tensor is read."""
    config = prepare_config(ckpt.config, attn_implementation)
    embed, norm, lm_head = _load_ends(ckpt, config, dtype)
    head = _build_layers(ckpt, config, plan.head_layers, dtype)
    tail = _build_layers(ckpt, config, plan.tail_layers, dtype)
    return EdgeModel(config, embed, head, tail, norm, lm_head).eval()


class FullModel(nn.Module):
    """A whole model in one process (for drafting and local verification), on the same stacks."""

    def __init__(
        self, config: PretrainedConfig, embed: nn.Embedding, layers: LayerStack, norm: nn.Module, lm_head: nn.Linear
    ) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = embed
        self.layers = layers
        self.norm = norm
        self.lm_head = lm_head

    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)

    @torch.inference_mode()
    def forward(
        self, token_ids: torch.Tensor, positions: torch.Tensor, parents: torch.Tensor, cache: KVCache
    ) -> torch.Tensor:
        """token_ids (q,) -> logits (q, V) float32; appends q entries to ``cache``."""
        hidden = self.embed_tokens(token_ids.to(torch.long)[None])  # (1, q, H)
        hidden = self.layers(hidden, positions, parents, cache)
        logits: torch.Tensor = self.lm_head(self.norm(hidden))  # (1, q, V)
        return logits[0].float()


def load_full(ckpt: Checkpoint, dtype: torch.dtype, attn_implementation: str = "sdpa") -> FullModel:
    """Every piece of a checkpoint, for running it whole on one machine."""
    config = prepare_config(ckpt.config, attn_implementation)
    embed, norm, lm_head = _load_ends(ckpt, config, dtype)
    layers = _build_layers(ckpt, config, range(config.num_hidden_layers), dtype)
    return FullModel(config, embed, layers, norm, lm_head).eval()


def dtype_from_name(name: str) -> torch.dtype:
    """Map "float32" / "bfloat16" / "float16" to a torch dtype, with a clear error."""
    from splitspec.protocol.frames import DTYPES

    if name not in ("float32", "float16", "bfloat16"):
        raise CheckpointError(f"dtype {name!r} is not one of float32, float16, bfloat16")
    return DTYPES[name]
