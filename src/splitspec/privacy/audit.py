"""The privacy audit: how much of the user's text the cloud can recover from what it sees.

For each split depth d the cloud receives h_d (input side) and returns h_{L-d} (output side);
see :mod:`splitspec.privacy.activations`. The held-out corpus is split *by document* into
attacker-train and test windows; every attacker is scored on the *same* test tokens at every
depth and condition, so comparisons are paired (a document-level sign-flip test, Holm-corrected, and a
document-clustered bootstrap; exact McNemar on tokens is reported beside them as a description).

Conditions:

* ``stock`` - the edge runs the published weights; learned attackers train on stock activations
  of the attacker-train documents (anyone can compute those: the weights are public).
* ``diverged/non-adaptive`` - the edge runs privately fine-tuned layers
  (:mod:`splitspec.privacy.diverge`); the attackers are the stock-trained ones.
* ``diverged/adaptive`` - the attacker is a client of the diverged deployment (chosen plaintext):
  it sends the attacker-train documents through it and trains on what the cloud saw. An edge built
  here is fitted on the same attacker-train documents (same split and windowing) unless
  ``unseen_attacker_text`` halves them between the attackers and the edges; the report states, per
  edge, how many attacker-train windows come from documents the edge was fitted on.

Outputs (under ``out_dir``): ``report.json``, ``report.md``, ``recovery_vs_depth.png`` and
``outcomes.csv.gz`` (per test token, per measured series: rank of the true token in the top-5
guesses, 0 = not in the top-5), so anyone can re-run the tests.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from splitspec.exceptions import ConfigError
from splitspec.models.checkpoint import Checkpoint
from splitspec.models.loading import load_full
from splitspec.models.split import SplitPlan
from splitspec.models.stack import FullModel
from splitspec.paths import display_path
from splitspec.privacy import attackers as atk
from splitspec.privacy.activations import cloud_view, collect_layers, stock_tail_top5
from splitspec.privacy.audit_stats import analyse
from splitspec.privacy.corpus import (
    DEFAULT_CORPUS,
    CorpusWindows,
    Document,
    corpus_windows,
    load_documents,
    split_documents,
)
from splitspec.privacy.diverge import DivergeConfig, diverge
from splitspec.privacy.outcomes import AuditData, SeriesKey, ranks_of, read_audit_data
from splitspec.privacy.record import DivergenceRecord
from splitspec.privacy.report import write_report
from splitspec.privacy.weights import WeightReport, edge_fingerprint, edge_weight_report
from splitspec.run_info import run_environment

log = logging.getLogger(__name__)

ALL_ATTACKERS = ("freq", "freq-pos", "nn-embed", "mlp", "bigru", "search", "stock-tail")
LEARNED = ("mlp", "bigru")


@dataclass(frozen=True)
class AuditConfig:
    """One audit run."""

    model_dir: Path  # the published checkpoint
    out_dir: Path  # report files land here
    depths: tuple[int, ...]  # split depths d (edge layers on the side measured)
    corpus_dir: Path = DEFAULT_CORPUS  # <domain>/*.txt documents
    window: int = 128  # tokens per window (plus BOS)
    max_train_tokens: int = 24_000  # cap on attacker-train tokens
    max_test_tokens: int = 6_000  # cap on test tokens (same tokens at every depth)
    test_fraction: float = 0.3  # per-domain fraction of documents held out for testing
    seed: int = 0  # document split, training, bootstrap
    attackers: tuple[str, ...] = ALL_ATTACKERS
    train: atk.TrainConfig = field(default_factory=atk.TrainConfig)  # inverter training
    diverge_steps: int = 100  # LoRA steps per diverged edge; 0 = no stock-vs-diverged comparison
    edges: tuple[tuple[int, Path], ...] = ()  # pre-built diverged checkpoints, (depth, dir)
    bootstrap: int = 2000  # document-clustered bootstrap resamples
    search_candidates: int = 16  # top-K tokens (of the GRU, else the MLP) the white-box search tries per position
    # attackers train only on documents no diverged edge was fitted on: the attacker-train documents are halved
    # by document, one half for the attackers and the rest for the edges built here (a given --edge must record
    # its training documents; the attackers then avoid them). Off: edges built here train on the attacker's text.
    unseen_attacker_text: bool = False

    def __post_init__(self) -> None:
        unknown = set(self.attackers) - set(ALL_ATTACKERS)
        if unknown:
            raise ConfigError(f"unknown attackers {sorted(unknown)}; choose from {', '.join(ALL_ATTACKERS)}")
        if self.diverge_steps < 0:
            raise ConfigError(f"--diverge-steps must be 0 (no diverged edges built) or more, got {self.diverge_steps}")
        if not self.depths or any(d < 1 for d in self.depths):
            raise ConfigError(f"depths must be positive integers, got {self.depths}")
        if self.max_train_tokens < self.window or self.max_test_tokens < self.window:
            raise ConfigError(f"token caps must be at least one window ({self.window} tokens)")
        edge_depths = [d for d, _ in self.edges]
        repeated = sorted({d for d in edge_depths if edge_depths.count(d) > 1})
        if repeated:
            raise ConfigError(f"--edge names depth {repeated[0]} more than once")
        unused = sorted(set(edge_depths) - set(self.depths))
        if unused:
            raise ConfigError(
                f"--edge {unused[0]}=DIR: depth {unused[0]} is not among the audited depths {self.depths}"
            )


def _depth_plans(n_layers: int, depths: tuple[int, ...]) -> None:
    for d in depths:
        if d > n_layers - 2:
            raise ConfigError(
                f"depth {d} is too deep for a {n_layers}-layer model: the other side needs at least one edge "
                f"layer and the trunk at least one, so depths must be at most {n_layers - 2}"
            )


@dataclass
class _AuditRun:
    """What the steps of one audit share: the corpus, the stock model and its activations, the inverters."""

    config: AuditConfig
    n_layers: int
    depths: tuple[int, ...]  # sorted, distinct split depths
    corpus: CorpusWindows
    data: AuditData
    stock: FullModel
    sides: dict[int, dict[str, int]]  # depth -> {side: stream index k the cloud sees}
    stock_train: dict[int, np.ndarray]  # k -> (n_train, W+1, H) stock activations
    stock_test: dict[int, np.ndarray]  # k -> (n_test, W+1, H) stock activations
    inverters: dict[tuple[str, int, str], atk.TrainedInverter] = field(default_factory=dict)
    edges: dict[int, dict[str, object]] = field(default_factory=dict)  # depth -> diverged edge summary
    # depth -> a given --edge's weight comparison, made by check_given_edge and used again by attack_diverged
    # (it reads every edge tensor of both checkpoints: once is enough)
    weight_reports: dict[int, WeightReport] = field(default_factory=dict)
    # documents the edges built here must not be fitted on (the attackers' own, with --unseen-attacker-text)
    edge_excludes: tuple[str, ...] = ()

    @property
    def train_targets(self) -> np.ndarray:
        return self.corpus.train.tokens[:, 1:]  # (n_train, W)

    def inverter(self, tag: str, k: int, kind: str, acts: np.ndarray) -> atk.TrainedInverter:
        """The ``kind`` inverter trained on ``acts`` (tagged ``tag``) at stream index k, trained once."""
        key = (tag, k, kind)
        if key not in self.inverters:
            self.inverters[key] = atk.train_inverter(
                kind, acts[:, 1:], self.train_targets, self.config.train, desc=f"{kind} {tag} h{k}"
            )
        return self.inverters[key]

    def record(self, key: SeriesKey, top5: np.ndarray) -> None:
        self.data.ranks[key] = ranks_of(top5, self.data.targets)

    def attack(
        self,
        condition: str,
        d: int,
        test_acts: dict[int, np.ndarray],
        train_tag: str,
        train_acts: dict[int, np.ndarray],
    ) -> None:
        """Every attacker on one condition's test activations at depth d (learned ones trained on train_acts)."""
        attackers = self.config.attackers
        for side, k in self.sides[d].items():
            acts = test_acts[k]
            if "nn-embed" in attackers:
                embedding = self.stock.embed_tokens.weight.detach()
                self.record(SeriesKey(condition, "nn-embed", side, d), atk.nearest_embedding(acts[:, 1:], embedding))
            for kind in LEARNED:
                if kind in attackers:
                    inv = self.inverter(train_tag, k, kind, train_acts[k])
                    self.record(SeriesKey(condition, kind, side, d), inv.predict_top5(acts[:, 1:]))
            if side == "input" and "search" in attackers:
                proposer = "bigru" if "bigru" in attackers else "mlp"
                inv = self.inverter(train_tag, k, proposer, train_acts[k])
                cand = inv.predict_topk(acts[:, 1:], self.config.search_candidates)
                self.record(
                    SeriesKey(condition, "search", side, d),
                    atk.whitebox_search_top5(self.stock, acts, k, cand, self.corpus.test.tokens[:, 0]),
                )
            if side == "output" and "stock-tail" in attackers:
                top5 = stock_tail_top5(self.stock, acts, d)[:, :-1]  # position j-1 guesses token j
                self.record(SeriesKey(condition, "stock-tail", side, d), top5)

    def diverged_edge(self, d: int, given: dict[int, Path]) -> tuple[Path, dict[str, object]] | None:
        """The diverged checkpoint for depth d (given, or built here) and what is known of it; None if none."""
        config = self.config
        if 2 * d > self.n_layers - 1 and d not in given:
            log.info("depth %d: no diverged edge (split %d,%d leaves no trunk)", d, d, d)
            self.edges[d] = {"skipped": f"split ({d},{d}) leaves no trunk in a {self.n_layers}-layer model"}
            return None
        if d in given:
            edge_dir = Path(given[d])
            return edge_dir, {"checkpoint": display_path(edge_dir), "built_here": False}
        if config.diverge_steps <= 0:
            return None
        res = diverge(
            DivergeConfig(
                model_dir=config.model_dir,
                out_dir=config.out_dir / "edges" / f"d{d}",
                head=d,
                tail=d,
                steps=config.diverge_steps,
                corpus_dir=config.corpus_dir,
                test_fraction=config.test_fraction,
                seed=config.seed,
                window=config.window,
                exclude_documents=self.edge_excludes,
            )
        )
        return res.checkpoint_dir, {"checkpoint": str(res.checkpoint_dir), "built_here": True, **res.summary}

    def attacker_text_overlap(self, record: DivergenceRecord | None) -> dict[str, int] | None:
        """How much attacker-train text the edge was fitted on: windows (and documents) of the attacker-train
        side whose document is among the record's training documents; None when the record names none."""
        if record is None or not record.train_documents:
            return None
        fitted = set(record.train_documents)
        train = self.corpus.train
        docs = [train.doc_ids[i] for i in train.doc_index]
        used = set(docs)
        return {
            "windows": sum(d in fitted for d in docs),
            "of_windows": len(docs),
            "documents": len(used & fitted),
            "of_documents": len(used),
        }

    def attack_diverged(self, d: int, edge_dir: Path, info: dict[str, object]) -> None:
        """Both diverged conditions at depth d: stock-trained attackers, then attackers retrained on it."""
        plan = SplitPlan(self.n_layers, d, d)
        wr = self.weight_reports.pop(d, None) or edge_weight_report(edge_dir, self.config.model_dir, plan)
        info["is_stock"] = wr.is_stock
        info["head_is_stock"] = wr.head_is_stock
        info["max_relative_weight_difference"] = wr.max_relative_difference
        info.setdefault("fingerprint_sha256", edge_fingerprint(edge_dir, plan))
        record = DivergenceRecord.read(edge_dir)
        noise = record.send_noise_scale if record is not None else 0.0
        info["send_noise_scale"] = noise
        info["train_documents_checked"] = bool(record is not None and record.train_documents) or bool(
            info.get("built_here")
        )
        # the adaptive attacker trains on the diverged edge's states of the attacker-train text: say how much of
        # that text the edge was itself fitted on
        info["attacker_train_overlap"] = self.attacker_text_overlap(record)
        self.edges[d] = info
        edge_model = load_full(Checkpoint(edge_dir), torch.float32)
        # What the cloud sees from this deployment: with the edge's send noise, as the serving edge adds it.
        div_test = self._cloud_view(edge_model, plan, self.corpus.test.tokens, noise, self.config.seed)
        div_train = self._cloud_view(edge_model, plan, self.corpus.train.tokens, noise, self.config.seed + 1)
        info["activation_relative_distance"] = {
            side: float(
                np.mean(
                    np.linalg.norm(div_test[k] - self.stock_test[k], axis=-1)
                    / np.linalg.norm(self.stock_test[k], axis=-1)
                )
            )
            for side, k in self.sides[d].items()
        }
        # Non-adaptive: the stock-trained attackers (and the white-box ones) on diverged activations.
        self.attack("diverged/non-adaptive", d, div_test, "stock", self.stock_train)
        # Adaptive: retrain on what the cloud saw from the diverged edge on chosen text.
        for side, k in self.sides[d].items():
            for kind in LEARNED:
                if kind in self.config.attackers:
                    inv = self.inverter(f"diverged-d{d}", k, kind, div_train[k])
                    self.record(SeriesKey("diverged/adaptive", kind, side, d), inv.predict_top5(div_test[k][:, 1:]))

    def _cloud_view(
        self, model: FullModel, plan: SplitPlan, tokens: np.ndarray, noise: float, seed: int
    ) -> dict[int, np.ndarray]:
        """{stream index: states} the cloud receives (input side, with send noise) and returns (output side)."""
        view = cloud_view(model, plan, tokens, noise, seed)
        return {k: view[side] for side, k in self.sides[plan.head].items()}

    def check_given_edge(self, d: int, edge_dir: Path) -> None:
        """Refuse a ``--edge`` that is the published model, or one fitted on this audit's test documents."""
        where = f"--edge {d}={display_path(edge_dir)}"
        record = DivergenceRecord.read(edge_dir)
        if record is not None and (record.head, record.tail) != (d, d):
            raise ConfigError(
                f"{where}: its divergence record is for edge layers {record.head},{record.tail}, not {d},{d}: "
                f"at depth {d} the audit would attack states the edge was not diverged (nor noised) for; give "
                f"an edge diverged with --edge-layers {d},{d}"
            )
        report = edge_weight_report(edge_dir, self.config.model_dir, SplitPlan(self.n_layers, d, d))
        self.weight_reports[d] = report
        if report.is_stock:
            raise ConfigError(
                f"{where}: its edge layers are the published ones (a stock edge, measured as 'stock' anyway); "
                "give the checkpoint `splitspec diverge` wrote"
            )
        tested = {self.corpus.test.doc_ids[i] for i in self.corpus.test.doc_index}
        fitted = set(record.train_documents) if record is not None else set()
        leaked = sorted(tested & fitted)
        if leaked:
            raise ConfigError(
                f"{where}: its edge layers were fitted on {len(leaked)} of this audit's test documents "
                f"(e.g. {leaked[0]}); audit with the seed and test fraction it was diverged with, or rebuild it"
            )
        if not fitted:
            log.warning("%s: no record of its training documents; train/test separation not checked", where)

    def summary(self) -> dict[str, object]:
        """What the report says besides the measured series: model, split, edges, inverter losses."""
        split, train, test = self.corpus.split, self.corpus.train, self.corpus.test
        return {
            "model_dir": display_path(self.config.model_dir),
            "num_layers": self.n_layers,
            "vocab_size": self.data.vocab_size,
            "depths": list(self.depths),
            "stream_index": {str(d): self.sides[d] for d in self.depths},
            "split": {
                "train_documents": [d.doc_id for d in split.train],
                "test_documents": [d.doc_id for d in split.test],
                "train_tokens": train.n_targets,
                "test_tokens": test.n_targets,
                "train_documents_used": len(set(train.doc_index.tolist())),
                "test_documents_used": len(set(test.doc_index.tolist())),
                "test_classes_seen_in_train": float(np.isin(self.data.targets, np.unique(self.train_targets)).mean()),
            },
            "edges": {str(k): v for k, v in self.edges.items()},
            "inverters": {f"{t}|h{k}|{kind}": inv.final_loss for (t, k, kind), inv in self.inverters.items()},
            "config": _jsonable(asdict(self.config)),
            "environment": run_environment(),
        }


