"""Families come from transformers' own classes: what can be split loads, what cannot is refused by name."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from splitspec.exceptions import CheckpointError
from splitspec.models.checkpoint import Checkpoint
from splitspec.models.family import published_dtype, skeleton
from splitspec.models.loading import load_edge, load_trunk
from splitspec.models.split import SplitPlan
from tests.families import LAYERS, family_config, save_family_checkpoint

LAYER = re.compile(r"^model\.layers\.(\d+)\.")


@pytest.mark.parametrize("name", ["qwen3-moe", "mixtral"])
def test_moe_trunk_reads_only_its_layers_through_transformers_converters(tmp_path: Path, name: str) -> None:
    """Hub MoE checkpoints store one tensor per expert; transformers fuses them at load: so do we."""
    directory = save_family_checkpoint(tmp_path, name, LAYERS, seed=3, dtype=torch.float32)
    ckpt = Checkpoint(directory)
    assert any(".experts.0." in n for n in ckpt.tensor_names), "the saved checkpoint keeps per-expert tensors"
    trunk = load_trunk(ckpt, SplitPlan(LAYERS, 1, 1))
    assert {int(m.group(1)) for n in ckpt.read_names if (m := LAYER.match(n))} == {1, 2}
    assert all(LAYER.match(n) for n in ckpt.read_names)
    reference = transformers.AutoModelForCausalLM.from_pretrained(directory).model.layers[1]
    for (got_name, got), (want_name, want) in zip(
        trunk.layers[0].named_parameters(), reference.named_parameters(), strict=True
    ):
        assert got_name == want_name
        assert torch.equal(got, want), got_name


def test_published_dtype_is_the_default(tmp_path: Path) -> None:
    directory = save_family_checkpoint(tmp_path, "qwen3", LAYERS, seed=3, dtype=torch.bfloat16)
    ckpt = Checkpoint(directory)
    assert published_dtype(ckpt.config) == torch.bfloat16
    edge = load_edge(ckpt, SplitPlan(LAYERS, 1, 1))
    assert edge.dtype == torch.bfloat16
    assert load_edge(Checkpoint(directory), SplitPlan(LAYERS, 1, 1), torch.float32).dtype == torch.float32


@pytest.mark.parametrize(
    ("model_type", "missing"),
    [
        ("gpt2", "no 'layers'"),  # a different module layout
        ("cohere", "logit_scale"),  # a logit multiplier applied in its forward
        ("phi", "final_layernorm"),  # a differently named final norm
    ],
)
def test_unsplittable_family_is_refused_naming_what_is_missing(model_type: str, missing: str) -> None:
    config = transformers.CONFIG_MAPPING[model_type]()
    with pytest.raises(CheckpointError, match=re.escape(missing)):
        skeleton(config, torch.float32)


@pytest.mark.parametrize(
    ("model_type", "why"),
    [
        ("stablelm", "attend across sequences"),  # batched rows leaked into each other (0.07 of the output)
        ("diffllama", "after the cache update"),  # batched against alone: 0.49
        ("deepseek_v3", "latent"),  # a batch of two rows crashed at o_proj
        ("nanochat", "normalizes the embeddings"),  # every path differed from transformers by 0.33
    ],
)
def test_families_whose_layers_cannot_run_in_pieces_are_refused(model_type: str, why: str) -> None:
    """They passed forward_quirks and split silently wrong (or crashed in a batch): compared with transformers
    in stop 56's review."""
    with pytest.raises(CheckpointError, match=f"model type '{model_type}' cannot be split: .*{why}"):
        skeleton(transformers.CONFIG_MAPPING[model_type](), torch.float32)


def test_family_without_a_causal_lm_class_is_refused() -> None:
    with pytest.raises(CheckpointError, match="no causal-LM class"):
        skeleton(transformers.CONFIG_MAPPING["vit"](), torch.float32)


def test_every_test_family_builds_a_skeleton() -> None:
    from tests.families import FAMILIES

    for name in FAMILIES:
        skel = skeleton(family_config(name), torch.float32)
        assert len(skel.layers) == LAYERS


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{broken", "not valid JSON"),
        ('{"model_type": "no_such_family"}', "no_such_family"),
        ('{"model_type": "llama", "auto_map": {"AutoConfig": "x.Y"}}', "trust_remote_code"),
        ("[1, 2]", "JSON object"),
    ],
)
def test_bad_config_is_a_checkpoint_error(tmp_path: Path, content: str, message: str) -> None:
    (tmp_path / "config.json").write_text(content)
    with pytest.raises(CheckpointError, match=message):
        Checkpoint(tmp_path)


def test_truncated_safetensors_is_a_checkpoint_error(tmp_path: Path) -> None:
    directory = save_family_checkpoint(tmp_path / "ok", "llama3", LAYERS, seed=3, dtype=torch.float32)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((directory / "config.json").read_text())
    data = (directory / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="safetensors"):
        load_trunk(Checkpoint(broken), SplitPlan(LAYERS, 1, 1))
    assert json.loads((broken / "config.json").read_text())["model_type"] == "llama"


HYBRID_OR_SPARSE = [
    t
    for t in (
        "qwen3_5_text",
        "qwen3_5_moe_text",
        "bailing_hybrid",
        "deepseek_v32",
        "glm_moe_dsa",
        "axk2",
        "dots3_note_text",
    )
    if t in transformers.CONFIG_MAPPING
]


@pytest.mark.parametrize("model_type", HYBRID_OR_SPARSE)
def test_layers_other_than_attention_over_a_kv_cache_are_refused_naming_their_type(model_type: str) -> None:
    """Linear-attention hybrids and indexer (sparse) attention passed skeleton() and crashed at the first step (a
    raw RuntimeError, or 'KVCache' has no attribute 'update_indexer'): layer_window ran them as full attention."""
    with pytest.raises(CheckpointError, match=f"'{model_type}' cannot be split: its layer type.* '(linear|indexed)_"):
        skeleton(transformers.CONFIG_MAPPING[model_type](), torch.bfloat16)


@pytest.mark.skipif("deepseek_v32" not in transformers.CONFIG_MAPPING, reason="no DeepSeek-V3.2 in this transformers")
def test_layers_using_cache_methods_the_kv_cache_lacks_are_refused() -> None:
    """Layer types that say full attention do not hide an indexer that keeps its own keys in the cache."""
    make: Any = transformers.CONFIG_MAPPING["deepseek_v32"]
    config = make(num_hidden_layers=2, layer_types=["full_attention"] * 2)
    with pytest.raises(CheckpointError, match="its layers call update_indexer on their cache"):
        skeleton(config, torch.float32)
