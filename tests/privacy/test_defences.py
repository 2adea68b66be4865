"""Defences on tiny models: each one measurably hides tokens from a fresh probe, and off means off."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from splitspec.exceptions import ConfigError
from splitspec.models.checkpoint import Checkpoint
from splitspec.models.loading import load_full
from splitspec.models.split import SplitPlan
from splitspec.privacy.activations import cloud_view, collect_layers
from splitspec.privacy.attackers import TrainConfig
from splitspec.privacy.audit import AuditConfig, run_audit
from splitspec.privacy.corpus import CorpusWindows, corpus_windows, load_documents, split_documents
from splitspec.privacy.defence_config import DefenceConfig, parse_defence
from splitspec.privacy.defences import (
    Adversary,
    TokenProbe,
    add_send_noise,
    noise_for_tokens,
    prefix_digests,
)
from splitspec.privacy.diverge import DivergeConfig, DivergeResult, diverge
from splitspec.privacy.record import EDGE_RECORD, DivergenceRecord
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
    assert parse_defence("adv=1+cap=inf") == DefenceConfig(adversary_weight=1.0, max_scale=math.inf)
    assert parse_defence("adv=1+cap=inf").label == "adv=1+cap=inf"
    with pytest.raises(ValueError, match="max_scale"):
        parse_defence("cap=0.5")
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
    """Four edges of one tiny model, same seed and steps: plain divergence, adversarial (capped, uncapped), noisy."""
    root = tmp_path_factory.mktemp("defences")
    model = make_checkpoint("llama", layers=4)
    corpus = write_corpus(root / "corpus", docs_per_domain=4, words=200)
    common = dict(model_dir=model, head=1, tail=1, steps=30, window=16, corpus_dir=corpus)
    common |= dict(max_train_tokens=1500, max_eval_tokens=400)
    settings = {
        "none": DefenceConfig(),
        "adv": DefenceConfig(adversary_weight=5.0, adversary_classes=32),
        "adv-uncapped": DefenceConfig(adversary_weight=5.0, adversary_classes=32, max_scale=math.inf),
        "noise": DefenceConfig(noise_scale=2.0),
    }
    out: dict[str, object] = {
        name: diverge(DivergeConfig(out_dir=root / name, defence=d, **common))  # type: ignore[arg-type]
        for name, d in settings.items()
    }
    out["model"], out["corpus"] = model, corpus
    out["windows"] = corpus_windows(
        model, corpus, test_fraction=0.3, seed=0, window=16, max_train_tokens=1500, max_test_tokens=400
    )
    return out


def probe_accuracy(train_view: np.ndarray, windows: CorpusWindows, test_view: np.ndarray) -> float:
    """A new probe trained on ``train_view`` (n, q, H) of the train windows, top-1 on ``test_view`` of the test ones."""
    train, test = torch.from_numpy(train_view[:, 1:]), torch.from_numpy(test_view[:, 1:])
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


def edge_view(result: DivergeResult, tokens: np.ndarray, side: str, noise: float, seed: int) -> np.ndarray:
    """What the cloud sees on ``side`` from the diverged edge (with its send noise)."""
    return cloud_view(load_full(Checkpoint(result.checkpoint_dir), torch.float32), PLAN, tokens, noise, seed)[side]


def stock_view(published: Path, tokens: np.ndarray, side: str) -> np.ndarray:
    """The published model's state on ``side`` (what a non-adaptive attacker trains on)."""
    k = {"input": PLAN.head, "output": PLAN.num_layers - PLAN.tail}[side]
    return collect_layers(load_full(Checkpoint(published), torch.float32), tokens, [k])[k]


@pytest.mark.parametrize("side", ["input", "output"])
def test_noise_hides_tokens_from_a_fresh_probe(edges: dict[str, object], side: str) -> None:
    """Against the plain divergence (a probe retrained on the deployment reads every token), noise costs it."""
    windows = edges["windows"]
    assert isinstance(windows, CorpusWindows)
    acc = {}
    for name, noise in (("none", 0.0), ("noise", 2.0)):
        result = edges[name]
        assert isinstance(result, DivergeResult)
        train = edge_view(result, windows.train.tokens, side, noise, seed=1)
        acc[name] = probe_accuracy(train, windows, edge_view(result, windows.test.tokens, side, noise, seed=2))
    assert acc["none"] > 0.9
    assert acc["noise"] < 0.75 * acc["none"], acc


@pytest.mark.parametrize("side", ["input", "output"])
def test_adversary_hides_tokens_from_a_stock_trained_probe(
    edges: dict[str, object], make_checkpoint: Callable[..., Path], side: str
) -> None:
    """A probe trained on the published model's states (T1) reads the plain divergence, not the adversarial one.

    (Under the scale cap a probe *retrained* on the deployment's own states still reads it on this tiny model.)
    """
    windows = edges["windows"]
    assert isinstance(windows, CorpusWindows)
    train = stock_view(make_checkpoint("llama", layers=4), windows.train.tokens, side)
    acc = {}
    for name in ("none", "adv"):
        result = edges[name]
        assert isinstance(result, DivergeResult)
        acc[name] = probe_accuracy(train, windows, edge_view(result, windows.test.tokens, side, 0.0, seed=2))
    assert acc["none"] > 0.9
    assert acc["adv"] < 0.8 * acc["none"], acc


