"""SpecFed top-K compression, teacher-forced on held-out text: aggregation bias, drift, bytes.

Two workers (by default the demo ``base`` and ``draft`` models: two different LLMs sharing one
tokenizer) score held-out documents teacher-forced; the drafter (default: ``draft``) provides the
draft law q. For every temperature T, kept fraction K/|V| and reconstruction (renorm, residual),
each worker's law p_i = softmax(logits / T) is cut to its top-K, sent through the real wire codec
(exp-Golomb ids, quantized probabilities: :mod:`splitspec.federated.codec`), rebuilt and
aggregated with equal weights. Per position:

* Δ = ‖p − p̂‖₁ between the exact aggregate p and the rebuilt one p̂ (aggregation bias);
* Σ w_i ε_i with ε_i = ‖p_i − p̃_i‖₁ = τ_i + η_i: the tail mass τ_i outside worker i's top-K plus
  the quantization error η_i of the kept values; Σ w_i τ_i alone as well;
* the bound 2 Σ w_i ε_i;
* α = Σ min(p, q), α̂ = Σ min(p̂, q) and the drift |α − α̂| against ½Δ and against Σ w_i ε_i;
* bytes of the top-K bit stream per position and worker, quantized and with float16 values,
  against the dense float16 law (2·|V| bytes).

The bounds are checked at every position (quantized codec: Δ ≤ 2Σwε and |α − α̂| ≤ ½Δ; float32
codec: the paper's Δ ≤ 2Σwτ with the bare tail mass) and the run fails if any is violated. Writes
``specfed_eval.json``, ``specfed_eval.md`` and PNG plots to ``benchmarks/results/specfed/``.

    python benchmarks/specfed_eval.py                         # demo models, ~2 minutes on 1 core
    python benchmarks/specfed_eval.py --worker DIR --worker DIR --drafter DIR --windows 2
    python benchmarks/specfed_eval.py --plot-only                # redraw the PNG from the JSON
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

from splitspec.decoding.local import LocalSequence
from splitspec.federated.codec import decode_topk, encode_topk
from splitspec.federated.lm import load_model
from splitspec.federated.topk import TopKPolicy, bound_report, select_topk, true_residual_mass
from splitspec.models.stack import FullModel
from splitspec.paths import display_path
from splitspec.protocol.fed import SCORES_HEADER_SIZE
from splitspec.run_info import run_environment

log = logging.getLogger("specfed_eval")

REPO = Path(__file__).resolve().parents[1]
ASSETS = REPO / "src" / "splitspec" / "assets"
FRACTIONS = (0.001, 0.01, 0.1, 1.0)  # K / |V|
TEMPERATURES = (0.8, 1.0, 1.2)
METHODS = ("renorm", "residual")
TOLERANCE = 1e-5  # float slack on every bound check (float32 arithmetic over 8k-entry sums)


def load_windows(
    tokenizer: Any, domains: list[str], docs: int, windows: int, length: int
) -> list[tuple[str, list[int]]]:
    """Up to ``windows`` windows of ``length`` tokens from each of the first ``docs`` held-out documents.

    Windows never overlap (no position counts twice): a document too short for ``windows`` of them gives
    as many as fit.
    """
    out: list[tuple[str, list[int]]] = []
    for domain in domains:
        files = sorted((ASSETS / "corpus" / "heldout" / domain).glob("*.txt"))[:docs]
        for path in files:
            ids = list(tokenizer.encode(path.read_text(errors="replace")))
            for start in window_starts(len(ids), windows, length):
                out.append((f"{domain}/{path.stem}@{start}", ids[start : start + length]))
    return out


def window_starts(tokens: int, windows: int, length: int) -> list[int]:
    """Starts of up to ``windows`` non-overlapping windows of ``length`` in ``tokens`` tokens, spread evenly
    (at least ``length`` apart); those that would run past the end are left out."""
    if tokens < length:
        return []
    step = max(length, (tokens - length) // max(1, windows))
    return [w * step for w in range(windows) if w * step + length <= tokens]


def logits_of(model: FullModel, ids: list[int]) -> torch.Tensor:
    """(L-1, V) float32 logits predicting tokens 1..L-1 of ``ids`` (teacher forcing, one forward from empty)."""
    return LocalSequence(model).run(ids[:-1])


ADAPTIVE_RULES = ("fixed", "round_mean", "position_mean", "position_max")
ROUND = 5  # positions per round (γ + 1 with γ = 4) for the per-round adaptive rule


def adaptive_comparison(law: torch.Tensor, k: int) -> dict[str, dict[str, float]]:
    """Fixed K against adaptive K on the same positions, matched round by round (ROUND positions).

    Per round, with τ_j the residual mass fixed K leaves at position j: ``round_mean`` keeps the
    fewest tokens whose mean residual over the round is <= mean τ (``--epsilon-scope round``);
    ``position_mean`` holds every position to mean τ; ``position_max`` holds every position to
    max τ, the worst case fixed K guarantees. Sums of K, stream bytes, τ and transmitted ε.
    """
    out = {rule: {"k": 0.0, "bytes": 0.0, "tau": 0.0, "epsilon": 0.0, "positions": 0.0} for rule in ADAPTIVE_RULES}
    vocab = law.shape[1]
    for start in range(0, law.shape[0], ROUND):
        rows = law[start : start + ROUND]
        fixed = select_topk(rows, TopKPolicy(k=k))
        tau = true_residual_mass(rows, fixed).double()
        policies = {
            "fixed": TopKPolicy(k=k),
            "round_mean": TopKPolicy(target_epsilon=max(0.0, float(tau.mean())), scope="round", max_k=vocab),
            "position_mean": TopKPolicy(target_epsilon=max(0.0, float(tau.mean())), max_k=vocab),
            "position_max": TopKPolicy(target_epsilon=max(0.0, float(tau.max())), max_k=vocab),
        }
        for rule, policy in policies.items():
            topk = fixed if rule == "fixed" else select_topk(rows, policy)
            stream = encode_topk(rows, topk)
            back = decode_topk(stream, rows.shape[0], vocab)
            acc = out[rule]
            acc["k"] += float(topk.counts.sum())
            acc["bytes"] += len(stream)
            acc["tau"] += float(true_residual_mass(rows, topk).double().sum())
            acc["epsilon"] += float(back.transmitted_epsilon().double().sum())
            acc["positions"] += rows.shape[0]
    return out


def evaluate(args: argparse.Namespace) -> dict[str, Any]:
    workers = [load_model(d) for d in args.worker]
    drafter = load_model(args.drafter)
    fps = {m.tokenizer_fingerprint for m in [*workers, drafter]}
    vocabs = {m.vocab_size for m in [*workers, drafter]}
    if len(fps) != 1 or len(vocabs) != 1:
        raise SystemExit(f"models must share tokenizer and vocabulary: {fps} {vocabs}")
    vocab = vocabs.pop()
    weights = [1.0 / len(workers)] * len(workers)
    windows = load_windows(drafter.tokenizer, args.domains, args.docs, args.windows, args.length)
    if not windows:
        raise SystemExit("no held-out window long enough")
    log.info("%d windows of %d tokens, |V| = %d, %d workers", len(windows), args.length, vocab, len(workers))

    keys = [(t, f, m) for t in TEMPERATURES for f in FRACTIONS for m in METHODS]
    acc: dict[tuple[float, float, str], dict[str, list[float]]] = {
        key: {
            n: [] for n in ("delta", "weps", "wtail", "bound", "alpha", "alpha_hat", "drift", "ratio", "dratio", "over")
        }
        for key in keys
    }
    bytes_acc: dict[tuple[float, float], list[float]] = {(t, f): [] for t in TEMPERATURES for f in FRACTIONS}
    f16_acc: dict[tuple[float, float], list[float]] = {(t, f): [] for t in TEMPERATURES for f in FRACTIONS}
    k1 = max(1, round(0.01 * vocab))
    adaptive: dict[float, dict[str, dict[str, float]]] = {
        t: {r: dict.fromkeys(("k", "bytes", "tau", "epsilon", "positions"), 0.0) for r in ADAPTIVE_RULES}
        for t in TEMPERATURES
    }
    violations: dict[tuple[float, float, str], int] = dict.fromkeys(keys, 0)
    paper_violations: dict[tuple[float, float, str], int] = dict.fromkeys(keys, 0)
    examples: list[str] = []
    positions = 0
    t0 = time.perf_counter()
    for name, ids in windows:
        worker_logits = [logits_of(w.model, ids) for w in workers]
        draft_logits = logits_of(drafter.model, ids)
        positions += draft_logits.shape[0]
        for t in TEMPERATURES:
            laws = [torch.softmax(lg / t, -1) for lg in worker_logits]
            q = torch.softmax(draft_logits / t, -1)
            for law in laws:
                for rule, figures in adaptive_comparison(law, k1).items():
                    for key, value in figures.items():
                        adaptive[t][rule][key] += value
            for f in FRACTIONS:
                k = max(1, round(f * vocab))
                coded, exact = [], []
                for law in laws:
                    topk = select_topk(law, TopKPolicy(k=k))
                    stream = encode_topk(law, topk, "quantized")
                    bytes_acc[(t, f)].append(len(stream) / law.shape[0])
                    f16_acc[(t, f)].append(len(encode_topk(law, topk, "float16")) / law.shape[0])
                    coded.append(decode_topk(stream, law.shape[0], vocab))
                    exact.append(decode_topk(encode_topk(law, topk, "float32"), law.shape[0], vocab))
                for m in METHODS:
                    rep = bound_report(laws, coded, weights, m, draft=q, tolerance=TOLERANCE)  # type: ignore[arg-type]
                    a = acc[(t, f, m)]
                    drift = rep.drift
                    if drift is None or rep.alpha is None or rep.alpha_hat is None:
                        raise RuntimeError("a bound report with a draft carries drift, alpha and alpha_hat")
                    a["delta"] += rep.delta.tolist()
                    a["weps"] += rep.weighted_epsilon.tolist()
                    a["wtail"] += rep.weighted_tail.tolist()
                    a["over"] += (drift - rep.weighted_epsilon).tolist()
                    a["bound"] += rep.bound.tolist()
                    a["alpha"] += rep.alpha.tolist()
                    a["alpha_hat"] += rep.alpha_hat.tolist()
                    a["drift"] += drift.tolist()
                    a["ratio"] += (rep.delta / rep.bound.clamp_min(1e-12)).tolist()
                    a["dratio"] += (drift / (0.5 * rep.delta).clamp_min(1e-12)).tolist()
                    found = rep.violations()
                    violations[(t, f, m)] += len(found)
                    examples += [f"{name} T={t} K/V={f} {m}: {v}" for v in found[:2]]
                    rep32 = bound_report(laws, exact, weights, m, tolerance=TOLERANCE)  # type: ignore[arg-type]
                    paper = int((rep32.delta > 2 * rep32.weighted_tail + TOLERANCE).sum())
                    paper_violations[(t, f, m)] += paper
                    if paper:
                        examples.append(f"{name} T={t} K/V={f} {m}: float32 Δ > 2Σwτ at {paper} positions")
        log.info("%s done (%.0f s)", name, time.perf_counter() - t0)

    rows = []
    for t, f, m in keys:
        a = acc[(t, f, m)]
        n = len(a["delta"])
        mean = {key: sum(v) / n for key, v in a.items()}
        k = max(1, round(f * vocab))
        b = bytes_acc[(t, f)]
        rows.append(
            {
                "temperature": t,
                "k_fraction": f,
                "k": k,
                "reconstruct": m,
                "positions": n,
                "mean_delta": mean["delta"],
                "mean_weighted_epsilon": mean["weps"],
                "two_weighted_epsilon": 2 * mean["weps"],
                "mean_weighted_tail": mean["wtail"],
                "max_drift_minus_weighted_epsilon": max(a["over"]),
                "mean_bound": mean["bound"],
                "max_delta_over_bound": max(a["ratio"]),
                "mean_alpha": mean["alpha"],
                "mean_alpha_hat": mean["alpha_hat"],
                "alpha_drift_of_means": abs(mean["alpha"] - mean["alpha_hat"]),
                "mean_abs_drift": mean["drift"],
                "max_drift_over_half_delta": max(a["dratio"]),
                "bytes_per_position_per_worker": sum(b) / len(b),
                "float16_values_bytes_per_position_per_worker": sum(f16_acc[(t, f)]) / len(b),
                "dense_float16_bytes": 2 * vocab,
                "violations": violations[(t, f, m)],
                "paper_bound_violations_float32": paper_violations[(t, f, m)],
            }
        )
    return {
        **run_environment(),
        "host": platform.node(),
        "workers": [display_path(d, REPO) for d in args.worker],
        "drafter": display_path(args.drafter, REPO),
        "weights": weights,
        "vocab_size": vocab,
        "windows": [n for n, _ in windows],
        "window_tokens": args.length,
        "positions": positions,
        "frame_overhead_bytes_5_positions": SCORES_HEADER_SIZE,
        "elapsed_s": time.perf_counter() - t0,
        "rows": rows,
        "adaptive_k": k1,
        "adaptive": [
            {
                "temperature": t,
                "rule": rule,
                "mean_k": a["k"] / a["positions"],
                "bytes_per_position_per_worker": a["bytes"] / a["positions"],
                "mean_tau": a["tau"] / a["positions"],
                "mean_epsilon": a["epsilon"] / a["positions"],
            }
            for t in TEMPERATURES
            for rule, a in adaptive[t].items()
        ],
        "violation_examples": examples[:20],
        "all_bounds_hold": all(r["violations"] == 0 and r["paper_bound_violations_float32"] == 0 for r in rows),
    }


def markdown(result: dict[str, Any]) -> str:
    lines = [
        "# SpecFed top-K compression, teacher-forced on held-out text",
        "",
        f"Workers: {', '.join(result['workers'])} (equal weights); drafter: {result['drafter']}; "
        f"|V| = {result['vocab_size']}; {result['positions']} positions from {len(result['windows'])} windows of "
        f"{result['window_tokens']} tokens. Ids exp-Golomb coded, probabilities quantized (ρ = 0.05); "
        "ε = τ + η (tail mass plus quantization error), bound = 2Σwε. "
        f"Dense float16 law: {2 * result['vocab_size']} B. "
        f"A FedScores frame adds {result['frame_overhead_bytes_5_positions']} B of header per round.",
        "",
        "| T | K/\\|V\\| | K | recon | mean Δ | mean Σwτ | mean Σwε | 2·mean Σwε | max Δ/bound | mean α | mean α̂ "
        "| \\|ᾱ−ᾱ̂\\| | mean \\|α−α̂\\| | max \\|α−α̂\\|/(½Δ) | max (\\|α−α̂\\| − Σwε) "
        "| B/pos/worker (float16 values) | ratio to dense f16 | violations (quantized / f32 paper) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['temperature']} | {100 * r['k_fraction']:g}% | {r['k']} | {r['reconstruct']} "
            f"| {r['mean_delta']:.4f} | {r['mean_weighted_tail']:.4f} | {r['mean_weighted_epsilon']:.4f} "
            f"| {r['two_weighted_epsilon']:.4f} "
            f"| {r['max_delta_over_bound']:.3f} | {r['mean_alpha']:.4f} | {r['mean_alpha_hat']:.4f} "
            f"| {r['alpha_drift_of_means']:.4f} | {r['mean_abs_drift']:.4f} | {r['max_drift_over_half_delta']:.3f} "
            f"| {r['max_drift_minus_weighted_epsilon']:.2e} "
            f"| {r['bytes_per_position_per_worker']:.0f} ({r['float16_values_bytes_per_position_per_worker']:.0f}) "
            f"| 1/{r['dense_float16_bytes'] / r['bytes_per_position_per_worker']:.0f} "
            f"| {r['violations']} / {r['paper_bound_violations_float32']} |"
        )
    lines += ["", f"All bounds hold at every position: **{result['all_bounds_hold']}**."]
    lines += [
        "",
        f"## Adaptive K against fixed K = {result['adaptive_k']} (1 %) on identical positions",
        "",
        f"Rounds of {ROUND} positions; τ = residual mass fixed K leaves. `round_mean`: fewest tokens with the round's "
        "mean residual <= mean τ (`--epsilon-scope round`); `position_mean`: every position <= mean τ; "
        "`position_max`: every position <= max τ (the worst case fixed K guarantees). Quantized codec; "
        "ε = transmitted ‖p − p̃‖₁. Per worker and position.",
        "",
        "| T | rule | mean K | mean τ | mean ε | B/pos/worker | ratio to dense f16 |",
        "|---|---|---|---|---|---|---|",
    ]
    dense = 2 * result["vocab_size"]
    for a in result["adaptive"]:
        lines.append(
            f"| {a['temperature']} | {a['rule']} | {a['mean_k']:.1f} | {a['mean_tau']:.4f} | {a['mean_epsilon']:.4f} "
            f"| {a['bytes_per_position_per_worker']:.0f} | 1/{dense / a['bytes_per_position_per_worker']:.0f} |"
        )
    if result["violation_examples"]:
        lines += ["", "Violations:", *[f"- {v}" for v in result["violation_examples"]]]
    return "\n".join(lines) + "\n"


def plots(result: dict[str, Any], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for t in TEMPERATURES:
        for m, style in zip(METHODS, ("-", "--"), strict=True):
            sel = [r for r in rows if r["temperature"] == t and r["reconstruct"] == m]
            x = [100 * r["k_fraction"] for r in sel]
            axes[0].plot(x, [r["mean_delta"] for r in sel], style, marker="o", label=f"Δ {m} T={t}")
            axes[1].plot(x, [r["alpha_drift_of_means"] for r in sel], style, marker="o", label=f"{m} T={t}")
        sel = [r for r in rows if r["temperature"] == t and r["reconstruct"] == "renorm"]
        x = [100 * r["k_fraction"] for r in sel]
        axes[0].plot(x, [r["two_weighted_epsilon"] for r in sel], ":", color="black", alpha=0.5)
        axes[1].plot(x, [r["mean_weighted_epsilon"] for r in sel], ":", color="black", alpha=0.5)
    sel = [r for r in rows if r["temperature"] == 1.0 and r["reconstruct"] == "renorm"]
    axes[2].plot(
        [100 * r["k_fraction"] for r in sel],
        [r["bytes_per_position_per_worker"] for r in sel],
        marker="o",
        label="quantized",
    )
    axes[2].plot(
        [100 * r["k_fraction"] for r in sel],
        [r["float16_values_bytes_per_position_per_worker"] for r in sel],
        "--",
        marker="s",
        label="float16 values",
    )
    axes[2].axhline(2 * result["vocab_size"], color="red", linestyle=":", label="dense float16")
    axes[2].axhline(2 * result["vocab_size"] / 100, color="gray", linestyle=":", label="1/100 of dense float16")
    axes[0].set_title("aggregation bias Δ (dotted: 2·mean Σwε)")
    axes[1].set_title("acceptance drift |ᾱ − ᾱ̂| (dotted: mean Σwε)")
    axes[2].set_title("top-K bit stream, bytes / position / worker (T = 1)")
    for ax in axes:
        ax.set_xscale("log")
        ax.set_xlabel("K / |V| (%)")
        ax.grid(True, alpha=0.3)
    for ax in axes[:2]:
        ax.set_yscale("symlog", linthresh=1e-4)
        ax.set_ylim(bottom=0)
    axes[2].set_yscale("log")
    axes[0].legend(fontsize=6)
    axes[2].legend(fontsize=7)
    fig.tight_layout()
    path = out / "specfed_eval.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    models = ASSETS / "models"
    parser.add_argument("--worker", type=Path, action="append", help="worker model dir (repeat; default base, draft)")
    parser.add_argument("--drafter", type=Path, default=models / "draft", help="drafter model dir (default draft)")
    parser.add_argument("--domains", nargs="+", default=["prose", "code"])
    parser.add_argument("--docs", type=int, default=2, help="held-out documents per domain")
    parser.add_argument("--windows", type=int, default=2, help="windows per document")
    parser.add_argument("--length", type=int, default=256, help="tokens per window")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (shared machines: 1)")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "specfed")
    parser.add_argument("--plot-only", action="store_true", help="redraw the plots from the saved JSON")
    args = parser.parse_args(argv)
    if args.plot_only:
        plots(json.loads((args.out / "specfed_eval.json").read_text()), args.out)
        return 0
    args.worker = args.worker or [models / "base", models / "draft"]
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    result = evaluate(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "specfed_eval.json").write_text(json.dumps(result, indent=2) + "\n")
    table = markdown(result)
    (args.out / "specfed_eval.md").write_text(table)
    plots(result, args.out)
    sys.stdout.write(table)
    if not result["all_bounds_hold"]:
        log.error("bounds violated: %s", result["violation_examples"][:5])
        return 1
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
