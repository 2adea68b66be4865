"""An EAGLE-style draft head: one decoder layer of the target's family, fed the target's own features.

The **pair convention** (EAGLE): the head's query at position i reads the embedding of token
x_{i+1} and the target's feature f_i of token x_i, ``fc(cat([embed(x_{i+1}), f_i], -1))``, runs
them through ONE decoder layer (the family's own class from transformers, with our masks,
rotary and :class:`~splitspec.models.kv_cache.KVCache`) and predicts the feature ĥ_{i+1} (ideally
f_{i+1}). ``logits(ĥ_{i+1})`` is the target's final norm and the target's own LM head (shared,
never copied), predicting x_{i+2}. The head's rotary position for that query is i.

A **feature** is the target's residual stream after k decoder layers (k in 1..L; k = L is the
last layer's output before the final norm); a head lists ``feature_layers`` (default ``(L,)``),
concatenated in that order: features (T, F*H).

Heads published in the EAGLE layout (:mod:`splitspec.models.draft_head_io`) may differ in three
ways the config records: the decoder layer without its input norm, features taken after the
target's final norm, and logits through the head's own norm and a reduced LM head whose draft
ids map back to the target's through ``d2t`` (target id = draft id + d2t[draft id]).
"""

from __future__ import annotations

import copy
import hashlib
import logging
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn
from transformers import CONFIG_MAPPING, PretrainedConfig

from splitspec.exceptions import CheckpointError, ConfigError
from splitspec.models.checkpoint import Checkpoint, fingerprint, hash_tensors
from splitspec.models.family import skeleton
from splitspec.models.kv_cache import KVCache
from splitspec.models.masks import chain
from splitspec.models.stack import LayerStack, ModelEnds

log = logging.getLogger(__name__)

LogitsNorm = Literal["target", "own", "none"]
LOGITS_NORMS: tuple[LogitsNorm, ...] = ("target", "own", "none")
ENDS_TENSORS = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")


@dataclass(frozen=True)
class DraftHeadConfig:
    """What a draft head is, and which target it was trained for."""

    target_fingerprint: str | None  # see target_fingerprint(); None: a published head carrying no pin
    target_name: str  # the target's name as the trainer saw it (for messages only)
    feature_layers: tuple[int, ...]  # target layers k whose outputs are concatenated as the feature
    hidden_size: int  # the target's (and the head's) hidden size H
    layer_config: dict[str, Any] = field(compare=False)  # transformers config of the one-layer model
    draft_vocab: int | None = None  # rows of the head's own LM head; None: the target's LM head, shared
    input_norm: bool = True  # the layer keeps its input norm (EAGLE-1 heads drop it)
    normed_features: bool = False  # features pass the target's final norm before fc (EAGLE-1: post-norm states)
    logits_norm: LogitsNorm = "target"  # the norm before the LM head: the target's, the head's own, none
    fc_bias: bool = True

    def __post_init__(self) -> None:
        if not self.feature_layers:
            raise ConfigError("a draft head needs at least one feature layer")
        if self.logits_norm not in LOGITS_NORMS:
            raise ConfigError(f"logits_norm must be one of {', '.join(LOGITS_NORMS)}, got {self.logits_norm!r}")
        if self.normed_features and len(self.feature_layers) != 1:
            raise ConfigError("normed features (EAGLE-1 layout) take exactly one feature layer")

    @property
    def feature_width(self) -> int:
        """F*H: the width of the concatenated features."""
        return len(self.feature_layers) * self.hidden_size

    def transformers_config(self) -> PretrainedConfig:
        """The one-layer model config the decoder layer is built from."""
        model_type = self.layer_config.get("model_type")
        if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
            raise ConfigError(f"draft head layer config: model_type {model_type!r} is not one transformers knows")
        config: PretrainedConfig = CONFIG_MAPPING[model_type].from_dict(dict(self.layer_config))
        return config


def one_layer_config(target: PretrainedConfig) -> dict[str, Any]:
    """A copy of the target's config with one decoder layer (the last layer's type), as a dict."""
    data = target.to_dict()
    data["num_hidden_layers"] = 1
    types = data.get("layer_types")
    if isinstance(types, list) and types:
        data["layer_types"] = types[-1:]
    for key in ("architectures", "_name_or_path", "transformers_version", "auto_map"):
        data.pop(key, None)
    return data


def check_feature_layers(layers: tuple[int, ...], num_layers: int) -> tuple[int, ...]:
    """``layers`` when each is a valid feature layer (1..L, no repeats) of an L-layer target."""
    if not layers or any(k < 1 or k > num_layers for k in layers) or len(set(layers)) != len(layers):
        raise ConfigError(f"feature layers {list(layers)} must be distinct layers in 1..{num_layers}")
    return layers