def scale_ratio(result: DivergeResult, windows: CorpusWindows, published: Path) -> dict[str, float]:
    """Mean per-token RMS of the edge's cloud view over the published model's, per side (no noise)."""
    out = {}
    for side in ("input", "output"):
        view = edge_view(result, windows.test.tokens, side, 0.0, seed=0)[:, 1:]
        ref = stock_view(published, windows.test.tokens, side)[:, 1:]
        out[side] = float((np.sqrt((view**2).mean(-1)) / np.sqrt((ref**2).mean(-1))).mean())
    return out


def test_scale_cap_stops_the_adversary_inflating_the_states(
    edges: dict[str, object], make_checkpoint: Callable[..., Path]
) -> None:
    """Uncapped, the adversary games its probes by blowing up the states' RMS; the cap holds it near c."""
    windows = edges["windows"]
    assert isinstance(windows, CorpusWindows)
    published = make_checkpoint("llama", layers=4)
    capped = scale_ratio(edges["adv"], windows, published)  # type: ignore[arg-type]
    uncapped = scale_ratio(edges["adv-uncapped"], windows, published)  # type: ignore[arg-type]
    cap = DefenceConfig().max_scale
    for side in ("input", "output"):
        assert uncapped[side] > 3 * cap, uncapped
        assert 1 / (1.2 * cap) < capped[side] < 1.2 * cap, capped


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


def test_audit_sees_the_edge_as_the_cloud_does(edges: dict[str, object], tmp_path: Path) -> None:
    """`audit --edge` attacks the noisy states the cloud receives, and refuses stock or leaky edges."""
    noisy, plain = edges["noise"], edges["none"]
    assert isinstance(noisy, DivergeResult)
    assert isinstance(plain, DivergeResult)
    model, corpus = edges["model"], edges["corpus"]
    assert isinstance(model, Path)
    assert isinstance(corpus, Path)

    def audit(edge: Path, seed: int = 0) -> dict[str, Any]:
        config = AuditConfig(
            model_dir=model,
            out_dir=tmp_path / f"audit-{edge.parent.name}-{seed}",
            depths=(1,),
            corpus_dir=corpus,
            window=16,
            max_train_tokens=320,
            max_test_tokens=96,
            seed=seed,
            attackers=("freq", "mlp"),
            train=TrainConfig(epochs=1),
            diverge_steps=0,
            edges=((1, edge),),
            bootstrap=50,
        )
        return run_audit(config)

    for result, scale in ((noisy, 2.0), (plain, 0.0)):
        info = audit(result.checkpoint_dir)["edges"]["1"]
        assert info["send_noise_scale"] == scale
        assert info["train_documents_checked"] is True
        distance = info["activation_relative_distance"]["input"]
        assert distance > 1.5 if scale else distance < 1.0  # the noise is in what the audit attacks
    record = DivergenceRecord.read(noisy.checkpoint_dir)
    assert record is not None
    assert record.train_documents
    # An audit whose test documents the edge was fitted on is refused, before any attacker trains.
    fitted = set(record.train_documents)
    seed = next(
        s for s in range(1, 50) if {d.doc_id for d in split_documents(load_documents(corpus), 0.3, s).test} & fitted
    )
    with pytest.raises(ConfigError, match="fitted on"):
        audit(noisy.checkpoint_dir, seed=seed)
    with pytest.raises(ConfigError, match="published ones"):
        audit(model)
    with pytest.raises(ConfigError, match="not among the audited depths"):
        AuditConfig(model_dir=model, out_dir=tmp_path, depths=(1,), edges=((2, model),))
    with pytest.raises(ConfigError, match="more than once"):
        AuditConfig(model_dir=model, out_dir=tmp_path, depths=(1,), edges=((1, model), (1, model)))


def tiny_audit(model: Path, corpus: Path, out: Path, depth: int, **kw: Any) -> AuditConfig:
    """A cheap audit at one depth (frequency prior and MLP), 16-token windows."""
    fields: dict[str, Any] = dict(window=16, max_train_tokens=320, max_test_tokens=96, attackers=("freq", "mlp"))
    fields |= dict(train=TrainConfig(epochs=1), diverge_steps=0, bootstrap=50) | kw
    return AuditConfig(model_dir=model, out_dir=out, depths=(depth,), corpus_dir=corpus, **fields)


def test_audit_reports_the_attacker_text_the_edge_was_fitted_on(edges: dict[str, object], tmp_path: Path) -> None:
    """The edge trained on the attacker-train documents (same split and windowing): the report says how much."""
    plain, model, corpus = edges["none"], edges["model"], edges["corpus"]
    assert isinstance(plain, DivergeResult)
    assert isinstance(model, Path)
    assert isinstance(corpus, Path)
    out = tmp_path / "audit"
    results = run_audit(tiny_audit(model, corpus, out, 1, edges=((1, plain.checkpoint_dir),)))
    overlap = results["edges"]["1"]["attacker_train_overlap"]
    record = DivergenceRecord.read(plain.checkpoint_dir)
    assert record is not None
    attacker_docs = set(results["split"]["train_documents"])
    assert overlap["documents"] == len(attacker_docs & set(record.train_documents)) > 0
    assert 0 < overlap["windows"] <= overlap["of_windows"]
    assert json.loads((out / "report.json").read_text())["edges"]["1"]["attacker_train_overlap"] == overlap
    md = (out / "report.md").read_text()
    assert f"{overlap['windows']} of {overlap['of_windows']} windows" in md
    assert "the adaptive attacker learned from the edge's states on the edge's own training text" in md
    # Keeping the attackers off the edge's documents needs documents it never saw: here it saw them all.
    with pytest.raises(ConfigError, match="too few"):
        run_audit(
            tiny_audit(
                model, corpus, tmp_path / "unseen", 1, edges=((1, plain.checkpoint_dir),), unseen_attacker_text=True
            )
        )
