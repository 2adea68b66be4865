"""The ``splitspec audit`` and ``splitspec diverge`` subcommands.

    splitspec audit --model DIR --depths 1,2,3,4 --out DIR [--corpus DIR] [--max-tokens N]
        [--max-test-tokens N] [--seed S] [--attackers freq,mlp,...] [--epochs E] [--seq-epochs E]
        [--diverge-steps N] [--edge D=DIR ...] [--unseen-attacker-text]
    splitspec audit-retest --out DIR
    splitspec diverge --model DIR --out DIR --edge-layers 2,2 [--rank R] [--steps N] [--seed S]
        [--noise-scale S] [--adversary-weight W] [--max-scale C]

The main CLI wires these in with :func:`register`; each subparser sets ``run`` to a function
``(args) -> int``. ``python -m splitspec.privacy.cli audit ...`` runs it stand-alone.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from splitspec.arguments import MODEL_HELP, model_dir, set_threads
from splitspec.exceptions import ConfigError
from splitspec.privacy.defence_config import DEFAULT_DEFENCE

log = logging.getLogger(__name__)


def parse_depths(text: str) -> tuple[int, ...]:
    """``"1,2,3"`` -> (1, 2, 3), sorted and unique, with a clear error otherwise."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ConfigError(f"--depths must be positive integers separated by commas (e.g. 1,2,3,4), got {text!r}")
    return tuple(sorted({int(p) for p in parts}))


def parse_edge(text: str) -> tuple[int, Path]:
    """``"2=out/edges/d2/checkpoint"`` -> (2, Path(...))."""
    depth, sep, path = text.partition("=")
    if not sep or not depth.strip().isdigit() or not path:
        raise ConfigError(f"--edge must look like DEPTH=CHECKPOINT_DIR, got {text!r}")
    return int(depth), Path(path)


def _positive(name: str, value: int) -> int:
    if value < 1:
        raise ConfigError(f"{name} must be at least 1, got {value}")
    return value


def _run_audit(args: argparse.Namespace) -> int:
    from splitspec.privacy.attackers import TrainConfig
    from splitspec.privacy.audit import ALL_ATTACKERS, AuditConfig, run_audit
    from splitspec.privacy.corpus import DEFAULT_CORPUS

    set_threads(args.threads)
    attackers = tuple(a.strip() for a in args.attackers.split(",") if a.strip()) if args.attackers else ALL_ATTACKERS
    config = AuditConfig(
        model_dir=args.model,
        out_dir=args.out,
        depths=parse_depths(args.depths),
        corpus_dir=args.corpus or DEFAULT_CORPUS,
        window=_positive("--window", args.window),
        max_train_tokens=_positive("--max-tokens", args.max_tokens),
        max_test_tokens=_positive("--max-test-tokens", args.max_test_tokens),
        seed=args.seed,
        attackers=attackers,
        train=TrainConfig(
            epochs=_positive("--epochs", args.epochs),
            seq_epochs=_positive("--seq-epochs", args.seq_epochs),
            seed=args.seed,
        ),
        diverge_steps=args.diverge_steps,  # AuditConfig refuses a negative count
        edges=tuple(parse_edge(e) for e in args.edge or []),
        unseen_attacker_text=args.unseen_attacker_text,
    )
    results = run_audit(config)
    summary = {
        "out": str(args.out),
        "n_test_tokens": results["n_test_tokens"],
        "seconds": round(float(results["seconds"]), 1),
    }
    print(json.dumps(summary))
    return 0


def _run_retest(args: argparse.Namespace) -> int:
    from splitspec.privacy.audit import retest

    results = retest(args.out)
    significant = sum(bool(t["significant"]) for t in results["tests"])
    print(json.dumps({"out": str(args.out), "tests": len(results["tests"]), "significant": significant}))
    return 0


