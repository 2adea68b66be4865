"""Prepacked linears with padded row counts: what the padding costs in time and saves in memory.

``PackedLinear`` pads its rows to a few sizes (``models.prepack.row_bucket``), because oneDNN keeps
kernels for every row count it sees. This measures, on one CPU thread, the demo base model's
linear layers (one decoder layer's seven, and the LM head):

* **time**: ms per call at row counts from 1 to 300 (or ``--rows``), padded (as shipped) and exact (the oneDNN
  operator called on the rows as they are), each the median of 20 calls after a warm-up, the two
  interleaved and the order alternated over ``--repeats``;
* **memory**: resident memory a fresh process gains by calling the linears once at every row
  count from 1 to ``--memory-rows``, padded and exact (each its own child process: kernels persist).

    python benchmarks/prepack_rows.py [--repeats 3] [--memory-rows 600] [--out benchmarks/results/prepack_rows]

Writes ``prepack_rows.json``, ``prepack_rows.md`` and ``prepack_rows.png``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROWS = (1, 4, 8, 16, 17, 20, 24, 33, 40, 48, 65, 80, 100, 129, 160, 200, 257, 300)
CALLS = 20


def linears() -> list[Any]:
    """The demo base model's packed linears: layer 0's q, k, v, o, gate, up, down, and the LM head."""
    import torch

    from splitspec.demo import embedded_model
    from splitspec.models.checkpoint import Checkpoint
    from splitspec.models.loading import load_full
    from splitspec.models.prepack import PackedLinear

    model = load_full(Checkpoint(embedded_model("base")), torch.float32)
    layer = model.layers.layers[0]  # the first decoder layer (transformers module)
    plain = [*(getattr(layer.self_attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj"))]
    plain += [getattr(layer.mlp, n) for n in ("gate_proj", "up_proj", "down_proj")] + [model.lm_head]
    return [PackedLinear(lin) for lin in plain]


def exact_forward(lin: Any, x: Any) -> Any:
    """PackedLinear.forward before the padding: the operator on the rows as they are."""
    import torch

    return torch.ops.mkldnn._linear_pointwise(x, lin.packed, lin.bias, "none", [], "")


def call(packed: list[Any], rows: int, exact: bool) -> None:
    import torch

    for lin in packed:
        x = torch.ones(1, rows, lin.in_features)  # (1, rows, in), as the stacks call them
        if exact:
            exact_forward(lin, x)
        else:
            lin.forward(x)


def time_once(packed: list[Any], rows: int, exact: bool) -> float:
    call(packed, rows, exact)  # warm-up: builds the kernels
    samples = []
    for _ in range(CALLS):
        t0 = time.perf_counter()
        call(packed, rows, exact)
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def memory_child(rows: int, exact: bool) -> dict[str, float]:
    """In this (fresh) process: resident MB before and after one call at every row count up to ``rows``."""
    import torch

    from splitspec.run_info import resident_bytes

    torch.set_num_threads(1)
    packed = linears()
    call(packed, 1, exact)
    before = resident_bytes() / 2**20
    for n in range(1, rows + 1):
        call(packed, n, exact)
    return {"before_mb": before, "after_mb": resident_bytes() / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--memory-rows", type=int, default=600)
    parser.add_argument(
        "--rows", type=int, nargs="+", default=list(ROWS), help="row counts timed (default: 18 counts from 1 to 300)"
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "prepack_rows")
    parser.add_argument("--child", choices=("padded", "exact"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(memory_child(args.memory_rows, args.child == "exact")))
        return

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import torch

    from splitspec.run_info import run_environment

    torch.set_num_threads(1)
    packed = linears()
    timed = args.rows
    times: dict[str, dict[int, list[float]]] = {"padded": {r: [] for r in timed}, "exact": {r: [] for r in timed}}
    for repeat in range(args.repeats):
        for rows in timed:
            for kind in ("padded", "exact") if repeat % 2 == 0 else ("exact", "padded"):
                times[kind][rows].append(time_once(packed, rows, kind == "exact"))
    memory: dict[str, list[dict[str, float]]] = {"padded": [], "exact": []}
    for repeat in range(args.repeats):
        for kind in ("padded", "exact") if repeat % 2 == 0 else ("exact", "padded"):
            cmd = [sys.executable, __file__, "--child", kind, "--memory-rows", str(args.memory_rows)]
            memory[kind].append(json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout))
    from splitspec.models.prepack import row_bucket

    table = [
        {"rows": r, "padded_to": row_bucket(r), "padded_ms": statistics.median(times["padded"][r]),
         "exact_ms": statistics.median(times["exact"][r]),
         "ratio": statistics.median(p / e for p, e in zip(times["padded"][r], times["exact"][r], strict=True))}
        for r in timed
    ]  # fmt: skip
    growth = {k: statistics.median(m["after_mb"] - m["before_mb"] for m in v) for k, v in memory.items()}
    results = {
        **run_environment(), "repeats": args.repeats, "memory_rows": args.memory_rows, "calls": CALLS,
        "command": "python benchmarks/prepack_rows.py " + shlex.join(sys.argv[1:]),
        "times": table, "raw_times": times, "memory": memory, "growth_mb": growth,
        "shapes": {"padded": len({row_bucket(n) for n in range(1, args.memory_rows + 1)}), "exact": args.memory_rows},
    }  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "prepack_rows.json").write_text(json.dumps(results, indent=1))
    lines = [
        "# Prepacked linears: padded row counts against exact ones",
        "",
        f"Commit `{results['commit'][:12]}`; the demo base model's layer-0 linears and LM head, one thread, "
        f"median of {CALLS} calls, {args.repeats} interleaved repeats. Reproduce: `{results['command']}`.",
        "",
        "| rows | padded to | padded ms | exact ms | padded / exact |",
        "|---:|---:|---:|---:|---:|",
        *(
            f"| {t['rows']} | {t['padded_to']} | {t['padded_ms']:.3f} | {t['exact_ms']:.3f} | {t['ratio']:.2f} |"
            for t in table
        ),
        "",
        f"Resident memory gained by one call at every row count 1..{args.memory_rows} in a fresh process "
        f"(median of {args.repeats}): padded **{growth['padded']:.1f} MB** ({results['shapes']['padded']} shapes), "
        f"exact **{growth['exact']:.1f} MB** ({args.memory_rows} shapes).",
        "",
    ]
    (args.out / "prepack_rows.md").write_text("\n".join(lines))
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for kind in ("exact", "padded"):
        ax.plot(timed, [t[f"{kind}_ms"] for t in table], marker="o", label=kind)
    ax.set_xlabel("rows per call")
    ax.set_ylabel("ms (8 linears, median)")
    rows = args.memory_rows
    ax.set_title(f"padded: +{growth['padded']:.0f} MB, exact: +{growth['exact']:.0f} MB over 1..{rows} rows")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out / "prepack_rows.png", dpi=120)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
