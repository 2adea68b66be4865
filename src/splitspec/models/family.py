"""A checkpoint's family, as transformers' own modelling classes define it.

Nothing here is a per-family table. The family's ``*ForCausalLM`` class comes from transformers'
auto mapping; :func:`skeleton` instantiates it on the ``meta`` device (no memory, no weights), and
the pieces a role runs are that skeleton's own modules: the embedding (Gemma's scaled embedding is
a module), the decoder layers (pre/post norms, q/k norms, NoPE layers, attention soft-capping,
MoE blocks and Granite's residual/attention multipliers all live inside them), the rotary
embedding (one per layer type for Gemma 3), the final norm and the LM head.

What the model's ``forward`` methods do *between* those modules is the rest of a family's
quirks. :func:`forward_quirks` reads which attributes those methods use and refuses a family
that uses one we do not reproduce, naming it; the ones we do reproduce are:

* ``embedding_multiplier`` (Granite): the embedding output is multiplied by it;
* ``final_logit_softcapping`` (Gemma 2/3): ``cap * tanh(logits / cap)``;
* ``logits_scaling`` (Granite): logits are divided by it;
* ``layer_types`` / ``sliding_window``: which layers see a sliding window (applied in our masks).
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers import initialization as hf_init
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
from transformers.quantizers.base import HfQuantizer

from splitspec.exceptions import CheckpointError
from splitspec.models.kv_cache import KVCache

# Attributes a Model/ForCausalLM forward may read that our pieces reproduce (or that do not
# change the computation: losses, router statistics, gradient checkpointing, the layer count).
_KNOWN_SELF = frozenset(
    {
        "config",
        "model",
        "embed_tokens",
        "layers",
        "norm",
        "rotary_emb",
        "lm_head",
        "embedding_multiplier",
        "gradient_checkpointing",
        "training",
        "loss_function",
        "vocab_size",
        "num_experts",
        "num_experts_per_tok",
        "router_aux_loss_coef",
        "has_sliding_layers",  # only picks which masks to build; our masks apply each layer's window
    }
)
_KNOWN_CONFIG = frozenset(
    {
        "num_hidden_layers",
        "layer_types",
        "sliding_window",
        "vocab_size",
        "final_logit_softcapping",
        "logits_scaling",
        "output_router_logits",
        "router_aux_loss_coef",
        "num_experts",
        "num_local_experts",
        "num_experts_per_tok",
        "use_bidirectional_attention",  # refused below when set
    }
)
M = TypeVar("M", bound=nn.Module)
_SELF_ATTR = re.compile(r"\bself\.(\w+)")
_CONFIG_ATTR = re.compile(r"\bself\.config\.(\w+)")
# the layer types splitspec's masks and KV cache run (layer_window): any other (linear attention, sparse attention
# with an indexer, chunked attention, mamba or conv blocks) would run as full attention, or crash at its first step
SPLITTABLE_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})
# what a decoder layer's modules read of the cache transformers hands them, under the names its modules give it
_CACHE_USE = re.compile(r"\b(?:past_key_values?|cache_params|layer_past)\.(\w+)")


_LATENT = "its multi-head latent attention caches compressed latents that the layer expands after the cache"
_RECURRENT = "its linear-attention layers keep a recurrent state, not a KV cache of keys and values"
# Families transformers loads that splitspec cannot run in pieces, each found by comparing split and whole
# forwards (stop 56's review); the check in forward_quirks cannot see what goes wrong inside their layers.
UNSPLITTABLE: dict[str, str] = {
    "stablelm": "its decoder layer does not pass attention keyword arguments on, so batched rows would attend "
    "across sequences",
    "diffllama": "its attention splits and repeats the values after the cache update",
    "deepseek_v2": _LATENT,
    "deepseek_v3": _LATENT,
    "glm4_moe_lite": _LATENT,
    "minicpm3": _LATENT,
    "youtu": _LATENT,
    "olmo_hybrid": _RECURRENT,
    "minimax": _RECURRENT,
    "qwen3_next": _RECURRENT,
    "nanochat": "its forward normalizes the embeddings with the final norm before the first layer",
}


def causal_lm_class(config: PretrainedConfig) -> type[PreTrainedModel]:
    """transformers' ``*ForCausalLM`` class for this config (its auto mapping), or a clear refusal."""
    why = UNSPLITTABLE.get(str(getattr(config, "model_type", "")))
    if why is not None:
        raise CheckpointError(f"model type {config.model_type!r} cannot be split: {why}")
    cls = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    if not (isinstance(cls, type) and issubclass(cls, PreTrainedModel)):
        raise CheckpointError(
            f"model type {config.model_type!r} has no causal-LM class in transformers: it cannot be split"
        )
    return cls


