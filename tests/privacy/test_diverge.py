"""`splitspec diverge` itself: what the hinges measure under send noise, every weight of an MoE edge, safe output."""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from splitspec.cli import main as splitspec_main
from splitspec.edge.provenance import edge_provenance
from splitspec.exceptions import ConfigError
from splitspec.models.checkpoint import Checkpoint
from splitspec.models.family import published_dtype, skeleton
from splitspec.models.loading import load_full
from splitspec.models.split import SplitPlan
from splitspec.privacy.activations import residual_stream, split_forward
from splitspec.privacy.defence_config import DefenceConfig
from splitspec.privacy.diverge import (
    DivergeConfig,
    add_lora,
    checkpoint_tensors,
    diverge,
    divergence_distances,
    layer_prefixes,
    write_checkpoint,
)
from splitspec.privacy.weights import edge_weight_report
from tests.conftest import save_tiny_tokenizer
from tests.families import save_family_checkpoint
from tests.privacy.test_audit import write_corpus

torch.set_num_threads(1)

PLAN = SplitPlan(4, 1, 1)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("diverge") / "corpus", docs_per_domain=3, words=120)


def small(model: Path, out: Path, corpus: Path, **kw: object) -> DivergeConfig:
    """A diverge run of a few steps on 16-token windows of ``corpus`` (edge layers 1,1)."""
    fields: dict[str, object] = dict(head=1, tail=1, window=16, corpus_dir=corpus, max_train_tokens=400)
    fields |= dict(max_eval_tokens=100, steps=2) | kw
    return DivergeConfig(model_dir=model, out_dir=out, **fields)  # type: ignore[arg-type]


def test_noise_does_not_switch_off_the_input_hinge(
    make_checkpoint: Callable[..., Path], corpus: Path, tmp_path: Path
) -> None:
    """With send noise 0.5 the input-side hinge (margin 0.5) has a gradient on the head's adapters at step 0.

    Measured on the noisy state sent up, the noise alone put the input side ~σ from stock: the hinge was
    zero from the first step and its gradient on the head's adapters too.
    """
    model_dir = make_checkpoint("llama", layers=4)
    # a small initial perturbation, so that only the noise could put the input side past the margin at step 0
    noisy = dict(defence=DefenceConfig(noise_scale=0.5), init_std=0.002)
    config = small(model_dir, tmp_path / "unused", corpus, **noisy)
    stock = load_full(Checkpoint(model_dir), torch.float32)
    model = load_full(Checkpoint(model_dir), torch.float32)
    adapters = add_lora(model, [0, 3], config)
    tokens = torch.from_numpy(np.random.default_rng(0).integers(3, 96, size=(4, 17)))
    tokens[:, 0] = 0
    with torch.no_grad():
        ref = residual_stream(stock, tokens)
    states = split_forward(model, PLAN, tokens, 0.5, torch.Generator().manual_seed(0))
    d_in, d_out = divergence_distances(model, PLAN, states, ref, 0.5)
    assert float(d_in.detach()) < config.margin  # the weights' own effect: the initial perturbation, not the noise
    assert float(d_out.detach()) < config.margin
    torch.relu(config.margin - d_in).backward()
    head = [a for name, a in adapters.items() if name.startswith("model.layers.0.")]
    assert head
    assert all(a.lora_b.grad is not None and float(a.lora_b.grad.abs().sum()) > 0 for a in head)


def test_diverge_trains_on_the_noise_free_distance(
    make_checkpoint: Callable[..., Path], corpus: Path, tmp_path: Path
) -> None:
    """The training loop's input-side distance at step 0 (what its hinge acts on) is the weights' own: small, where
    the noisy one is about σ = 0.5 whatever the weights do (at the margin: a hinge with nothing to push)."""
    config = small(
        make_checkpoint("llama", layers=4),
        tmp_path / "edge",
        corpus,
        steps=1,
        defence=DefenceConfig(noise_scale=0.5),
        init_std=0.002,
    )
    history = diverge(config).summary["history"]
    assert isinstance(history, list)
    assert history[0]["rel_in"] < 0.5 * config.margin, history