def _baselines(config: AuditConfig, corpus: CorpusWindows, data: AuditData) -> None:
    """The frequency priors (independent of depth and side)."""
    train, test = corpus.train, corpus.test
    train_targets, targets = train.tokens[:, 1:], data.targets
    if "freq" in config.attackers:
        prior = atk.frequency_prior(train_targets, targets.shape)
        data.ranks[SeriesKey("-", "freq", "-", 0)] = ranks_of(prior, targets)
    if "freq-pos" in config.attackers:
        offsets = np.arange(config.window)
        train_pos, test_pos = train.start[:, None] + offsets, test.start[:, None] + offsets
        prior = atk.positional_prior(train_targets, train_pos, test_pos)
        data.ranks[SeriesKey("-", "freq-pos", "-", 0)] = ranks_of(prior, targets)


def _start(config: AuditConfig) -> _AuditRun:
    """Load the corpus, score the baselines, run the stock model over it: everything before the attacks."""
    ckpt = Checkpoint(config.model_dir)
    n_layers = int(ckpt.config.num_hidden_layers)
    depths = tuple(sorted(set(config.depths)))
    _depth_plans(n_layers, depths)
    attacker_excludes: tuple[str, ...] = ()
    edge_excludes: tuple[str, ...] = ()
    if config.unseen_attacker_text:
        attacker_excludes, edge_excludes = _unseen_attacker_text(config, n_layers, depths)
    corpus = corpus_windows(
        config.model_dir,
        config.corpus_dir,
        test_fraction=config.test_fraction,
        seed=config.seed,
        window=config.window,
        max_train_tokens=config.max_train_tokens,
        max_test_tokens=config.max_test_tokens,
        exclude_train=attacker_excludes,
    )
    train, test = corpus.train, corpus.test
    data = AuditData(test, test.tokens[:, 1:], int(ckpt.config.vocab_size))
    log.info(
        "audit: %d attacker-train tokens from %d documents, %d test tokens from %d documents",
        train.n_targets,
        len(set(train.doc_index.tolist())),
        test.n_targets,
        len(set(test.doc_index.tolist())),
    )
    sides = {d: {"input": d, "output": n_layers - d} for d in depths}  # stream index k per side
    ks = sorted({k for s in sides.values() for k in s.values()})
    _baselines(config, corpus, data)
    stock = load_full(Checkpoint(config.model_dir), torch.float32)
    stock_train = collect_layers(stock, train.tokens, ks)
    stock_test = collect_layers(stock, test.tokens, ks)
    run = _AuditRun(config, n_layers, depths, corpus, data, stock, sides, stock_train, stock_test)
    run.edge_excludes = edge_excludes
    return run


