"""The edge refuses stock public edge weights unless told otherwise."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from splitspec.edge.provenance import check_edge_weights, edge_provenance
from splitspec.exceptions import ConfigError
from splitspec.models.split import SplitPlan
from splitspec.privacy.record import EDGE_RECORD
from splitspec.privacy.weights import edge_fingerprint

PLAN = SplitPlan(6, 2, 2)


def perturbed_copy(src: Path, dst: Path, layer: int = 0, scale: float = 0.1) -> Path:
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    name = f"model.layers.{layer}.mlp.up_proj.weight"
    tensors[name] = tensors[name] + scale * torch.randn_like(tensors[name])
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def write_record(directory: Path, published: Path) -> None:
    record = {
        "head": 2,
        "tail": 2,
        "fingerprint_sha256": edge_fingerprint(directory, PLAN),
        "published_fingerprint_sha256": edge_fingerprint(published, PLAN),
    }
    (directory / EDGE_RECORD).write_text(json.dumps(record))


def test_unproven_weights_are_refused_unless_allowed(make_checkpoint: Callable[..., Path]) -> None:
    model = make_checkpoint("llama")
    with pytest.raises(ConfigError, match="stock public edge weights"):
        check_edge_weights(model, PLAN, None, allow_stock=False)
    assert check_edge_weights(model, PLAN, None, allow_stock=True).stock


def test_comparison_with_the_published_checkpoint(make_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    published = make_checkpoint("llama")
    same = shutil.copytree(published, tmp_path / "same")
    changed = perturbed_copy(published, tmp_path / "changed")
    assert edge_provenance(same, PLAN, published).stock
    assert not edge_provenance(changed, PLAN, published).stock
    assert check_edge_weights(changed, PLAN, published, allow_stock=False).stock is False
    trunk_only = perturbed_copy(published, tmp_path / "trunk", layer=3)  # layer 3 is in the trunk
    assert edge_provenance(trunk_only, PLAN, published).stock


def test_a_tail_of_its_own_does_not_hide_stock_head_layers(
    make_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    """The cloud receives the head layers' output: with those published, anyone holding the model can invert it,
    whatever the tail is (a fine-tune of the upper layers passed as private)."""
    published = make_checkpoint("llama")
    tail_only = perturbed_copy(published, tmp_path / "tail", layer=5)  # layer 5 is the tail's
    with pytest.raises(ConfigError, match="head layers, whose output the cloud sees"):
        check_edge_weights(tail_only, PLAN, published, allow_stock=False)


def test_a_bfloat16_copy_of_the_published_weights_is_stock(
    make_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    """Rounding to bfloat16 moves a float32 tensor by about 2e-3 of its norm: still the published weights."""
    published = make_checkpoint("llama")
    copy = shutil.copytree(published, tmp_path / "bf16")
    tensors = load_file(copy / "model.safetensors")
    save_file(
        {k: v.to(torch.bfloat16) for k, v in tensors.items()}, copy / "model.safetensors", metadata={"format": "pt"}
    )
    assert edge_provenance(copy, PLAN, published).stock


def test_divergence_record_must_match_the_weights(make_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    published = make_checkpoint("llama")
    diverged = perturbed_copy(published, tmp_path / "diverged", layer=5)
    write_record(diverged, published)
    assert not edge_provenance(diverged, PLAN, None).stock
    assert edge_provenance(diverged, SplitPlan(6, 1, 1), None).stock  # record made for another split
    stock_with_record = shutil.copytree(published, tmp_path / "fake")
    write_record(stock_with_record, published)
    assert edge_provenance(stock_with_record, PLAN, None).stock  # fingerprint equals the published one
    shutil.copy(published / "model.safetensors", diverged / "model.safetensors")  # weights swapped back
    assert edge_provenance(diverged, PLAN, None).stock
    (diverged / EDGE_RECORD).write_text("{not json")
    with pytest.raises(ConfigError, match="not a valid divergence record"):
        edge_provenance(diverged, PLAN, None)
