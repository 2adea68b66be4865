"""Controller cost: microseconds of ``SpeculationController.ranked()``, the speculation decision every step makes.

``splitspec serve`` makes one decision per step of every sequence on its event loop, and under load
another sequence's step time lands between two of a sequence's decisions (the engine's step times
are shared). With the demo's ``--speculate auto`` drafters (prompt lookup, n-grams, the draft model,
their mix; and the EAGLE head when one is loaded) the ranking is timed with a step observed before
each call ("observed") and without ("quiet"), at contexts of 300 and 2,000 tokens, over step times
measured at several widths and context bands. Each figure is the median of ``--calls`` calls, per
repeat; with ``--baseline REF`` the same runs on commit REF's code (a git worktree, same venv) in a
child process beside this checkout's, repeats interleaved and the order alternated.

    python benchmarks/controller_cost.py [--repeats 3] [--baseline REF] [--out benchmarks/results/controller_cost]

Writes ``controller_cost.json``, ``controller_cost.md`` and ``controller_cost.png``.
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
DRAFTER_SETS = {"auto+draft": ["ngram", "prompt-lookup", "draft", "mix"], "auto+draft+eagle": ["eagle", "ngram",
                "prompt-lookup", "draft", "mix"]}  # fmt: skip
CONTEXTS = (300, 2000)


def measure(calls: int) -> dict[str, float]:
    """``drafters|context|observed-or-quiet`` -> median microseconds per ranked(), with the code on ``sys.path``."""
    import random
    import time

    from splitspec.decoding.controller import SpeculationController
    from splitspec.decoding.estimates import StepTimes

    out: dict[str, float] = {}
    for label, drafters in DRAFTER_SETS.items():
        rng = random.Random(0)
        times = StepTimes()
        for _ in range(400):  # widths 1..17 in three context bands, as a gateway measures them
            times.observe(rng.choice([1, 2, 3, 4, 5, 7, 9, 13, 17]), rng.uniform(0.08, 0.12), rng.choice(CONTEXTS))
        controller = SpeculationController(drafters, step_times=times)
        for name in drafters:
            for _ in range(20):
                controller.observe_draft(name, 4, rng.randint(0, 4), 6, 0.003)
        for n in CONTEXTS:
            for mode in ("observed", "quiet"):
                samples = []
                for _ in range(calls):
                    if mode == "observed":
                        times.observe(3, rng.uniform(0.08, 0.12), n)  # another sequence's step landed meanwhile
                    t0 = time.perf_counter()
                    controller.ranked(n)
                    samples.append((time.perf_counter() - t0) * 1e6)
                out[f"{label}|{n}|{mode}"] = statistics.median(samples)
    return out


def markdown(results: dict[str, Any]) -> str:
    has_base = results["baseline"] is not None
    lines = [
        f"# Controller cost (commit {results['commit'][:10]}"
        + (f", baseline {results['baseline']}" if has_base else "")
        + f", {results['repeats']} repeats)",
        "",
        "Median microseconds per `SpeculationController.ranked()` call (one thread), medians over repeats.",
        "",
        "| drafters | context | between calls | this (us) | "
        + ("baseline (us) | baseline / this |" if has_base else ""),
        "|---|---:|---|---:|" + ("---:|---:|" if has_base else ""),
    ]
    for key, mine in results["this"].items():
        drafters, n, mode = key.split("|")
        row = f"| {drafters} | {n} | {'a step observed' if mode == 'observed' else 'nothing'} | {mine:.0f} |"
        if has_base:
            theirs = results["before"][key]
            row += f" {theirs:.0f} | {theirs / mine:.1f}x |"
        lines.append(row)
    lines += ["", f"Reproduce: `{results['command']}`."]
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(results["this"])
    fig, ax = plt.subplots(figsize=(7, 3.5))
    series = [("this", results["this"])] + ([(results["baseline"], results["before"])] if results["before"] else [])
    for i, (label, values) in enumerate(series):
        ax.barh([y + 0.4 * i for y in range(len(keys))], [values[k] for k in keys], height=0.4, label=label)
    ax.set_yticks([y + 0.2 for y in range(len(keys))], keys, fontsize=7)
    ax.set_xlabel("microseconds per ranked() (median)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--calls", type=int, default=2000, help="ranked() calls timed per case and repeat")
    parser.add_argument("--baseline", help="a git commit to measure beside this checkout")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/controller_cost"))
    parser.add_argument("--measure", metavar="JSON", help=argparse.SUPPRESS)  # the child's job
    args = parser.parse_args()
    if args.measure:
        Path(args.measure).write_text(json.dumps(measure(args.calls)))
        return 0
    from splitspec.bench.beside import measure_beside
    from splitspec.run_info import run_environment

    logging.basicConfig(level=logging.INFO, format="%(message)s")  # progress of the repeats
    runs = measure_beside(Path(__file__).resolve(), ROOT, args.repeats, args.baseline, ["--calls", str(args.calls)])
    env = run_environment()
    medians = {label: {k: statistics.median(r[k] for r in got) for k in got[0]} for label, got in runs.items() if got}
    results: dict[str, Any] = {
        "commit": env.get("commit", ""), "environment": env, "baseline": args.baseline, "repeats": args.repeats,
        "calls": args.calls, "command": "python benchmarks/controller_cost.py " + shlex.join(sys.argv[1:]),
        "runs": runs, "this": medians["this"], "before": medians.get("before"),
    }  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "controller_cost.json").write_text(json.dumps(results, indent=2))
    (args.out / "controller_cost.md").write_text(markdown(results) + "\n")
    plot(results, args.out / "controller_cost.png")
    print(markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