def _unseen_attacker_text(
    config: AuditConfig, n_layers: int, depths: tuple[int, ...]
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(documents the attackers must not train on, documents the edges built here must not train on).

    The attackers avoid every training document of a given ``--edge`` (its record must name them). When edges
    are built here too, the remaining attacker-train documents are halved by document (per domain, in a seeded
    hash order): the attackers get one half, the edges are kept off it.
    """
    split = split_documents(load_documents(config.corpus_dir), config.test_fraction, config.seed)
    seen: set[str] = set()
    for d, edge_dir in config.edges:
        record = DivergenceRecord.read(edge_dir)
        if record is None or not record.train_documents:
            raise ConfigError(
                f"--unseen-attacker-text: --edge {d}={display_path(edge_dir)} records no training documents, so the "
                "attackers' text cannot be kept apart from the edge's"
            )
        seen |= set(record.train_documents)
    unseen = [doc for doc in split.train if doc.doc_id not in seen]
    given = {d for d, _ in config.edges}
    builds = config.diverge_steps > 0 and any(d not in given and 2 * d <= n_layers - 1 for d in depths)
    attackers = unseen
    if builds:
        by_domain: dict[str, list[Document]] = {}
        for doc in unseen:
            by_domain.setdefault(doc.domain, []).append(doc)
        attackers = []
        for group in by_domain.values():
            group.sort(key=lambda doc: hashlib.sha256(f"{config.seed}:attacker:{doc.doc_id}".encode()).hexdigest())
            attackers += group[::2]
    if not attackers or (builds and len(attackers) == len(unseen)):
        raise ConfigError(
            f"--unseen-attacker-text: {len(unseen)} attacker-train document(s) no given edge was fitted on; too few to "
            + ("share between the attackers and the edges built here" if builds else "train the attackers on")
        )
    keep = {doc.doc_id for doc in attackers}
    attacker_excludes = tuple(sorted(doc.doc_id for doc in split.train if doc.doc_id not in keep))
    return attacker_excludes, tuple(sorted(keep))


def run_audit(config: AuditConfig) -> dict[str, Any]:
    """Collect activations, run every attacker in every condition, write the report files."""
    t0 = time.monotonic()
    torch.manual_seed(config.seed)
    run = _start(config)
    for d, edge_dir in config.edges:  # before any attacker trains
        run.check_given_edge(d, edge_dir)
    for d in run.depths:
        run.attack("stock", d, run.stock_test, "stock", run.stock_train)
        log.info("stock depth %d done (%.0f s)", d, time.monotonic() - t0)
    if config.diverge_steps > 0 or config.edges:
        given = dict(config.edges)
        for d in run.depths:
            edge = run.diverged_edge(d, given)
            if edge is not None:
                run.attack_diverged(d, *edge)
                log.info("diverged depth %d done (%.0f s)", d, time.monotonic() - t0)
    run.data.extra = run.summary()
    results = analyse(run.data, config)
    results["seconds"] = time.monotonic() - t0
    write_report(run.data, results, config.out_dir)
    log.info("audit written to %s (%.0f s)", config.out_dir, results["seconds"])
    return results


ANALYSED = ("n_test_tokens", "uniform", "series", "tests", "alpha")  # the keys :func:`analyse` writes


def retest(out_dir: Path) -> dict[str, Any]:
    """Re-run an audit's statistics from its ``report.json`` and ``outcomes.csv.gz``; rewrites the report.

    Nothing is re-measured: the per-token outcomes are the audit's. For reports written before a change to
    the tests (e.g. the document-level test that replaced McNemar's as the basis of ``significant``).
    """
    report = out_dir / "report.json"
    if not report.is_file() or not (out_dir / "outcomes.csv.gz").is_file():
        raise ConfigError(f"{display_path(out_dir)} holds no audit (report.json and outcomes.csv.gz)")
    old = json.loads(report.read_text())
    settings = old["config"]
    config = AuditConfig(
        model_dir=Path(settings["model_dir"]),
        out_dir=out_dir,
        depths=tuple(settings["depths"]),
        seed=int(settings["seed"]),
        bootstrap=int(settings["bootstrap"]),
    )
    series = [SeriesKey(s["condition"], s["attacker"], s["side"], int(s["depth"])) for s in old["series"]]
    try:
        data = read_audit_data(
            out_dir / "outcomes.csv.gz", int(old["vocab_size"]), old["split"]["test_documents"], series
        )
    except ValueError as e:
        raise ConfigError(f"{display_path(out_dir)}: {e}") from e
    if data.targets.size != old["n_test_tokens"]:
        raise ConfigError(f"outcomes.csv.gz holds {data.targets.size} tokens, report.json {old['n_test_tokens']}")
    data.extra = {k: v for k, v in old.items() if k not in ANALYSED}
    results = analyse(data, config)
    write_report(data, results, out_dir, outcomes=False)
    return results


def _jsonable(obj: object) -> object:
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, Path):
        return display_path(obj)
    return obj
