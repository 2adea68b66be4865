"""Tiny random checkpoints of every family splitspec runs, each with its family's real quirks.

Each entry is the config a publisher's checkpoint of that family carries, shrunk: rope scaling,
tied or untied LM head, sliding windows shorter than the test prompts, soft-capping, q/k norms,
NoPE layers, MoE blocks, Granite's multipliers. ``initializer_range`` is large so that greedy
output is not degenerate (a near-uniform law would make every family look alike).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers

VOCAB = 96
LAYERS = 4
_COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.2,
    bos_token_id=0,
    eos_token_id=None,
    pad_token_id=None,
)
_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}

# name -> (model_type, family-specific config fields)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama3": ("llama", {"rope_parameters": _LLAMA3_ROPE, "tie_word_embeddings": False}),
    "llama3-tied": ("llama", {"rope_parameters": _LLAMA3_ROPE, "tie_word_embeddings": True}),
    "mistral": ("mistral", {"sliding_window": 6, "head_dim": 8}),  # window shorter than the prompt
    "qwen2": ("qwen2", {"tie_word_embeddings": True}),
    "qwen3": ("qwen3", {"head_dim": 8, "tie_word_embeddings": True}),  # q/k norms
    "qwen3-moe": (
        "qwen3_moe",
        {"head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16},
    ),
    "mixtral": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 6, "head_dim": 8}),
    "gemma2": (  # pre/post norms, scaled embedding, attention and final soft-capping, alternating windows
        "gemma2",
        {
            "head_dim": 8,
            "sliding_window": 6,
            "final_logit_softcapping": 3.0,
            "attn_logit_softcapping": 5.0,
            "query_pre_attn_scalar": 8,
            "initializer_range": 0.02,  # Gemma's scaled, tied embedding: larger makes it echo its input
        },
    ),
    "gemma3": (  # text: local/global rope per layer type, q/k norms, alternating windows
        "gemma3_text",
        {
            "head_dim": 8,
            "sliding_window": 6,
            "query_pre_attn_scalar": 8,
            "layer_types": "alternate",
            "initializer_range": 0.05,
        },
    ),
    "phi3": ("phi3", {"partial_rotary_factor": 0.5}),  # fused qkv and gate_up projections, partial rotary
    "granite": (
        "granite",
        {
            "embedding_multiplier": 12.0,
            "logits_scaling": 4.0,
            "residual_multiplier": 0.22,
            "attention_multiplier": 0.125,
        },
    ),
    "olmo2": ("olmo2", {}),  # post-norms, q/k norms over whole projections
    "smollm3": ("smollm3", {"no_rope_layer_interval": 2}),  # every second layer without rope (NoPE)
}


def family_config(name: str, layers: int = LAYERS, vocab: int = VOCAB) -> transformers.PretrainedConfig:
    model_type, extra = FAMILIES[name]
    if extra.get("layer_types") == "alternate":
        extra = {
            **extra,
            "layer_types": ["sliding_attention", "full_attention"] * (layers // 2)
            + ["sliding_attention"] * (layers % 2),
        }
    fields = {**_COMMON, "num_hidden_layers": layers, "vocab_size": vocab, **extra}
    return transformers.CONFIG_MAPPING[model_type](**fields)


def save_family_checkpoint(
    directory: Path, name: str, layers: int, seed: int, dtype: torch.dtype, vocab: int = VOCAB
) -> Path:
    """A random checkpoint of family ``name`` saved with save_pretrained in ``dtype`` (its published dtype)."""
    config = family_config(name, layers, vocab)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).to(dtype).eval()
    model.save_pretrained(directory)
    return directory
