"""Benchmark: does one stall write drafting off for a short answer? The controller on a simulated link.

A stall (a collection, a busy neighbour, a GPU building its first kernels) that lands on the first wide step or
the first proposal of an answer used to be read as that width's or that drafter's cost: the controller priced
drafting out and, with re-probes every 24 one-token steps, never measured it again in a short answer. This
script runs the controller alone (``SpeculationController``: ``ranked``, then ``observe_draft`` and
``observe_step``) on a simulated link: a step of q tokens takes ``rtt + 2 ms * q``, a draft model costs 3 ms a
drafted token (``--draft-token-ms``) and each of its tokens is accepted with probability ``alpha`` (given the ones
before). A stall of 110 ms lands on the first wide step (``step``), 170 ms on the first proposal (``draft``), or
both; ``none`` is the same run without. Per case, the median over ``--seeds`` answers of tokens per second and
proposals.

``ideal`` is the run without a stall plus the stall's seconds (what a controller the stall did not mislead would
do); ``off`` is one-token steps only, with the step's stall on one of them. The simulation is deterministic:
``--baseline REF`` runs the same cases on commit REF's controller (a git worktree, same venv) beside this
checkout's, and a repeat reproduces its figures exactly (one is enough).

    python benchmarks/controller_stalls.py [--baseline REF] [--seeds 50] [--draft-token-ms 3]
        [--out benchmarks/results/controller_stalls]

Writes ``controller_stalls.json``, ``controller_stalls.md`` and ``controller_stalls.png``.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import shlex
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RTTS_MS = (20, 40, 80, 150)
ANSWERS = (16, 32, 96)
ALPHAS = (0.1, 0.4, 0.75)
STALLS = {"none": (0.0, 0.0), "step": (0.110, 0.0), "draft": (0.0, 0.170), "both": (0.110, 0.170)}  # seconds
PER_QUERY_TOKEN_S = 0.002  # a step's cost per query token, over the round trip
DRAFT_TOKEN_MS = 3.0  # the draft model's milliseconds per drafted token, unless --draft-token-ms
CONTEXT = 64  # prompt tokens before the answer


def simulate(
    answer: int, rtt_s: float, alpha: float, stall: tuple[float, float], seed: int, draft_token_s: float
) -> tuple[float, int]:
    """One answer of ``answer`` tokens -> (tokens per second, proposals)."""
    from splitspec.decoding.controller import SpeculationController

    rng = random.Random(seed)
    ctl = SpeculationController(["draft"])
    step_stall, draft_stall = stall
    made, seconds, proposals = 0, 0.0, 0
    while made < answer:
        choice = ctl.ranked(CONTEXT + made)[0]
        k = min(choice.budget, answer - made - 1)  # the decode loop's cap: no draft past the answer's end
        if choice.drafter is None or k < 1:
            step_s = rtt_s + PER_QUERY_TOKEN_S
            ctl.observe_step(1, step_s, CONTEXT + made)
            seconds, made = seconds + step_s, made + 1
            continue
        draft_s = draft_token_s * k + (draft_stall if proposals == 0 else 0.0)
        accepted = 0
        while accepted < k and rng.random() < alpha:
            accepted += 1
        ctl.observe_draft("draft", k, accepted, k, draft_s)
        step_s = rtt_s + PER_QUERY_TOKEN_S * (k + 1) + (step_stall if proposals == 0 else 0.0)
        ctl.observe_step(k + 1, step_s, CONTEXT + made)
        proposals += 1
        seconds, made = seconds + step_s + draft_s, made + accepted + 1
    return made / seconds, proposals


def case_key(rtt_ms: int, answer: int, alpha: float, stall: str) -> str:
    return f"{rtt_ms}|{answer}|{alpha}|{stall}"


def measure(seeds: int, draft_token_ms: float = DRAFT_TOKEN_MS) -> dict[str, float]:
    """``rtt|answer|alpha|stall|tok_s`` and ``...|proposals`` -> medians over ``seeds`` answers."""
    out: dict[str, float] = {}
    for rtt_ms in RTTS_MS:
        for answer in ANSWERS:
            for alpha in ALPHAS:
                for name, stall in STALLS.items():
                    draft_s = draft_token_ms / 1e3
                    runs = [simulate(answer, rtt_ms / 1e3, alpha, stall, seed, draft_s) for seed in range(seeds)]
                    key = case_key(rtt_ms, answer, alpha, name)
                    out[key + "|tok_s"] = statistics.median(r[0] for r in runs)
                    out[key + "|proposals"] = statistics.median(r[1] for r in runs)
    return out


def reference(this: dict[str, float], rtt_ms: int, answer: int, alpha: float, stall: str) -> tuple[float, float]:
    """(ideal, off) tokens per second of a case (see the module's docstring)."""
    step_stall, draft_stall = STALLS[stall]
    clean = this[case_key(rtt_ms, answer, alpha, "none") + "|tok_s"]
    ideal = answer / (answer / clean + step_stall + draft_stall)
    off = answer / (answer * (rtt_ms / 1e3 + PER_QUERY_TOKEN_S) + step_stall)
    return ideal, off


def markdown(results: dict[str, Any]) -> str:
    this, before, base = results["this"], results["before"], results["baseline"]
    draft_ms = results.get("draft_token_ms", DRAFT_TOKEN_MS)  # absent from the first results (3 ms)
    lines = [
        f"# One stall and a short answer: the controller on a simulated link, commit {results['commit'][:7]}"
        + (f" beside {base}" if base else ""),
        "",
        f"`{results['command']}`. Medians over {results['seeds']} answers (seeds) per case; a step of q tokens "
        f"takes RTT + {PER_QUERY_TOKEN_S * 1e3:.0f} ms x q, the draft model {draft_ms:g} ms a token; "
        "stalls: 110 ms on the first wide step (`step`), 170 ms on the first proposal (`draft`), or both. `ideal`: "
        "the unstalled run plus the stall's seconds; `off`: one-token steps, the step's stall on one of them.",
        "",
        "| RTT ms | answer | alpha | stall | tok/s | proposals | "
        + ("before tok/s | before proposals | this / before | " if before else "")
        + "ideal tok/s | this / ideal | off tok/s | this / off |",
        "|---:|---:|---:|---|---:|---:|" + ("---:|---:|---:|" if before else "") + "---:|---:|---:|---:|",
    ]
    for rtt_ms in RTTS_MS:
        for answer in ANSWERS:
            for alpha in ALPHAS:
                for stall in STALLS:
                    key = case_key(rtt_ms, answer, alpha, stall)
                    tok_s, proposals = this[key + "|tok_s"], this[key + "|proposals"]
                    ideal, off = reference(this, rtt_ms, answer, alpha, stall)
                    row = f"| {rtt_ms} | {answer} | {alpha} | {stall} | {tok_s:.1f} | {proposals:.0f} | "
                    if before:
                        old = before[key + "|tok_s"]
                        row += f"{old:.1f} | {before[key + '|proposals']:.0f} | {tok_s / old:.2f} | "
                    lines.append(row + f"{ideal:.1f} | {tok_s / ideal:.2f} | {off:.1f} | {tok_s / off:.2f} |")
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path, answer: int = 32, alpha: float = 0.75) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    this, before = results["this"], results["before"]
    fig, axes = plt.subplots(1, len(RTTS_MS), figsize=(3.2 * len(RTTS_MS), 3.2), sharey=False)
    for ax, rtt_ms in zip(axes, RTTS_MS, strict=True):
        xs = range(len(STALLS))
        series = [("this", this)] + ([(results["baseline"], before)] if before else [])
        width = 0.8 / (len(series) + 1)
        for i, (label, figures) in enumerate(series):
            values = [figures[case_key(rtt_ms, answer, alpha, s) + "|tok_s"] for s in STALLS]
            ax.bar([x + i * width for x in xs], values, width, label=label)
        ideal = [reference(this, rtt_ms, answer, alpha, s)[0] for s in STALLS]
        ax.bar([x + len(series) * width for x in xs], ideal, width, label="ideal", color="0.75")
        off = [reference(this, rtt_ms, answer, alpha, s)[1] for s in STALLS]
        ax.plot([x + width for x in xs], off, "k_", markersize=14, label="off")
        ax.set_xticks([x + width for x in xs], list(STALLS))
        ax.set_title(f"{rtt_ms} ms RTT", fontsize=9)
    axes[0].set_ylabel(f"tok/s ({answer}-token answers, alpha {alpha})")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--seeds", type=int, default=50, help="answers simulated per case (default 50)")
    parser.add_argument(
        "--draft-token-ms",
        type=float,
        default=DRAFT_TOKEN_MS,
        help=f"the draft model's cost per drafted token, ms (default {DRAFT_TOKEN_MS:g}; a dear one shows what the "
        "confirming probe costs when the first proposal's cost was its own)",
    )
    parser.add_argument("--baseline", help="a git commit whose controller is simulated beside this checkout's")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "controller_stalls")
    parser.add_argument("--measure", metavar="JSON", help=argparse.SUPPRESS)  # the child's job
    args = parser.parse_args()
    if args.measure:
        Path(args.measure).write_text(json.dumps(measure(args.seeds, args.draft_token_ms)))
        return 0
    from splitspec.bench.beside import measure_beside
    from splitspec.run_info import run_environment

    logging.basicConfig(level=logging.INFO, format="%(message)s")  # progress
    child = ["--seeds", str(args.seeds), "--draft-token-ms", str(args.draft_token_ms)]
    runs = measure_beside(Path(__file__).resolve(), ROOT, 1, args.baseline, child)
    env = run_environment()
    results: dict[str, Any] = {
        "commit": env.get("commit", ""),
        "environment": env,
        "baseline": args.baseline,
        "seeds": args.seeds,
        "draft_token_ms": args.draft_token_ms,
        "command": "python benchmarks/controller_stalls.py " + shlex.join(sys.argv[1:]),
        "this": runs["this"][0],
        "before": runs["before"][0] if runs["before"] else None,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "controller_stalls.json").write_text(json.dumps(results, indent=1))
    report = markdown(results)
    (args.out / "controller_stalls.md").write_text(report + "\n")
    plot(results, args.out / "controller_stalls.png")
    logging.getLogger("controller_stalls").info("\n%s", report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
