"""Why a CPU server runs its forwards on the event loop: one batched forward on a worker thread, beside Python.

``splitspec serve`` and ``splitspec cloud serve`` used to run their batched forwards (and the edge its draft
model's proposals) on worker threads, so that the event loop stays free while torch computes. On a CPU a forward
of the demo model's two head layers is a few hundred short torch calls, and each releases the interpreter lock
and takes it back. A thread that wants the lock back while another runs Python waits for that one to give it up:
at the latest after the switch interval (``sys.getswitchinterval()``, 5 ms by default), after every call. This
times one forward (the edge's head layers, demo base model, float32, one torch thread, 2 rows of 9 query tokens
after 200 tokens of context, as ``serve`` batches at 16 streams) in four settings:

* ``alone``: on the main thread, nothing else running;
* ``two threads``: two threads running such forwards at once (the head's and the tail's workers);
* ``beside Python, 5 ms`` / ``beside Python, 0.05 ms``: on a worker thread while the main thread runs pure
  Python (an event loop parsing frames, ranking drafts, writing SSE), at two switch intervals.

Per setting: the median wall time of one forward and its thread's CPU time (``time.thread_time``) over
``--calls`` forwards; the settings interleave, ``--repeats`` times. On the event loop itself (``--compute-on
loop``, a CPU's default since 35a113c) a forward takes its ``alone`` time between the loop's other work.

    python benchmarks/compute_on.py [--repeats 3] [--calls 100] [--out benchmarks/results/compute_on]

Writes ``compute_on.json``, ``compute_on.md`` and ``compute_on.png``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

SETTINGS = ("alone", "two threads", "beside Python, 5 ms", "beside Python, 0.05 ms")
ROWS, QUERY, CONTEXT = 2, 9, 200


def head_forward() -> Callable[[], None]:
    """One batched forward of the demo edge's head layers over ROWS rows of QUERY tokens after CONTEXT tokens."""
    from splitspec.demo import embedded_model
    from splitspec.edge.config import EdgeConfig
    from splitspec.edge.runtime import EdgeRuntime
    from splitspec.models.batched import BatchRow, forward_batch

    config = EdgeConfig(
        model_dir=embedded_model("base"), cloud_url="ws://127.0.0.1:1", dtype="float32", allow_stock_edge_weights=True
    )
    runtime = EdgeRuntime(config)
    head, hidden = runtime.model.head, runtime.model.hidden_size
    rows = []
    for _ in range(ROWS):
        cache = runtime.new_cache()
        head(torch.randn(1, CONTEXT, hidden), torch.arange(CONTEXT), torch.arange(-1, CONTEXT - 1), cache)
        step = torch.randn(1, QUERY, hidden)
        rows.append(BatchRow(step, torch.arange(CONTEXT, CONTEXT + QUERY), torch.arange(-1, QUERY - 1), cache))

    def forward() -> None:
        forward_batch(head, rows)
        for row in rows:
            row.cache.truncate(CONTEXT)

    return forward


def timed(forward: Callable[[], None], calls: int, out: list[tuple[float, float]]) -> None:
    """``calls`` forwards on this thread -> out gets each one's (wall ms, this thread's CPU ms)."""
    for _ in range(calls):
        wall, cpu = time.perf_counter(), time.thread_time()
        forward()
        out.append(((time.perf_counter() - wall) * 1e3, (time.thread_time() - cpu) * 1e3))


def python_until(done: threading.Event) -> None:
    """Pure Python work (no torch call, no I/O) until ``done``: what an event loop does between awaits."""
    total = 0
    while not done.is_set():
        total += sum(i * i for i in range(200))