def _run_diverge(args: argparse.Namespace) -> int:
    from splitspec.models.split import parse_edge_layers
    from splitspec.privacy.corpus import DEFAULT_CORPUS
    from splitspec.privacy.defence_config import DefenceConfig
    from splitspec.privacy.diverge import DivergeConfig, diverge

    set_threads(args.threads)
    head, tail = parse_edge_layers(args.edge_layers)
    try:
        defence = DefenceConfig(
            noise_scale=args.noise_scale, adversary_weight=args.adversary_weight, max_scale=args.max_scale
        )
    except ValueError as exc:  # the knobs' own range checks, as a one-line CLI error
        raise ConfigError(f"diverge: {exc}") from None
    result = diverge(
        DivergeConfig(
            model_dir=args.model,
            out_dir=args.out,
            head=head,
            tail=tail,
            rank=_positive("--rank", args.rank),
            steps=_positive("--steps", args.steps),
            corpus_dir=args.corpus or DEFAULT_CORPUS,
            seed=args.seed,
            defence=defence,
        )
    )
    print(
        json.dumps(
            {
                "checkpoint": str(result.checkpoint_dir),
                "fingerprint_sha256": result.fingerprint,
                "heldout_perplexity_before": round(result.ppl_before, 3),
                "heldout_perplexity_after": round(result.ppl_after, 3),
                "defence": result.summary["defence"],
            }
        )
    )
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``audit`` and ``diverge`` to the main CLI's subparsers."""
    audit = sub.add_parser(
        "audit",
        help="measure token recovery from what the cloud sees, per split depth",
        description="Token-recovery audit of split inference: both directions, several attackers, "
        "paired statistics across depths, stock vs diverged edge weights.",
    )
    audit.add_argument("--model", type=model_dir, required=True, help="the published checkpoint: " + MODEL_HELP)
    audit.add_argument("--depths", default="1,2,3,4", help="split depths to audit, e.g. 1,2,3,4")
    audit.add_argument("--out", type=Path, required=True, help="report directory")
    audit.add_argument("--corpus", type=Path, help="directory of <domain>/*.txt documents (default: shipped held-out)")
    audit.add_argument("--max-tokens", type=int, default=24_000, help="attacker-train token cap (default 24000)")
    audit.add_argument("--max-test-tokens", type=int, default=6_000, help="test token cap (default 6000)")
    audit.add_argument("--window", type=int, default=128, help="tokens per window (default 128)")
    audit.add_argument("--seed", type=int, default=0, help="document split / training / bootstrap seed")
    audit.add_argument(
        "--attackers", help="comma list (default all): freq,freq-pos,nn-embed,mlp,bigru,search,stock-tail"
    )
    audit.add_argument("--epochs", type=int, default=3, help="training epochs of the MLP inverter (default 3)")
    audit.add_argument("--seq-epochs", type=int, default=6, help="training epochs of the GRU inverter (default 6)")
    audit.add_argument(
        "--diverge-steps",
        type=int,
        default=100,
        help="LoRA steps per diverged edge (one per depth d with a valid d,d split); 0 = stock only",
    )
    audit.add_argument(
        "--edge", action="append", metavar="D=DIR", help="use a pre-built diverged checkpoint for depth D"
    )
    audit.add_argument(
        "--unseen-attacker-text",
        action="store_true",
        help="train the attackers only on documents no diverged edge was fitted on (the edges built here get the "
        "other half of the attacker-train documents; a given --edge must record its own). Default: edges built "
        "here train on the attacker-train text too, and the report says how much of it they saw",
    )
    audit.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    audit.set_defaults(run=_run_audit)

    re = sub.add_parser(
        "audit-retest",
        help="re-run an audit's paired tests from its stored per-token outcomes",
        description="Recompute the statistics of an audit directory (report.json + outcomes.csv.gz) with this "
        "version's tests, and rewrite report.json, report.md and the plot; nothing is re-measured.",
    )
    re.add_argument("--out", type=Path, required=True, help="the audit's report directory")
    re.set_defaults(run=_run_retest)

    div = sub.add_parser(
        "diverge",
        help="fine-tune the edge layers away from the published weights (LoRA, frozen trunk)",
        description="Write a private edge checkpoint whose edge layers differ from the published ones "
        "while keeping held-out perplexity; prints its fingerprint.",
    )
    div.add_argument("--model", type=model_dir, required=True, help="the published checkpoint: " + MODEL_HELP)
    div.add_argument("--out", type=Path, required=True, help="output directory (checkpoint/ + edge.json)")
    div.add_argument("--edge-layers", default="2,2", metavar="HEAD,TAIL", help="edge layers (default 2,2)")
    div.add_argument("--rank", type=int, default=8, help="LoRA rank (default 8)")
    div.add_argument("--steps", type=int, default=120, help="optimiser steps (default 120)")
    div.add_argument("--corpus", type=Path, help="local text: <domain>/*.txt (default: shipped held-out, train side)")
    div.add_argument("--seed", type=int, default=0, help="seed")
    div.add_argument(
        "--noise-scale",
        type=float,
        default=DEFAULT_DEFENCE.noise_scale,
        help="send-noise defence: std of the noise on the state sent up, relative to each token's RMS; the edge "
        f"layers train with it and the serving edge adds it (default {DEFAULT_DEFENCE.noise_scale:g}; 0 = off)",
    )
    div.add_argument(
        "--adversary-weight",
        type=float,
        default=DEFAULT_DEFENCE.adversary_weight,
        help="adversarial divergence: weight of the in-the-loop token probes' hinge "
        f"(default {DEFAULT_DEFENCE.adversary_weight:g}; 0 = off)",
    )
    div.add_argument(
        "--max-scale",
        type=float,
        default=DEFAULT_DEFENCE.max_scale,
        help="scale cap: the edge is charged for sending or receiving states whose RMS strays beyond this factor of "
        f"the published model's on the same tokens (default {DEFAULT_DEFENCE.max_scale:g}; inf = off)",
    )
    div.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    div.set_defaults(run=_run_diverge)