def forward_quirks(lm: PreTrainedModel) -> None:
    """Refuse a family whose forward methods apply something between modules we do not reproduce."""
    base = lm.base_model
    unknown: set[str] = set()
    for cls in (type(base), type(lm)):
        source = inspect.getsource(cls.forward)
        body = source.split('"""')[-1] if source.count('"""') >= 2 else source  # skip the docstring
        unknown |= {f"config.{a}" for a in _CONFIG_ATTR.findall(body) if a not in _KNOWN_CONFIG}
        unknown |= {a for a in _SELF_ATTR.findall(body) if a not in _KNOWN_SELF and a != "config"}
    if getattr(lm.config, "use_bidirectional_attention", False):
        unknown.add("config.use_bidirectional_attention=True")
    if unknown:
        raise CheckpointError(
            f"{type(lm).__name__} cannot be split: its forward applies {', '.join(sorted(unknown))}, "
            "which splitspec does not reproduce between decoder layers"
        )


def check_layer_types(config: PretrainedConfig) -> None:
    """Refuse a config whose ``layer_types`` name a layer other than full or sliding-window attention."""
    types = getattr(config, "layer_types", None)
    if types is None:
        return
    other = sorted({str(t) for t in types} - SPLITTABLE_LAYER_TYPES)
    if other:
        raise CheckpointError(
            f"model type {config.model_type!r} cannot be split: its layer type(s) {', '.join(map(repr, other))} "
            f"are not full or sliding-window attention over a KV cache ({', '.join(sorted(SPLITTABLE_LAYER_TYPES))})"
        )


def check_cache_use(lm: PreTrainedModel, layers: nn.ModuleList) -> None:
    """Refuse a family whose decoder layers use a cache method :class:`KVCache` does not have (a sparse attention's
    ``update_indexer``, a recurrent layer's ``update_conv_state``): read from their modules' source, as
    :func:`forward_quirks` reads the forwards."""
    used: set[str] = set()
    for cls in {type(m) for layer in layers for m in layer.modules()}:
        used |= _cache_attributes(cls)
    missing = sorted(a for a in used if not hasattr(KVCache, a))
    if missing:
        raise CheckpointError(
            f"{type(lm).__name__} cannot be split: its layers call {', '.join(missing)} on their cache, "
            "which splitspec's KV cache (keys and values per layer) does not have"
        )


_CACHE_ATTRIBUTES: dict[type[nn.Module], frozenset[str]] = {}  # per module class, read once per process


def _cache_attributes(cls: type[nn.Module]) -> frozenset[str]:
    """The cache attributes the methods of a transformers module class (and its transformers bases) use."""
    known = _CACHE_ATTRIBUTES.get(cls)
    if known is not None:
        return known
    used: set[str] = set()
    for klass in cls.__mro__:
        if not klass.__module__.startswith("transformers."):
            continue
        for member in vars(klass).values():
            if not inspect.isfunction(member):
                continue
            try:
                used |= set(_CACHE_USE.findall(inspect.getsource(member)))
            except (OSError, TypeError):  # no source (a compiled or generated function)
                continue
    _CACHE_ATTRIBUTES[cls] = frozenset(used)
    return _CACHE_ATTRIBUTES[cls]


def _module(owner: nn.Module, name: str, kind: type[M], lm: PreTrainedModel) -> M:
    child = getattr(owner, name, None)
    if not isinstance(child, kind):
        raise CheckpointError(
            f"{type(lm).__name__} cannot be split: {type(owner).__name__} has no {name!r} {kind.__name__} "
            "(splitspec needs embed_tokens, layers, norm, rotary_emb and lm_head)"
        )
    return child


