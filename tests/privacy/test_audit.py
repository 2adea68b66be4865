"""Privacy audit end to end on a tiny model; activations, white-box search, divergence, weights."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from splitspec.cli import main as splitspec_main
from splitspec.edge.provenance import check_edge_weights, edge_provenance
from splitspec.exceptions import ConfigError
from splitspec.models.checkpoint import Checkpoint
from splitspec.models.kv_cache import KVCache
from splitspec.models.loading import load_edge, load_full, load_trunk
from splitspec.models.split import SplitPlan
from splitspec.privacy import cli
from splitspec.privacy.activations import collect_layers, stock_tail_top5
from splitspec.privacy.attackers import TrainConfig, whitebox_search_top5
from splitspec.privacy.audit import AuditConfig, run_audit
from splitspec.privacy.defence_config import DefenceConfig
from splitspec.privacy.diverge import DivergeConfig, diverge, write_checkpoint
from splitspec.privacy.outcomes import SeriesKey, load_outcomes
from splitspec.privacy.record import DivergenceRecord
from splitspec.privacy.weights import edge_fingerprint, edge_weight_report

torch.set_num_threads(1)

TEXT = (
    "to be or not to be that is the question whether tis nobler in the mind to suffer "
    "def main(): return print(value) for x in range(10): yield x class Split: pass"
)
WORDS = TEXT.split()


def write_corpus(root: Path, docs_per_domain: int = 4, words: int = 160) -> Path:
    rng = np.random.default_rng(0)
    for domain in ("prose", "code"):
        (root / domain).mkdir(parents=True)
        for i in range(docs_per_domain):
            text = " ".join(rng.choice(WORDS, size=words))
            (root / domain / f"doc{i}.txt").write_text(text)
    return root


def test_activations_are_what_the_cloud_sees(make_checkpoint: Callable[..., Path]) -> None:
    directory = make_checkpoint("llama", layers=6)
    full = load_full(Checkpoint(directory), torch.float32)
    tokens = np.array([[0, *range(5, 17)], [0, *range(20, 32)]])
    acts = collect_layers(full, tokens, [2, 4, 6])
    plan = SplitPlan(6, 2, 2)
    edge = load_edge(Checkpoint(directory), plan, torch.float32)
    trunk = load_trunk(Checkpoint(directory), plan, torch.float32)
    q = tokens.shape[1]
    positions, parents = torch.arange(q, dtype=torch.int32), torch.arange(-1, q - 1, dtype=torch.int32)
    for b in range(2):
        sent = edge.run_head(torch.from_numpy(tokens[b]), positions, parents, KVCache())
        returned = trunk(sent, positions, parents, KVCache())
        torch.testing.assert_close(torch.from_numpy(acts[2][b]), sent[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(torch.from_numpy(acts[4][b]), returned[0], atol=1e-5, rtol=1e-5)
        # The public tail on the returned state is the model's own next-token prediction.
        logits = edge.run_tail(returned, positions, parents, KVCache())
        top = stock_tail_top5(full, acts[4][b : b + 1], depth=2)[0]
        assert (top[:, 0] == logits.argmax(-1).numpy()).all()


def test_whitebox_search_recovers_stock_activations(make_checkpoint: Callable[..., Path]) -> None:
    directory = make_checkpoint("llama", layers=6)
    full = load_full(Checkpoint(directory), torch.float32)
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, 96, size=(3, 17))
    tokens[:, 0] = 2  # a window's first token, whatever the config's bos_token_id says
    full.config.bos_token_id = None  # a config without one (the search used to read it and fail)
    acts = collect_layers(full, tokens, [2])[2]
    cand = rng.integers(3, 96, size=(3, 16, 8))
    cand[..., 3] = tokens[:, 1:]  # the truth is among the candidates
    top = whitebox_search_top5(full, acts, 2, cand, tokens[:, 0])
    assert (top[..., 0] == tokens[:, 1:]).all()
    with pytest.raises(ValueError, match="one first token per window"):
        whitebox_search_top5(full, acts, 2, cand, tokens[:2, 0])


def test_weight_report_detects_stock_and_modified(make_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    published = make_checkpoint("llama", layers=6)
    plan = SplitPlan(6, 2, 2)
    same = edge_weight_report(published, published, plan)
    assert same.is_stock
    assert same.max_relative_difference == 0.0
    assert same.stock_layers == [0, 1, 4, 5]
    ckpt = Checkpoint(published)
    name = "model.layers.1.mlp.down_proj.weight"
    w = ckpt.read([name], torch.float32)[name]
    modified = tmp_path / "edge"
    write_checkpoint(published, modified, {name: w + 0.05 * torch.randn_like(w)})
    report = edge_weight_report(modified, published, plan)
    assert not report.is_stock
    assert report.stock_layers == [0, 4, 5]
    assert report.to_dict()["tensors"][name] > 0.01  # type: ignore[index]
    assert edge_fingerprint(modified, plan) != edge_fingerprint(published, plan)
    assert edge_fingerprint(published, plan) == edge_fingerprint(published, plan)
    # A change in a trunk layer is not the edge's business.
    trunk_name = "model.layers.3.mlp.down_proj.weight"
    tw = ckpt.read([trunk_name], torch.float32)[trunk_name]
    trunk_only = tmp_path / "trunk"
    write_checkpoint(published, trunk_only, {trunk_name: tw * 2})
    assert edge_weight_report(trunk_only, published, plan).is_stock
    with pytest.raises(ConfigError, match="not the same model"):
        edge_weight_report(make_checkpoint("llama", layers=4), published, SplitPlan(4, 1, 1))


def test_audit_end_to_end(make_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    directory = make_checkpoint("llama", layers=6)
    corpus = write_corpus(tmp_path / "corpus")
    out = tmp_path / "audit"
    config = AuditConfig(
        model_dir=directory,
        out_dir=out,
        depths=(1, 2),
        corpus_dir=corpus,
        window=32,
        max_train_tokens=640,
        max_test_tokens=192,
        test_fraction=0.25,
        train=TrainConfig(epochs=1, seq_epochs=1),
        diverge_steps=3,
        bootstrap=200,
        search_candidates=8,
    )
    results = run_audit(config)
    for name in ("report.json", "report.md", "recovery_vs_depth.png", "outcomes.csv.gz"):
        assert (out / name).is_file(), name
    report = json.loads((out / "report.json").read_text())
    split = report["split"]
    assert not set(split["train_documents"]) & set(split["test_documents"])
    seen = {(s["condition"], s["attacker"], s["side"], s["depth"]) for s in report["series"]}
    for d in (1, 2):
        for side in ("input", "output"):
            for attacker in ("nn-embed", "mlp", "bigru"):
                assert ("stock", attacker, side, d) in seen
                assert ("diverged/non-adaptive", attacker, side, d) in seen
            assert ("diverged/adaptive", "mlp", side, d) in seen
        assert ("stock", "search", "input", d) in seen
        assert ("stock", "stock-tail", "output", d) in seen
    assert ("-", "freq", "-", 0) in seen
    assert ("-", "freq-pos", "-", 0) in seen
    n = report["n_test_tokens"]
    assert n == results["n_test_tokens"]
    assert n > 0
    for s in report["series"]:
        lo, hi = s["top1"]["wilson95"]
        assert lo <= s["top1"]["rate"] <= hi
        assert s["top1"]["rate"] <= s["top5"]["rate"]
    # With stock weights the published tail gives the model's own prediction at every depth.
    by_key = {(s["condition"], s["attacker"], s["side"], s["depth"]): s for s in report["series"]}
    assert by_key[("stock", "stock-tail", "output", 1)]["top1"] == by_key[("stock", "stock-tail", "output", 2)]["top1"]
    families = {t["family"] for t in report["tests"]}
    assert {"adjacent depths", "stock vs diverged", "attacker vs frequency prior"} <= families
    for t in report["tests"]:
        assert 0.0 <= t["p_documents"] <= t["p_holm"] <= 1.0  # Holm's correction of the document-level p
        assert 0.0 <= t["p_exact_mcnemar"] <= 1.0
    assert report["edges"]["1"]["is_stock"] is False
    assert report["edges"]["2"]["is_stock"] is False
    # Per-token outcomes reload and reproduce the reported rates.
    cols, docs = load_outcomes(out / "outcomes.csv.gz")
    assert len(docs) == n
    assert set(docs) <= set(split["test_documents"])
    col = SeriesKey("stock", "mlp", "input", 1).column
    assert (cols[col] == 1).sum() == by_key[("stock", "mlp", "input", 1)]["top1"]["successes"]
    assert "Paired tests" in (out / "report.md").read_text()
    # The stored outcomes alone re-run the same tests: `audit-retest` rewrites an identical report.json.
    (out / "report.md").write_text("stale")
    assert splitspec_main(["audit-retest", "--out", str(out)]) == 0
    assert json.loads((out / "report.json").read_text()) == json.loads(json.dumps(results))
    assert "Paired tests" in (out / "report.md").read_text()
    assert splitspec_main(["audit-retest", "--out", str(tmp_path / "corpus")]) == 2  # one line: holds no audit


def test_diverge_cli_writes_loadable_private_edge(make_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    directory = make_checkpoint("llama", layers=6)
    corpus = write_corpus(tmp_path / "corpus")
    out = tmp_path / "edge"
    rc = splitspec_main(
        [
            *("diverge", "--model", str(directory), "--out", str(out), "--edge-layers", "1,1", "--steps", "3"),
            *("--corpus", str(corpus), "--rank", "4", "--max-scale", "2"),
        ]
    )
    assert rc == 0
    info = json.loads((out / "edge.json").read_text())
    assert info["defence"]["max_scale"] == 2.0
    plan = SplitPlan(6, 1, 1)
    assert info["fingerprint_sha256"] == edge_fingerprint(out / "checkpoint", plan)
    assert info["fingerprint_sha256"] != info["published_fingerprint_sha256"]
    assert info["weight_report"]["is_stock"] is False
    assert info["heldout_perplexity_before"] > 0
    assert info["heldout_perplexity_after"] > 0
    edge = load_edge(Checkpoint(out / "checkpoint"), plan, torch.float32)  # same loaders work
    assert edge.hidden_size == 64
    # Only edge layers changed: the trunk is still the published one.
    assert edge_weight_report(out / "checkpoint", directory, SplitPlan(6, 3, 2)).stock_layers == [1, 2, 4]
    # the edge client accepts the diverged checkpoint without --allow-stock-edge-weights
    assert not check_edge_weights(out / "checkpoint", plan, None, allow_stock=False).stock
    assert edge_provenance(out / "checkpoint", SplitPlan(6, 2, 2), None).stock  # record made for 1,1


def test_cli_rejects_bad_input(make_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="depths"):
        cli.parse_depths("1,x")
    with pytest.raises(ConfigError, match="DEPTH=CHECKPOINT_DIR"):
        cli.parse_edge("2:dir")
    directory = make_checkpoint("llama", layers=6)
    rc = splitspec_main(["audit", "--model", str(directory), "--depths", "5", "--out", str(tmp_path / "a")])
    assert rc == 2  # depth 5 leaves nothing for the other side in a 6-layer model
    for knob, value in (("--max-scale", "1"), ("--noise-scale", "-1"), ("--adversary-weight", "nan")):
        args = ["diverge", "--model", str(directory), "--out", str(tmp_path / "d"), knob, value]
        assert splitspec_main(args) == 2  # a one-line error, before any training
    with pytest.raises(ConfigError, match="unknown attackers"):
        AuditConfig(model_dir=directory, out_dir=tmp_path, depths=(1,), attackers=("oracle",))


def test_audit_refuses_negative_diverge_steps(
    make_checkpoint: Callable[..., Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    directory = make_checkpoint("llama", layers=6)
    with pytest.raises(ConfigError, match="diverge-steps"):
        AuditConfig(model_dir=directory, out_dir=tmp_path, depths=(1,), diverge_steps=-5)
    args = ["audit", "--model", str(directory), "--depths", "1", "--out", str(tmp_path / "a")]
    # (a corpus that does not exist: were -5 accepted, the run would stop there, on another error)
    args += ["--diverge-steps", "-5", "--corpus", str(tmp_path / "no-corpus")]
    with caplog.at_level(logging.ERROR):
        assert splitspec_main(args) == 2
    assert "--diverge-steps" in caplog.text


def test_unseen_attacker_text_keeps_the_edges_off_the_attackers_documents(
    make_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    directory = make_checkpoint("llama", layers=4)
    corpus = write_corpus(tmp_path / "corpus")
    out = tmp_path / "audit"
    config = AuditConfig(
        model_dir=directory,
        out_dir=out,
        depths=(1,),
        corpus_dir=corpus,
        window=32,
        max_train_tokens=640,
        max_test_tokens=192,
        test_fraction=0.25,
        attackers=("freq", "mlp"),
        train=TrainConfig(epochs=1),
        diverge_steps=2,
        bootstrap=50,
        unseen_attacker_text=True,
    )
    results = run_audit(config)
    attacker_docs = set(results["split"]["train_documents"])
    record = DivergenceRecord.read(out / "edges" / "d1" / "checkpoint")
    assert record is not None
    assert attacker_docs
    assert record.train_documents
    assert not attacker_docs & set(record.train_documents)
    assert not set(results["split"]["test_documents"]) & set(record.train_documents)
    overlap = results["edges"]["1"]["attacker_train_overlap"]
    assert overlap["windows"] == overlap["documents"] == 0
    assert overlap["of_windows"] > 0
    assert "0 of" in (out / "report.md").read_text()


def test_audit_refuses_an_edge_diverged_for_another_depth(make_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    """`--edge 1=DIR` with DIR diverged (and noised) at 2,2: the audit would attack h_1 with noise meant for h_2."""
    directory = make_checkpoint("llama", layers=6)
    corpus = write_corpus(tmp_path / "corpus")
    common: dict[str, Any] = dict(window=32, corpus_dir=corpus, test_fraction=0.25)
    edge = diverge(
        DivergeConfig(
            model_dir=directory,
            out_dir=tmp_path / "edge",
            head=2,
            tail=2,
            steps=1,
            max_train_tokens=320,
            max_eval_tokens=64,
            defence=DefenceConfig(noise_scale=0.5),
            **common,
        )
    )
    config = AuditConfig(
        model_dir=directory,
        out_dir=tmp_path / "audit",
        depths=(1,),
        max_train_tokens=320,
        max_test_tokens=96,
        attackers=("freq", "mlp"),
        train=TrainConfig(epochs=1),
        diverge_steps=0,
        edges=((1, edge.checkpoint_dir),),
        bootstrap=50,
        **common,
    )
    with pytest.raises(ConfigError, match="edge layers 2,2, not 1,1"):
        run_audit(config)
