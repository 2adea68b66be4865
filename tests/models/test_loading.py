"""Each side loads only its own tensors; split plans are validated against the model's depth."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from splitspec.cloud.config import CloudConfig
from splitspec.cloud.server import TrunkServer
from splitspec.exceptions import CheckpointError, ConfigError
from splitspec.models.checkpoint import Checkpoint, fingerprint
from splitspec.models.loading import load_edge, load_trunk
from splitspec.models.split import SplitPlan, parse_edge_layers

LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def layer_of(name: str) -> int | None:
    match = LAYER.match(name)
    return int(match.group(1)) if match else None


@pytest.mark.parametrize("split", [(1, 1), (2, 2), (3, 1)])
def test_cloud_loads_only_trunk_tensors(make_checkpoint: Callable[..., Path], split: tuple[int, int]) -> None:
    model = make_checkpoint("llama", sharded=True)
    server = TrunkServer(CloudConfig(model_dir=model, port=0, edge_layers=split, prepack="off"))  # nn.Linear weights
    trunk = range(split[0], 6 - split[1])
    read = server.checkpoint.read_names
    assert read, "the trunk read nothing"
    assert all(layer_of(n) in trunk for n in read), sorted(read)
    assert not any("embed_tokens" in n or "lm_head" in n or n.startswith("model.norm") for n in read)
    # the module holds exactly the trunk layers' parameters, nothing else
    params = {n for n, _ in server.trunk.named_parameters()}
    expected = {n for n in Checkpoint(model).tensor_names if layer_of(n) in trunk}
    assert len(params) == len(expected)
    assert {int(n.split(".")[1]) for n in params} == set(range(len(trunk)))
    assert server.trunk.layer_indices == trunk


def test_edge_reads_no_trunk_tensor(make_checkpoint: Callable[..., Path]) -> None:
    model = make_checkpoint("qwen2")
    ckpt = Checkpoint(model)
    edge = load_edge(ckpt, SplitPlan(6, 2, 2), torch.float32)
    assert {layer_of(n) for n in ckpt.read_names} - {None} == {0, 1, 4, 5}
    assert "model.embed_tokens.weight" in ckpt.read_names
    assert edge.lm_head.weight is edge.embed_tokens.weight  # qwen2 test model ties embeddings


@pytest.mark.parametrize(("head", "tail"), [(0, 2), (2, 0), (3, 3), (5, 1)])
def test_split_plan_rejects_bad_depths(head: int, tail: int) -> None:
    with pytest.raises(ConfigError):
        SplitPlan(6, head, tail)


@pytest.mark.parametrize("text", ["2", "2,2,2", "a,b", "-1,2", ""])
def test_parse_edge_layers_errors(text: str) -> None:
    with pytest.raises(ConfigError):
        parse_edge_layers(text)


def test_checkpoint_errors(tmp_path: Path, make_checkpoint: Callable[..., Path]) -> None:
    with pytest.raises(CheckpointError, match=r"config\.json"):
        Checkpoint(tmp_path)
    model = make_checkpoint("llama")
    (tmp_path / "config.json").write_text((model / "config.json").read_text())
    with pytest.raises(CheckpointError, match="safetensors"):
        Checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="lacks"):
        Checkpoint(model).read(["model.layers.99.mlp.up_proj.weight"], torch.float32)


def test_fingerprint_tracks_architecture_not_paths(make_checkpoint: Callable[..., Path]) -> None:
    a = Checkpoint(make_checkpoint("llama")).config
    b = Checkpoint(make_checkpoint("llama", sharded=True)).config
    c = Checkpoint(make_checkpoint("llama", layers=8)).config
    assert fingerprint(a) == fingerprint(b)
    assert fingerprint(a) != fingerprint(c)


def test_old_checkpoints_with_per_layer_rotary_buffers_load_as_transformers_loads_them(
    make_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    """Llama-2 era conversions store model.layers.N.self_attn.rotary_emb.inv_freq, which transformers ignores;
    the edge and the trunk refused them as unexpected tensors."""
    model = make_checkpoint("llama")
    old = shutil.copytree(model, tmp_path / "old")
    tensors = load_file(old / "model.safetensors")
    layers = Checkpoint(model).config.num_hidden_layers
    for i in range(layers):
        tensors[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = torch.rand(8)
    save_file(tensors, old / "model.safetensors", metadata={"format": "pt"})
    plan = SplitPlan(layers, 2, 2)
    edge, reference = load_edge(Checkpoint(old), plan, torch.float32), load_edge(Checkpoint(model), plan, torch.float32)
    assert all(
        torch.equal(a, b) for a, b in zip(edge.state_dict().values(), reference.state_dict().values(), strict=True)
    )
    load_trunk(Checkpoint(old), plan, torch.float32)


def test_a_single_file_is_read_before_a_stale_index(make_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    """A folder saved again as one file may keep the index of its old shards: transformers reads the single file,
    and so must the edge (it read the index, and failed on the deleted shards)."""
    model = make_checkpoint("llama")
    folder = shutil.copytree(model, tmp_path / "resaved")
    stale = {
        "metadata": {},
        "weight_map": dict.fromkeys(Checkpoint(model).tensor_names, "model-00001-of-00002.safetensors"),
    }
    (folder / "model.safetensors.index.json").write_text(json.dumps(stale))
    name = "model.layers.0.mlp.up_proj.weight"
    read = Checkpoint(folder).read([name], torch.float32)[name]
    assert torch.equal(read, Checkpoint(model).read([name], torch.float32)[name])