@dataclass
class Skeleton:
    """A family's ``*ForCausalLM`` on the meta device, and the modules splitspec takes from it."""

    lm: PreTrainedModel  # meta-device model: parameters are loaded only into the pieces a role uses
    embed: nn.Embedding  # the family's token embedding (scaled for Gemma)
    layers: nn.ModuleList  # decoder layers, index = layer index
    norm: nn.Module  # final norm
    rotary: nn.Module  # rotary embedding, shared by every layer
    lm_head: nn.Linear
    embedding_multiplier: float | None  # Granite's, read from the model itself
    quantizer: HfQuantizer | None = None  # transformers' quantizer its linear layers were converted for

    @property
    def config(self) -> PretrainedConfig:
        return self.lm.config

    @property
    def rotary_per_layer_type(self) -> bool:
        """True when the rotary embedding takes a layer type (Gemma 3: local and global rope)."""
        return "layer_type" in inspect.signature(self.rotary.forward).parameters

    def layer_type(self, layer_idx: int) -> str:
        types = getattr(self.config, "layer_types", None)
        return str(types[layer_idx]) if types is not None else "full_attention"

    def layer_window(self, layer_idx: int) -> int | None:
        """Sliding-window size of a layer, or None for full attention (as the family's forward decides; any other
        layer type was refused by :func:`check_layer_types`)."""
        window = getattr(self.config, "sliding_window", None)
        if getattr(self.config, "layer_types", None) is not None:
            return window if self.layer_type(layer_idx) == "sliding_attention" else None
        return window

    def finish_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The family's logit transforms, in the compute dtype as its ``forward`` applies them."""
        cap = getattr(self.config, "final_logit_softcapping", None)
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        scaling = getattr(self.config, "logits_scaling", None)
        if scaling is not None:
            logits = logits / scaling
        return logits


def skeleton(
    config: PretrainedConfig,
    dtype: torch.dtype,
    attn_implementation: str | None = None,
    quantizer: HfQuantizer | None = None,
) -> Skeleton:
    """Instantiate the family's causal-LM class on ``meta`` in ``dtype`` and check it can be split.

    ``attn_implementation`` None keeps the family's own choice (Gemma 2 picks eager attention for
    its soft-capping); "sdpa" or "eager" force one. A ``quantizer`` (see
    :mod:`splitspec.models.quantization`) converts the skeleton's modules the way ``from_pretrained``
    does, before any weight is read (its ``preprocess_model``, still on ``meta``).
    """
    cls = causal_lm_class(config)
    check_layer_types(config)
    config = config.__class__.from_dict(config.to_dict())  # never mutate the checkpoint's config
    kwargs: dict[str, Any] = {"dtype": dtype}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    with hf_init.no_init_weights(), torch.device("meta"):
        lm = cls._from_config(config, **kwargs)
        if quantizer is not None:  # swaps linear layers for the quantizer's own, weights untouched
            quantizer.preprocess_model(model=lm, dtype=dtype, device_map=None, checkpoint_files=None, use_kernels=False)
    lm.eval()
    base = lm.base_model
    layers = _module(base, "layers", nn.ModuleList, lm)
    forward_quirks(lm)
    check_cache_use(lm, layers)
    multiplier = getattr(base, "embedding_multiplier", None)
    return Skeleton(
        lm=lm,
        embed=_module(base, "embed_tokens", nn.Embedding, lm),
        layers=layers,
        norm=_module(base, "norm", nn.Module, lm),
        rotary=_module(base, "rotary_emb", nn.Module, lm),
        lm_head=_module(lm, "lm_head", nn.Linear, lm),
        embedding_multiplier=None if multiplier is None else float(multiplier),
        quantizer=quantizer,
    )


def published_dtype(config: PretrainedConfig) -> torch.dtype:
    """The dtype the checkpoint was published in (config ``dtype``/``torch_dtype``), float32 if unsaid."""
    value = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if value is None:
        return torch.float32
    if isinstance(value, str):
        value = getattr(torch, value, None)
    if not isinstance(value, torch.dtype) or value not in (torch.float32, torch.float16, torch.bfloat16):
        raise CheckpointError(f"the checkpoint's dtype {value!r} is not one of float32, float16, bfloat16")
    return value
