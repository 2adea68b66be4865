"""The privacy-utility frontier: each defence setting's perplexity cost against T1/T2/T3 recovery.

For one model, split depth d (edge layers d,d) and seed:

1. the held-out corpus is split by document into attacker-train and test windows; attacker-train is
   split again by document into *public* text (the T1 attacker trains on the published model's
   view of it, with labels) and *traffic* (the users' text the deployment processes: T2 sees only
   its activations, T3 also its tokens);
2. the ``stock`` point runs the published weights (T2 and T3 are no stronger than T1 there: anyone
   can compute labelled pairs with public weights);
3. every defence setting trains a diverged edge (:func:`splitspec.privacy.diverge.diverge`), then
   measures held-out perplexity (with the send noise) and, on the *same* test tokens, top-1/top-5
   recovery from what the cloud sees on each side:

   * T1 (non-adaptive): the stock-trained inverter (``config.inverter``); on the input side also the white-box search
     with the published layers; on the output side also the published tail (next-token guess);
   * T2 (adaptive, no labels): :func:`~splitspec.privacy.adaptive.self_train` and
     :func:`~splitspec.privacy.adaptive.align` on the traffic's activations;
   * T3 (chosen plaintext): an inverter trained on the traffic's labelled deployed activations.

Each point records Wilson intervals and, per tier, the document-clustered bootstrap of the
difference from the stock point (paired: same test tokens), and every attacker's per-token top-1
outcomes (``outcomes``: packed bits, plus the test document of each window) so any two points of a
seed can be compared with paired tests later (:func:`paired_difference`). Points are handed to ``on_point`` as
soon as they are measured, so an interrupted run still leaves the finished ones.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from splitspec.models.checkpoint import Checkpoint
from splitspec.models.loading import load_full
from splitspec.models.split import SplitPlan
from splitspec.paths import display_path
from splitspec.privacy import attackers as atk
from splitspec.privacy.activations import cloud_view, collect_layers, stock_tail_top5
from splitspec.privacy.adaptive import Traffic, align, self_train
from splitspec.privacy.corpus import DEFAULT_CORPUS, Windows, corpus_windows
from splitspec.privacy.defence_config import DefenceConfig
from splitspec.privacy.diverge import DivergeConfig, diverge, perplexity
from splitspec.privacy.outcomes import pack_hits, unpack_hits
from splitspec.privacy.stats import PairedDifference, cluster_bootstrap_diff, paired_difference, wilson_interval

log = logging.getLogger(__name__)

TIERS = ("T1", "T2", "T3")


@dataclass(frozen=True)
class FrontierConfig:
    """One model, one depth, one seed, several defence settings."""

    model_dir: Path  # the published checkpoint
    out_dir: Path  # diverged edges land under out_dir/edges
    depth: int  # edge layers on each side (split d,d)
    seed: int = 0  # document split, edge training, attackers, noise
    settings: tuple[DefenceConfig, ...] = (DefenceConfig(),)  # defence settings (each trains one edge)
    corpus_dir: Path = DEFAULT_CORPUS
    window: int = 128  # tokens per window (plus BOS)
    max_train_tokens: int = 48_000  # attacker-train cap, split by document into public and traffic
    max_test_tokens: int = 6_000  # same test tokens for every point
    test_fraction: float = 0.3  # per-domain fraction of documents held out for testing
    diverge_steps: int = 120  # edge training steps per setting
    train: atk.TrainConfig = field(default_factory=atk.TrainConfig)  # inverter training (T1, T2, T3)
    search_candidates: int = 8  # candidates per position of the white-box search (T1, input side)
    self_train_rounds: int = 1  # pseudo-labelling rounds of the T2 self-training attacker
    inverter: str = "mlp"  # learned inverter of every tier: "mlp" (cheap) or "bigru" (~5 points stronger, ~10x dearer)
    bootstrap: int = 1000  # document-clustered bootstrap resamples


def split_public_traffic(windows: Windows, seed: int) -> tuple[Windows, Windows]:
    """Split attacker-train windows by document into (public, traffic), balancing window counts."""
    docs = np.unique(windows.doc_index)
    rng = np.random.default_rng(seed)
    counts = {int(d): int((windows.doc_index == d).sum()) for d in docs}
    sides: tuple[list[int], list[int]] = ([], [])
    totals = [0, 0]
    for d in sorted(docs.tolist(), key=lambda d: (-counts[d], rng.random())):
        side = 0 if totals[0] <= totals[1] else 1
        sides[side].append(d)
        totals[side] += counts[d]

    def take(keep: list[int]) -> Windows:
        rows = np.isin(windows.doc_index, keep)
        return Windows(windows.tokens[rows], windows.doc_index[rows], windows.doc_ids, windows.start[rows])

    return take(sides[0]), take(sides[1])


def _rates(hits: np.ndarray) -> dict[str, Any]:
    n, s = int(hits.size), int(hits.sum())
    return {"rate": s / n, "wilson95": list(wilson_interval(s, n)), "successes": s, "n": n}


def _ranks(top5: np.ndarray, targets: np.ndarray) -> np.ndarray:
    match = top5 == targets[..., None]
    return np.where(match.any(-1), match.argmax(-1) + 1, 0).astype(np.int8)


@dataclass
class _Shared:
    """What every point of one (model, depth, seed) run reuses."""

    plan: SplitPlan
    ks: dict[str, int]  # stream index per side
    public: Windows
    traffic: Windows
    test: Windows
    clusters: np.ndarray  # (n*W,) document of each test token
    stock_model: Any
    t1: dict[str, atk.TrainedInverter]  # per side
    stock_best: dict[str, np.ndarray] = field(default_factory=dict)  # per side: top-1 hits of the best T1 on stock


def _tier_of(attacker: str) -> str:
    return attacker.split("-", 1)[0].upper()


def _point(
    shared: _Shared,
    config: FrontierConfig,
    label: str,
    ranks: dict[str, dict[str, np.ndarray]],
    extra: dict[str, Any],
) -> dict[str, Any]:
    """Rates, per-tier best and paired differences from the stock point, for one setting's ranks."""
    sides: dict[str, Any] = {}
    for side, by_attacker in ranks.items():
        attackers = {a: {"top1": _rates(r == 1), "top5": _rates(r > 0)} for a, r in by_attacker.items()}
        best: dict[str, Any] = {}
        for tier in TIERS:
            allowed = TIERS[: TIERS.index(tier) + 1]  # a tier can run every attack of the tiers below it
            names = [a for a in by_attacker if _tier_of(a) in allowed]
            if not names:
                continue
            name = max(names, key=lambda a: attackers[a]["top1"]["rate"])
            hits = (by_attacker[name] == 1).ravel()
            entry: dict[str, Any] = {"attacker": name, **attackers[name]["top1"]}
            if side in shared.stock_best:
                ci = cluster_bootstrap_diff(
                    hits, shared.stock_best[side], shared.clusters, config.bootstrap, config.seed
                )
                entry["minus_stock"] = {"diff": ci.diff, "bootstrap95": [ci.low, ci.high]}
            best[tier] = entry
        sides[side] = {"attackers": attackers, "best": best}
    outcomes = {
        "encoding": "top-1 hit per test token (window-major), numpy packbits, base64",
        "n": int(shared.clusters.size),
        "window_docs": shared.test.doc_index.tolist(),  # document of each test window (the bootstrap's clusters)
        # the same by name: one document tested under several seeds is one cluster when seeds are pooled
        "window_doc_ids": [shared.test.doc_ids[i] for i in shared.test.doc_index.tolist()],
        "sides": {side: {a: pack_hits(r == 1) for a, r in by_attacker.items()} for side, by_attacker in ranks.items()},
    }
    return {
        "model": display_path(config.model_dir),
        "model_name": config.model_dir.name,
        "depth": config.depth,
        "seed": config.seed,
        "setting": label,
        "sides": sides,
        "outcomes": outcomes,
        **extra,
    }