def family_checkpoint(tmp_path_factory: pytest.TempPathFactory, family: str) -> Path:
    directory = tmp_path_factory.mktemp(family)
    save_family_checkpoint(directory, family, 4, seed=3, dtype=torch.float32)
    save_tiny_tokenizer(directory)
    return directory


@pytest.fixture(scope="module", params=["qwen3-moe", "mixtral"])
def moe(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny checkpoint whose layers hold fused 3-D expert tensors and a router (transformers 5.x)."""
    return family_checkpoint(tmp_path_factory, request.param)


@pytest.mark.parametrize("family", ["qwen3-moe", "mixtral", "phi3"])
def test_diverge_moves_every_weight_matrix_of_the_edge_layers(
    family: str, corpus: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Experts (fused 3-D in memory, per expert on disk) and the router included; phi3's fused qkv and gate_up too."""
    published = family_checkpoint(tmp_path_factory, family)
    result = diverge(small(published, tmp_path_factory.mktemp("edge"), corpus))
    tensors = edge_weight_report(result.checkpoint_dir, published, PLAN).to_dict()["tensors"]
    assert isinstance(tensors, dict)
    for layer in (0, 3):  # both edge layers
        mine = {n: v for n, v in tensors.items() if n.startswith(f"model.layers.{layer}.")}
        if family != "phi3":
            assert len([n for n in mine if ".experts." in n]) == 12  # 4 experts x 3 matrices, each moved below
        matrices = [n for n in mine if "norm" not in n]
        assert len(matrices) >= 4
        assert all(mine[n] > 0.01 for n in matrices), {n: mine[n] for n in matrices if mine[n] <= 0.01}
    assert not edge_provenance(result.checkpoint_dir, PLAN, published).stock


def test_merged_experts_load_back_as_trained(moe: Path, tmp_path: Path) -> None:
    """The fused expert updates, split back per expert under the checkpoint's names, reload to the same model."""
    ckpt = Checkpoint(moe)
    model = load_full(ckpt, torch.float32)
    skel = skeleton(ckpt.config, published_dtype(ckpt.config))
    config = DivergeConfig(model_dir=moe, out_dir=tmp_path, head=1, tail=1, init_std=0.2)
    adapters = add_lora(model, [0, 3], config, layer_prefixes(skel.lm, [skel.layers[0], skel.layers[3]]))
    assert any(".experts." in n for n in adapters)
    stored = checkpoint_tensors(ckpt, skel.lm, {n: a.merged_weight() for n, a in adapters.items()})
    assert set(stored) <= set(ckpt.tensor_names)
    write_checkpoint(moe, tmp_path / "edge", stored)
    reloaded = load_full(Checkpoint(tmp_path / "edge"), torch.float32)
    tokens = torch.from_numpy(np.random.default_rng(1).integers(1, 96, size=(2, 12)))
    with torch.no_grad():
        want, got = residual_stream(model, tokens)[-1], residual_stream(reloaded, tokens)[-1]
        stock = residual_stream(load_full(ckpt, torch.float32), tokens)[-1]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)  # merged vs factored: float32 rounding
    assert float((got - stock).norm() / stock.norm()) > 0.01


def test_diverge_refuses_to_write_over_its_input(
    make_checkpoint: Callable[..., Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`--out` that is, holds or lies inside `--model` is refused before anything is written or deleted."""
    out = tmp_path / "out"
    model = out / "checkpoint"
    shutil.copytree(make_checkpoint("llama", layers=4), model)
    before = sorted(p.name for p in model.iterdir())
    for target in (out, model, model / "sub"):
        caplog.clear()
        with caplog.at_level(logging.ERROR):
            rc = splitspec_main(
                ["diverge", "--model", str(model), "--out", str(target), "--edge-layers", "1,1", "--steps", "1"]
            )
        assert rc == 2
        assert "overwrite" in caplog.text
        assert sorted(p.name for p in model.iterdir()) == before  # the input (and any noise key) survives
    with pytest.raises(ConfigError, match="overwrite"):
        diverge(DivergeConfig(model_dir=model / ".." / "checkpoint", out_dir=out, head=1, tail=1))