def default_config(target: Checkpoint, feature_layers: tuple[int, ...] | None = None) -> DraftHeadConfig:
    """The config of a new head for ``target``: the target's own layer class, features ``(L,)`` by default."""
    num_layers = int(target.config.num_hidden_layers)
    layers = check_feature_layers(feature_layers or (num_layers,), num_layers)
    return DraftHeadConfig(
        target_fingerprint=target_fingerprint(target),
        target_name=target.directory.name,
        feature_layers=layers,
        hidden_size=int(target.config.hidden_size),
        layer_config=one_layer_config(target.config),
    )


# rotary types whose tables never read max_position_embeddings (transformers' modeling_rope_utils): default, linear,
# llama3 (its own original_max_position_embeddings) and proportional; yarn only with an explicit factor
_LIMIT_FREE_ROPE = frozenset({"default", "linear", "llama3", "proportional"})


def rope_reads_position_limit(config: PretrainedConfig) -> bool:
    """Whether the rotary tables of ``config`` depend on its ``max_position_embeddings`` (for any layer type)."""
    params = getattr(config, "rope_parameters", None)
    if not isinstance(params, dict) or not params:
        return False  # no rotary parameters (no rope, or the plain default)
    per_type = [params] if "rope_type" in params or "type" in params else list(params.values())
    for entry in per_type:
        if entry is None:
            continue
        if not isinstance(entry, dict):
            return True  # a layout this check does not know: keep the limit
        rope_type = str(entry.get("rope_type", entry.get("type", "default")))
        if rope_type == "yarn" and entry.get("factor") is not None:
            continue
        if rope_type not in _LIMIT_FREE_ROPE:
            return True
    return False


def target_fingerprint(target: Checkpoint) -> str:
    """sha256 (hex) of the target: its architecture fields (its position limit aside, unless its rotary tables read
    it) and the float32 values of the embedding, final norm, LM head (when untied) and last decoder layer, the
    tensors both a whole and a stripped edge checkpoint hold."""
    last = f"model.layers.{int(target.config.num_hidden_layers) - 1}."
    names = sorted(
        {*(n for n in ENDS_TENSORS if target.has(n)), *(n for n in target.tensor_names if n.startswith(last))}
    )
    if not any(n.startswith(last) for n in names) or "model.embed_tokens.weight" not in names:
        raise CheckpointError(f"{target.directory} lacks the embedding or the last decoder layer ({last.rstrip('.')})")
    # the position limit is not the head's business where the rotary tables do not read it: a copy of the target
    # allowed longer contexts (rotary positions extend as they are) computes the same features, and keeps the head
    # trained for it. Where they read it (longrope's attention factor, dynamic NTK, yarn without a factor) it stays
    config = copy.deepcopy(target.config)
    if not rope_reads_position_limit(config):
        config.max_position_embeddings = 0
    digest = hashlib.sha256(fingerprint(config).encode())
    hash_tensors(digest, target, names)
    return digest.hexdigest()