def point_hits(point: dict[str, Any], side: str, tier: str) -> np.ndarray:
    """(tokens,) top-1 hits of the strongest attacker of ``tier`` on ``side`` of a point with outcomes."""
    attacker = point["sides"][side]["best"][tier]["attacker"]
    return unpack_hits(point["outcomes"]["sides"][side][attacker], int(point["outcomes"]["n"]))


def point_clusters(point: dict[str, Any]) -> np.ndarray:
    """(tokens,) test document of each token of a point with outcomes: its name where the point records names
    (comparable across seeds), else its index in that seed's split."""
    named = point["outcomes"].get("window_doc_ids")
    docs = np.asarray(named) if named is not None else np.asarray(point["outcomes"]["window_docs"], dtype=np.int64)
    n = int(point["outcomes"]["n"])
    if n % docs.size:
        raise ValueError(f"{n} outcomes do not split into {docs.size} equal windows")
    return np.repeat(docs, n // docs.size)


def compare_points(
    a: list[dict[str, Any]], b: list[dict[str, Any]], side: str, tier: str, resamples: int = 2000
) -> PairedDifference | None:
    """Paired difference (A - B) of the tier's strongest attacker, pooled over the seeds both have outcomes for.

    ``a`` and ``b`` are one setting's points each (any seeds, one model); None when no seed pairs up.
    """
    by_seed = {p["seed"]: p for p in b if "outcomes" in p}
    pairs = [(p, by_seed[p["seed"]]) for p in a if "outcomes" in p and p["seed"] in by_seed]
    if not pairs:
        return None
    for pa, pb in pairs:
        if pa["outcomes"]["window_docs"] != pb["outcomes"]["window_docs"]:
            raise ValueError(f"seed {pa['seed']}: {pa['setting']} and {pb['setting']} were tested on different tokens")
    named = all("window_doc_ids" in p["outcomes"] for pair in pairs for p in pair)
    return paired_difference(
        [point_hits(pa, side, tier) for pa, _ in pairs],
        [point_hits(pb, side, tier) for _, pb in pairs],
        [point_clusters(pa) for pa, _ in pairs],
        resamples,
        same_across_runs=named,
    )


def run_frontier(
    config: FrontierConfig, on_point: Callable[[dict[str, Any]], None] | None = None
) -> list[dict[str, Any]]:
    """Measure the stock point and every defence setting; returns (and streams) the points."""
    t0 = time.monotonic()
    torch.manual_seed(config.seed)
    ckpt = Checkpoint(config.model_dir)
    n_layers = int(ckpt.config.num_hidden_layers)
    plan = SplitPlan(n_layers, config.depth, config.depth)
    corpus = corpus_windows(
        config.model_dir,
        config.corpus_dir,
        test_fraction=config.test_fraction,
        seed=config.seed,
        window=config.window,
        max_train_tokens=config.max_train_tokens,
        max_test_tokens=config.max_test_tokens,
    )
    public, traffic = split_public_traffic(corpus.train, config.seed)
    test = corpus.test
    targets = test.tokens[:, 1:]
    ks = {"input": plan.head, "output": n_layers - plan.tail}
    stock = load_full(ckpt, torch.float32)
    bos = int(test.tokens[0, 0])
    log.info(
        "frontier %s d=%d seed %d: public %d tokens, traffic %d, test %d",
        config.model_dir.name,
        config.depth,
        config.seed,
        public.n_targets,
        traffic.n_targets,
        test.n_targets,
    )
    pub_acts = collect_layers(stock, public.tokens, ks.values())
    train_cfg = atk.TrainConfig(**{**asdict(config.train), "seed": config.seed})
    t1 = {
        side: atk.train_inverter(
            config.inverter, pub_acts[k][:, 1:], public.tokens[:, 1:], train_cfg, desc=f"T1 {side}"
        )
        for side, k in ks.items()
    }
    clusters = np.repeat(test.doc_index[:, None], targets.shape[1], axis=1).ravel()
    shared = _Shared(plan, ks, public, traffic, test, clusters, stock, t1)
    floor = atk.frequency_prior(public.tokens[:, 1:], targets.shape)
    floor_hits = {"top1": _rates(floor[..., 0] == targets), "top5": _rates((floor == targets[..., None]).any(-1))}
    ppl_stock = perplexity(stock, test)
    base_extra = {
        "tokens": {"public": public.n_targets, "traffic": traffic.n_targets, "test": test.n_targets},
        "frequency_floor": floor_hits,
        "ppl_stock": ppl_stock,
    }
    points: list[dict[str, Any]] = []

    def emit(point: dict[str, Any]) -> None:
        point["elapsed_s"] = time.monotonic() - t0
        points.append(point)
        if on_point is not None:
            on_point(point)

    def t1_ranks(view: dict[str, np.ndarray]) -> dict[str, dict[str, np.ndarray]]:
        out: dict[str, dict[str, np.ndarray]] = {"input": {}, "output": {}}
        for side in ks:
            out[side][f"t1-{config.inverter}"] = _ranks(t1[side].predict_top5(view[side][:, 1:]), targets)
        cand = t1["input"].predict_topk(view["input"][:, 1:], config.search_candidates)
        out["input"]["t1-search"] = _ranks(
            atk.whitebox_search_top5(stock, view["input"], ks["input"], cand, test.tokens[:, 0]), targets
        )
        out["output"]["t1-stock-tail"] = _ranks(stock_tail_top5(stock, view["output"], config.depth)[:, :-1], targets)
        return out

    # The stock point: the published weights on the edge.
    stock_test = collect_layers(stock, test.tokens, ks.values())
    ranks = t1_ranks({side: stock_test[k] for side, k in ks.items()})
    for side, by_attacker in ranks.items():
        best = max(by_attacker.values(), key=lambda r: float((r == 1).mean()))
        shared.stock_best[side] = (best == 1).ravel()
    emit(_point(shared, config, "stock", ranks, {**base_extra, "ppl": ppl_stock, "ppl_cost": 0.0}))
    log.info("stock point done (%.0f s)", time.monotonic() - t0)

    def public_view(side: str) -> Callable[[np.ndarray], np.ndarray]:
        return lambda tokens: collect_layers(stock, tokens, [ks[side]])[ks[side]]

    for setting in config.settings:
        t_set = time.monotonic()
        res = diverge(
            DivergeConfig(
                model_dir=config.model_dir,
                out_dir=config.out_dir
                / "edges"
                / f"{config.model_dir.name}-d{config.depth}-s{config.seed}-{setting.label}",
                head=config.depth,
                tail=config.depth,
                steps=config.diverge_steps,
                corpus_dir=config.corpus_dir,
                test_fraction=config.test_fraction,
                seed=config.seed,
                window=config.window,
                max_eval_tokens=config.max_test_tokens,
                defence=setting,
            )
        )
        edge = load_full(Checkpoint(res.checkpoint_dir), torch.float32)
        sigma = setting.noise_scale
        view_test = cloud_view(edge, plan, test.tokens, sigma, seed=10_000 + config.seed)
        view_traffic = cloud_view(edge, plan, traffic.tokens, sigma, seed=20_000 + config.seed)
        ranks = t1_ranks(view_test)
        for side in ks:
            seen = Traffic(view_traffic[side][:, 1:])  # activations only: T2 never gets the traffic's tokens
            t2s = self_train(t1[side], seen, train_cfg, config.self_train_rounds)
            ranks[side]["t2-selftrain"] = _ranks(t2s.predict_top5(view_test[side][:, 1:]), targets)
            t2a = align(t1[side], seen, public_view(side), bos)
            ranks[side]["t2-align"] = _ranks(t2a.predict_top5(view_test[side][:, 1:]), targets)
            t3 = atk.train_inverter(
                config.inverter, view_traffic[side][:, 1:], traffic.tokens[:, 1:], train_cfg, desc=f"T3 {side}"
            )
            ranks[side][f"t3-{config.inverter}"] = _ranks(t3.predict_top5(view_test[side][:, 1:]), targets)
        cost = res.ppl_after / ppl_stock - 1.0
        extra = {
            **base_extra,
            "defence": asdict(setting),
            "ppl": res.ppl_after,
            "ppl_cost": cost,
            "edge_seconds": res.summary["seconds"],
            "point_seconds": time.monotonic() - t_set,
        }
        emit(_point(shared, config, setting.label, ranks, extra))
        log.info(
            "%s done: ppl %.2f (%+.1f%%), %.0f s",
            setting.label,
            res.ppl_after,
            100 * cost,
            time.monotonic() - t_set,
        )
    return points
