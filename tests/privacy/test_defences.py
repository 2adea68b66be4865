"""Defences on tiny models: each one measurably hides tokens from a fresh probe, and off means off."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from splitspec.models.checkpoint import Checkpoint
from splitspec.models.split import SplitPlan
from splitspec.models.stack import load_full
from splitspec.privacy.activations import cloud_view, collect_layers
from splitspec.privacy.corpus import CorpusWindows, corpus_windows
from splitspec.privacy.defences import (
    Adversary,
    DefenceConfig,
    TokenProbe,
    add_send_noise,
    noise_for_tokens,
    parse_defence,
    prefix_digests,
)
from splitspec.privacy.diverge import DivergeConfig, DivergeResult, diverge
from splitspec.privacy.record import EDGE_RECORD
from tests.privacy.test_audit import write_corpus

torch.set_num_threads(1)

PLAN = SplitPlan(4, 1, 1)
HIDDEN = 64


def test_send_noise_is_calibrated_and_off_means_off() -> None:
    h = torch.randn(3, 50, HIDDEN) * torch.linspace(0.1, 10, 50)[None, :, None]  # tokens of very different scale
    assert add_send_noise(h, 0.0) is h
    for scale in (0.5, 2.0):
        noisy = add_send_noise(h, scale)
        rel = ((noisy - h).norm(dim=-1) / h.norm(dim=-1)).mean()
        assert abs(float(rel) - scale) < 0.1 * scale  # relative to each token's own RMS
    with pytest.raises(ValueError, match="noise_scale"):
        DefenceConfig(noise_scale=-1)


def test_serving_noise_is_a_keyed_function_of_the_prefix() -> None:
    """A replayed prefix gets the same noise (no averaging); another key or prefix gets other noise."""
    chain = prefix_digests(b"k" * 32, [5, 6, 7], [-1, 0, 1], b"")
    again = prefix_digests(b"k" * 32, [5, 6, 7], [-1, 0, 1], b"")
    assert chain == again
    # token 7 as a tree child of the same path has the same prefix, hence the same digest
    tree = prefix_digests(b"k" * 32, [6, 9, 7], [-1, -1, 0], chain[0])
    assert tree[2] == chain[2]
    assert tree[1] != chain[1]
    assert prefix_digests(b"j" * 32, [5], [-1], b"") != chain[:1]
    eps = noise_for_tokens(chain, HIDDEN)
    assert eps.shape == (3, HIDDEN)
    torch.testing.assert_close(eps, noise_for_tokens(again, HIDDEN))
    assert not torch.allclose(eps[0], eps[1])
    assert (
        abs(
            float(noise_for_tokens(prefix_digests(b"k" * 32, list(range(400)), [-1, *range(399)], b""), HIDDEN).std())
            - 1
        )
        < 0.05
    )


def test_parse_defence() -> None:
    assert parse_defence("none") == DefenceConfig()
    assert parse_defence("adv=2+noise=0.5") == DefenceConfig(noise_scale=0.5, adversary_weight=2.0)
    assert parse_defence("noise=1").label == "noise=1"
    for bad in ("noise", "noise=x", "adv=1+adv=2", "rot=1"):
        with pytest.raises(ValueError, match="defence"):
            parse_defence(bad)


def test_adversary_charges_the_edge_not_the_probes() -> None:
    tokens = np.random.default_rng(0).integers(0, 20, size=(4, 12))
    adv = Adversary(HIDDEN, tokens, 20, DefenceConfig(adversary_weight=1.0, adversary_classes=8, adversary_lr=1e-2))
    emb = torch.randn(20, HIDDEN)
    t = torch.from_numpy(tokens)
    for _ in range(30):
        adv.fit({"input": emb[t], "output": emb[t]}, t)
    adv.opt.zero_grad(set_to_none=True)
    view = emb[t].clone().requires_grad_(True)
    penalty = adv.penalty({"input": view}, t)
    assert float(penalty.detach()) > 0  # the probe beats the prior on a view that names the token
    penalty.backward()
    assert view.grad is not None
    assert float(view.grad.abs().sum()) > 0
    assert all(p.grad is None for p in adv.probes.parameters())
    off = Adversary(HIDDEN, tokens, 20, DefenceConfig(adversary_weight=0.0, adversary_classes=8))
    assert float(off.penalty({"input": view}, t).detach()) == 0.0


@pytest.fixture(scope="module")
def edges(make_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """Three edges of one tiny model, same seed and steps: plain divergence, adversarial, noisy."""
    root = tmp_path_factory.mktemp("defences")
    model = make_checkpoint("llama", layers=4)
    corpus = write_corpus(root / "corpus", docs_per_domain=4, words=200)
    common = dict(model_dir=model, head=1, tail=1, steps=30, window=16, corpus_dir=corpus)
    common |= dict(max_train_tokens=1500, max_eval_tokens=400)
    settings = {
        "none": DefenceConfig(),
        "adv": DefenceConfig(adversary_weight=5.0, adversary_classes=32),
        "noise": DefenceConfig(noise_scale=2.0),
    }
    out: dict[str, object] = {
        name: diverge(DivergeConfig(out_dir=root / name, defence=d, **common))  # type: ignore[arg-type]
        for name, d in settings.items()
    }
    out["windows"] = corpus_windows(
        model, corpus, test_fraction=0.3, seed=0, window=16, max_train_tokens=1500, max_test_tokens=400
    )
    return out


def fresh_probe_accuracy(result: DivergeResult, windows: CorpusWindows, side: str, noise: float) -> float:
    """A new probe trained on the edge's (noisy) cloud view of train windows, scored on test windows."""
    full = load_full(Checkpoint(result.checkpoint_dir), torch.float32)
    train = torch.from_numpy(cloud_view(full, PLAN, windows.train.tokens, noise, seed=1)[side][:, 1:])
    test = torch.from_numpy(cloud_view(full, PLAN, windows.test.tokens, noise, seed=2)[side][:, 1:])
    torch.manual_seed(0)
    probe = TokenProbe(HIDDEN, 64, 96)
    opt = torch.optim.Adam(probe.parameters(), lr=1e-2)
    x, y = train.reshape(-1, HIDDEN), torch.from_numpy(windows.train.tokens[:, 1:]).reshape(-1)
    for _ in range(150):
        loss = torch.nn.functional.cross_entropy(probe(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    pred = probe(test.reshape(-1, HIDDEN)).argmax(-1)
    return float((pred == torch.from_numpy(windows.test.tokens[:, 1:]).reshape(-1)).float().mean())


@pytest.mark.parametrize("side", ["input", "output"])
def test_defences_hide_tokens_from_a_fresh_probe(edges: dict[str, object], side: str) -> None:
    """Against the plain divergence (a fresh probe reads every token), each defence costs the probe."""
    windows = edges["windows"]
    assert isinstance(windows, CorpusWindows)
    acc = {
        name: fresh_probe_accuracy(edges[name], windows, side, noise)  # type: ignore[arg-type]
        for name, noise in (("none", 0.0), ("adv", 0.0), ("noise", 2.0))
    }
    assert acc["none"] > 0.9
    assert acc["adv"] < 0.5 * acc["none"], acc
    assert acc["noise"] < 0.75 * acc["none"], acc


def test_noise_reaches_the_record_and_the_cloud_view(edges: dict[str, object]) -> None:
    noisy, plain = edges["noise"], edges["none"]
    assert isinstance(noisy, DivergeResult)
    assert isinstance(plain, DivergeResult)
    assert json.loads((noisy.checkpoint_dir / EDGE_RECORD).read_text())["send_noise_scale"] == 2.0
    assert json.loads((plain.checkpoint_dir / EDGE_RECORD).read_text())["send_noise_scale"] == 0.0
    assert noisy.summary["defence"]["noise_scale"] == 2.0  # type: ignore[index]
    windows = edges["windows"]
    assert isinstance(windows, CorpusWindows)
    full = load_full(Checkpoint(plain.checkpoint_dir), torch.float32)
    tokens = windows.test.tokens[:2]
    clean = cloud_view(full, PLAN, tokens, 0.0)
    ref = collect_layers(full, tokens, [1, 3])
    np.testing.assert_allclose(clean["input"], ref[1], atol=1e-5)
    np.testing.assert_allclose(clean["output"], ref[3], atol=1e-4)
    sent = cloud_view(full, PLAN, tokens, 2.0)["input"]
    rel = np.linalg.norm(sent - ref[1], axis=-1) / np.linalg.norm(ref[1], axis=-1)
    assert abs(float(rel.mean()) - 2.0) < 0.2