class DraftHead(nn.Module):
    """``fc`` and one decoder layer; logits through the target's (or its own) norm and LM head."""

    def __init__(self, config: DraftHeadConfig, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config
        layer_config = config.transformers_config()
        if int(layer_config.hidden_size) != config.hidden_size:
            raise ConfigError(
                f"draft head layer hidden size {layer_config.hidden_size} is not the target's {config.hidden_size}"
            )
        skel = skeleton(layer_config, dtype)
        layer, rotary = skel.layers[0], skel.rotary
        for module in (layer, rotary):  # out of meta, then the family's own initializer (rotary tables too)
            module.to_empty(device=device)
            for sub in module.modules():
                skel.lm._init_weights(sub)
        if not config.input_norm:
            if not isinstance(getattr(layer, "input_layernorm", None), nn.Module):
                raise ConfigError(f"{type(layer).__name__} has no input_layernorm to drop (EAGLE-1 layout)")
            layer.input_layernorm = nn.Identity()  # this instance only: the EAGLE-1 first layer has none
        self.stack = LayerStack(skel, range(1))  # masks, rotary and the KV cache from the shared machinery
        hidden = config.hidden_size
        self.fc = nn.Linear(hidden + config.feature_width, hidden, bias=config.fc_bias, device=device, dtype=dtype)
        self.norm: nn.Module | None = None
        if config.logits_norm == "own":
            self.norm = type(skel.norm)(hidden, eps=float(getattr(layer_config, "rms_norm_eps", 1e-6)))
            self.norm.to(device=device, dtype=dtype)
        self.lm_head: nn.Linear | None = None
        self.d2t: torch.Tensor | None  # target id of each draft id: draft id + d2t[draft id] (EAGLE-3's convention)
        d2t = None
        if config.draft_vocab is not None:
            self.lm_head = nn.Linear(hidden, config.draft_vocab, bias=False, device=device, dtype=dtype)
            d2t = torch.zeros(config.draft_vocab, dtype=torch.long, device=device)
        self.register_buffer("d2t", d2t)

    @property
    def layer(self) -> nn.Module:
        """The decoder layer (the family's own class)."""
        layer: nn.Module = self.stack.layers[0]
        return layer

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def inputs(
        self, ends: ModelEnds, token_ids: torch.Tensor, features: torch.Tensor, predicted: bool = False
    ) -> torch.Tensor:
        """token_ids (B, q) = x_{i+1}, features (B, q, F*H) = f_i -> the layer's input (B, q, H).

        ``predicted``: the features are the head's own predictions ĥ (a draft tree past the committed prefix),
        not the target's. A head over normed features (EAGLE-1) passes the target's pre-norm features through the
        target's final norm, and reads its predictions as they are: it was trained to predict the normed state and
        feeds it back unchanged. Other heads read both as they come."""
        if features.shape[-1] != self.config.feature_width:
            raise ConfigError(
                f"draft head features are {features.shape[-1]} wide, expected {self.config.feature_width}"
            )
        embedded = ends.embed(token_ids).to(self.device, self.dtype)  # (B, q, H)
        feats = features.to(self.device, self.dtype)  # (B, q, F*H)
        if self.config.normed_features and not predicted:
            feats = ends.norm(feats.to(ends.device, ends.dtype)).to(self.device, self.dtype)
        out: torch.Tensor = self.fc(torch.cat([embedded, feats], dim=-1))
        return out

    def forward(
        self,
        ends: ModelEnds,
        token_ids: torch.Tensor,
        features: torch.Tensor,
        positions: torch.Tensor,
        parents: torch.Tensor,
        cache: KVCache | None,
    ) -> torch.Tensor:
        """token_ids (q,) long = x_{i+1}; features (q, F*H) = f_i; positions (q,) int32 = i; parents (q,) int32,
        a tree within the step (-1: sees the whole cached prefix) -> ĥ (q, H).

        Appends q entries to ``cache`` and commits them (rolled back if the step fails); a None cache
        runs the step alone (training). Gradients flow when the caller enables them: draft under
        ``torch.inference_mode()``."""
        hidden = self.inputs(ends, token_ids[None], features[None])  # (1, q, H)
        return self.stack.run_committed(hidden, positions, parents, cache)[-1][0]  # (q, H)

    def forward_visible(
        self,
        ends: ModelEnds,
        token_ids: torch.Tensor,
        features: torch.Tensor,
        positions: torch.Tensor,
        visible: torch.Tensor,
        key_positions: torch.Tensor,
        cache: KVCache,
        *,
        predicted: bool,
    ) -> torch.Tensor:
        """As :meth:`forward`, but query i sees exactly the keys ``visible[i]`` marks (q, len(cache) + q) bool,
        less those the layer's sliding window hides (keys at ``key_positions``): a draft tree grown level by level
        keeps its earlier levels in the cache, where a node must see its own ancestors only. ``predicted``: the
        features are the head's own predictions ĥ, not the target's (see :meth:`inputs`). -> ĥ (q, H)"""
        hidden = self.inputs(ends, token_ids[None], features[None], predicted)  # (1, q, H)
        return self.stack.forward_visible(hidden, positions, visible, key_positions, cache)[0]

    def run_chunks(self, ends: ModelEnds, token_ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """Training: B chains from position 0, token_ids (B, q), features (B, q, F*H) -> ĥ (B, q, H), no cache."""
        q = token_ids.shape[1]
        positions = torch.arange(q, dtype=torch.int32)
        parents = torch.tensor(chain(q), dtype=torch.int32)
        hidden = self.inputs(ends, token_ids, features)
        return self.stack.run(hidden, positions, parents, None)[-1]

    def logits(self, ends: ModelEnds, hidden: torch.Tensor) -> torch.Tensor:
        """ĥ (q, H) -> logits (q, V) float32 over the TARGET's vocabulary (outside a reduced draft vocabulary: -inf).

        Every layout's logits take the target family's logit transforms (:meth:`ModelEnds.finish_logits`: Gemma's
        soft-capping, Granite's scaling), as the target's own do."""
        if self.config.logits_norm == "target" and self.lm_head is None:
            return ends.logits(hidden.to(ends.device, ends.dtype))
        if self.config.logits_norm == "target":
            normed = ends.norm(hidden.to(ends.device, ends.dtype)).to(self.device, self.dtype)
        elif self.norm is not None:
            normed = self.norm(hidden)
        else:
            normed = hidden
        if self.lm_head is None:
            shared: torch.Tensor = ends.lm_head(normed.to(ends.device, ends.dtype))  # (q, V)
            return ends.finish_logits(shared).float()
        small: torch.Tensor = ends.finish_logits(self.lm_head(normed)).float()  # (q, Vd)
        out = small.new_full((*small.shape[:-1], ends.vocab_size), float("-inf"))  # (q, V)
        assert self.d2t is not None  # set with lm_head
        target_ids = torch.arange(small.shape[-1], device=small.device) + self.d2t
        return out.index_copy(-1, target_ids, small)

    def parameter_bytes(self) -> int:
        """Bytes of the head's own parameters (the target's embedding and LM head are shared, not counted)."""
        return sum(p.numel() * p.element_size() for p in self.parameters())