def measure(setting: str, forwards: list[Callable[[], None]], calls: int) -> dict[str, float]:
    samples: list[tuple[float, float]] = []
    switch = sys.getswitchinterval()
    try:
        if setting == "alone":
            timed(forwards[0], calls, samples)
        elif setting == "two threads":
            threads = [threading.Thread(target=timed, args=(f, calls, samples)) for f in forwards[:2]]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        else:
            sys.setswitchinterval(0.005 if setting == "beside Python, 5 ms" else 0.00005)
            done = threading.Event()

            def work() -> None:
                timed(forwards[0], calls, samples)
                done.set()

            worker = threading.Thread(target=work)
            worker.start()
            python_until(done)
            worker.join()
    finally:
        sys.setswitchinterval(switch)
    return {
        "wall_ms": statistics.median(s[0] for s in samples),
        "cpu_ms": statistics.median(s[1] for s in samples),
    }


def markdown(results: dict[str, Any]) -> str:
    summary = results["summary"]
    alone = summary["alone"]
    lines = [
        "# One batched CPU forward on a worker thread, beside Python",
        "",
        f"Commit `{results['commit']}`; {results['repeats']} repeats of {results['calls']} forwards per setting, "
        "settings interleaved; medians over forwards, then over repeats. The demo edge's head layers, float32, one "
        f"torch thread, {ROWS} rows x {QUERY} query tokens after {CONTEXT} tokens of context.",
        f"Reproduce: `{results['command']}`.",
        "",
        "| setting | wall ms | x alone | thread CPU ms | x alone |",
        "|---|---:|---:|---:|---:|",
    ]
    for setting in SETTINGS:
        row = summary[setting]
        lines.append(
            f"| {setting} | {row['wall_ms']:.2f} | {row['wall_ms'] / alone['wall_ms']:.1f} | {row['cpu_ms']:.2f} "
            f"| {row['cpu_ms'] / alone['cpu_ms']:.2f} |"
        )
    lines += [
        "",
        "Two threads: each forward's wall time is that of the two together (they take turns on the lock), and each",
        "spends more CPU than alone (the lock changing hands hundreds of times a forward). Beside Python: the",
        "worker waits for the lock after every torch call, up to one switch interval each time.",
    ]
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = results["summary"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, key, title in ((axes[0], "wall_ms", "wall ms per forward"), (axes[1], "cpu_ms", "thread CPU ms")):
        ax.bar(range(len(SETTINGS)), [summary[s][key] for s in SETTINGS], color="tab:blue")
        ax.set_xticks(range(len(SETTINGS)), [s.replace(", ", "\n") for s in SETTINGS], fontsize=8)
        ax.set_yscale("log")
        ax.set_title(title)
    fig.suptitle("One batched head forward (demo, CPU) on a worker thread")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--calls", type=int, default=100, help="forwards per setting and repeat")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/compute_on"))
    args = parser.parse_args()
    if args.repeats < 1 or args.calls < 1:
        parser.error("--repeats and --calls must be at least 1")
    from splitspec.run_info import run_environment

    torch.set_num_threads(1)
    forwards = [head_forward(), head_forward()]
    for forward in forwards:
        for _ in range(5):
            forward()
    raw: dict[str, list[dict[str, float]]] = {s: [] for s in SETTINGS}
    for repeat in range(args.repeats):
        order = SETTINGS if repeat % 2 == 0 else tuple(reversed(SETTINGS))
        for setting in order:
            raw[setting].append(measure(setting, forwards, args.calls))
            print(f"repeat {repeat} {setting}: {raw[setting][-1]}", flush=True)
    summary = {s: {key: statistics.median(r[key] for r in raw[s]) for key in ("wall_ms", "cpu_ms")} for s in SETTINGS}
    command = "python benchmarks/compute_on.py" + (f" --repeats {args.repeats}" if args.repeats != 3 else "")
    command += f" --calls {args.calls}" if args.calls != 100 else ""
    results = {**run_environment(), "command": command, "repeats": args.repeats, "calls": args.calls}
    results |= {"raw": raw, "summary": summary}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "compute_on.json").write_text(json.dumps(results, indent=2))
    (args.out / "compute_on.md").write_text(markdown(results))
    plot(results, args.out / "compute_on.png")
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
