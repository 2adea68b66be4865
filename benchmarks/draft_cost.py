"""Drafting cost: how long the draft model and the EAGLE head take to propose one tree, on one CPU thread.

The drafters of the demo (the shipped draft model and ``base-eagle`` over the base model's own
features) propose a tree for held-out code after a context of 96 or 1,000 tokens, at budgets 8,
16 and 32 nodes, greedy and at temperature 0.8; each figure is the median of 15 proposals after
one warm-up. With ``--baseline REF`` the same measurement runs on the code of commit REF (a git
worktree of it, same venv) in a child process beside this checkout's, repeats interleaved and
the order alternated; the report gives medians over repeats and the ratio baseline / this.

    python benchmarks/draft_cost.py [--repeats 3] [--baseline REF] [--out benchmarks/results/draft_cost]
        [--calls 15] [--contexts 96 1000]

Writes ``draft_cost.json``, ``draft_cost.md`` and ``draft_cost.png``.
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BUDGETS = (8, 16, 32)
CONTEXTS = (96, 1000)
TEMPERATURES = (0.0, 0.8)
CALLS = 15


def measure(calls: int = CALLS, contexts: tuple[int, ...] = CONTEXTS) -> dict[str, float]:
    """``drafter|temperature|context|budget`` -> median ms per proposal (of ``calls``), after each of ``contexts``
    tokens, with the code on ``sys.path``."""
    import time

    import torch
    from transformers import AutoTokenizer

    from splitspec.decoding.drafters import DraftModel
    from splitspec.decoding.eagle import EagleDrafter
    from splitspec.decoding.local import LocalSequence
    from splitspec.decoding.sampling import SamplingParams
    from splitspec.demo import ASSETS, embedded_model
    from splitspec.models.checkpoint import Checkpoint
    from splitspec.models.draft_head_io import load_draft_head
    from splitspec.models.loading import load_full

    torch.set_num_threads(1)
    base = embedded_model("base")
    model = load_full(Checkpoint(base), torch.float32)
    draft = load_full(Checkpoint(embedded_model("draft")), torch.float32)
    head = load_draft_head(embedded_model("base-eagle"), Checkpoint(base))
    text = (ASSETS / "corpus" / "heldout" / "code" / "pdb.txt").read_text()
    ids = AutoTokenizer.from_pretrained(base, local_files_only=True)(text, add_special_tokens=False).input_ids
    out: dict[str, float] = {}
    for n in contexts:
        context = list(ids[:n])
        verifier = LocalSequence(model)  # the head reads the base model's features of the committed tokens
        verifier.keep_features(head.config.feature_layers)
        verifier.run(context[:-1])
        for temperature in TEMPERATURES:
            params = SamplingParams() if temperature == 0 else SamplingParams(temperature=temperature)
            for budget in BUDGETS:
                for name in ("draft", "eagle"):
                    gen = None if params.greedy else torch.Generator().manual_seed(budget)
                    drafter: Any = (
                        DraftModel(draft, params, gen)
                        if name == "draft"
                        else EagleDrafter(head, lambda: model, verifier, params, gen)
                    )
                    drafter.propose(context, budget)  # warm: the draft model's cache holds the context after it
                    times = []
                    for _ in range(calls):
                        t0 = time.perf_counter()
                        drafter.propose(context, budget)
                        times.append(time.perf_counter() - t0)
                    out[f"{name}|{temperature}|{n}|{budget}"] = statistics.median(times) * 1e3
    return out


def markdown(results: dict[str, Any]) -> str:
    has_base = results["baseline"] is not None
    lines = [
        f"# Drafting cost (commit {results['commit'][:10]}"
        + (f", baseline {results['baseline']}" if has_base else "")
        + f", {results['repeats']} repeats)",
        "",
        "Median ms per proposed tree on one CPU thread (demo draft model and `base-eagle`), medians over repeats.",
        "",
        "| drafter | temperature | context | budget | this | " + ("baseline | baseline / this |" if has_base else ""),
        "|---|---|---|---|---|" + ("---|---|" if has_base else ""),
    ]
    for key in sorted(results["this"], key=lambda k: (k.split("|")[0], *map(float, k.split("|")[1:]))):
        name, temperature, n, budget = key.split("|")
        mine = results["this"][key]
        row = f"| {name} | {temperature} | {n} | {budget} | {mine:.2f} |"
        if has_base:
            theirs = results["before"][key]
            row += f" {theirs:.2f} | {theirs / mine:.2f}x |"
        lines.append(row)
    lines += ["", f"Reproduce: `{results['command']}`."]
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted(results["this"])
    fig, ax = plt.subplots(figsize=(max(6, len(keys) * 0.35), 3.5))
    xs = range(len(keys))
    ax.bar([x - 0.2 for x in xs], [results["this"][k] for k in keys], width=0.4, label="this")
    if results["baseline"] is not None:
        ax.bar([x + 0.2 for x in xs], [results["before"][k] for k in keys], width=0.4, label=results["baseline"])
    ax.set_xticks(list(xs), keys, rotation=90, fontsize=6)
    ax.set_ylabel("ms per tree")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--baseline", help="a git commit to measure beside this checkout")
    parser.add_argument("--calls", type=int, default=CALLS, help=f"timed proposals per figure (default {CALLS})")
    parser.add_argument(
        "--contexts",
        type=int,
        nargs="+",
        default=list(CONTEXTS),
        help="context tokens before the proposals (default " + " ".join(map(str, CONTEXTS)) + ")",
    )
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/draft_cost"))
    parser.add_argument("--measure", metavar="JSON", help=argparse.SUPPRESS)  # the child's job
    args = parser.parse_args()
    if args.calls < 1 or min(args.contexts) < 2:
        parser.error("--calls must be at least 1 and every --contexts at least 2 tokens")
    if args.measure:
        Path(args.measure).write_text(json.dumps(measure(args.calls, tuple(args.contexts))))
        return 0
    from splitspec.bench.beside import measure_beside
    from splitspec.run_info import run_environment

    logging.basicConfig(level=logging.INFO, format="%(message)s")  # progress of the repeats
    child_args = ["--calls", str(args.calls), "--contexts", *map(str, args.contexts)]
    runs = measure_beside(Path(__file__).resolve(), ROOT, args.repeats, args.baseline, child_args)
    env = run_environment()
    medians = {label: {k: statistics.median(r[k] for r in got) for k in got[0]} for label, got in runs.items() if got}
    results: dict[str, Any] = {
        "commit": env.get("commit", ""), "environment": env, "baseline": args.baseline, "repeats": args.repeats,
        "command": "python benchmarks/draft_cost.py " + shlex.join(sys.argv[1:]),
        "runs": runs,
        "this": medians["this"], "before": medians.get("before"),
    }  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "draft_cost.json").write_text(json.dumps(results, indent=2))
    (args.out / "draft_cost.md").write_text(markdown(results) + "\n")
    plot(results, args.out / "draft_cost.png")
    print(markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
