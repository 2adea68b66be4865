"""A batched step's forward (edge head, trunk) with this checkout's attention against commit REF's.

``forward_batch`` runs several sessions' steps as one batch. Until row attention
(``splitspec/models/row_attention.py``), each layer copied every row's committed keys and values
into one batch padded to the longest context, and transformers then copied them again per query
head (``repeat_kv``): O(rows x context) per layer and step. Now each row attends over views of its
own cache, and a masked step of several query tokens on a CPU attends grouped query heads to their
shared key/value heads without that copy (``grouped_sdpa``, which a lone step uses too: the 1 x q
rows). Since stop 51 the rows' tokens are packed end to end instead of padded to the longest row: ragged
rows (a decode step beside draft trees) no longer compute padding. This times ``forward_batch`` over B rows of q
query tokens, and over ragged rows, after a C-token context, on
the demo base model as ``splitspec serve`` loads it (float32, prepacked, one CPU thread): the edge's
head layers and the trunk's middle layers.

Each arm runs in its own process: this checkout's code, and ``--baseline REF``'s (a git worktree,
same venv). Per shape the median of ``--calls`` calls; the arms alternate, their order swapped each
repeat; the outputs of the two arms are checked equal (1e-5).

    python benchmarks/batched_attention.py --baseline REF [--repeats 3] [--calls 30] [--contexts 200 1000]
        [--out benchmarks/results/batched_attention]

Writes ``batched_attention.json``, ``batched_attention.md`` and ``batched_attention.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))

# query tokens per row: rows of one width (rows x q), then ragged ones, as a busy engine batches a decode step
# beside draft trees (there the padded batch of the code before stop 51 computed every row at the longest width)
SHAPES = (
    *((q,) * rows for rows, q in ((1, 1), (1, 5), (2, 2), (8, 1), (8, 2), (8, 5), (16, 2), (32, 1))),
    (1, 9),
    (1, 5, 9, 3),
    (1, 9, 1, 9, 5, 3, 2, 7),
)


def shape_label(widths: tuple[int, ...]) -> str:
    """``8x2`` for rows of one width, ``1+5+9+3`` for ragged ones."""
    if len(set(widths)) == 1:
        return f"{len(widths)}x{widths[0]}"
    return "+".join(str(q) for q in widths)


CONTEXTS = (200, 1000)  # committed tokens per row (default of --contexts)


def child(out: Path, calls: int, contexts: tuple[int, ...] = CONTEXTS) -> None:
    """Time every (part, context, shape) with the code on ``sys.path``; write timings and outputs."""
    from safetensors.torch import save_file

    from splitspec.demo import embedded_model
    from splitspec.edge.config import EdgeConfig
    from splitspec.edge.runtime import EdgeRuntime
    from splitspec.models.batched import BatchRow, forward_batch
    from splitspec.models.checkpoint import Checkpoint
    from splitspec.models.loading import load_trunk

    torch.set_num_threads(1)
    base = embedded_model("base")
    config = EdgeConfig(model_dir=base, cloud_url="ws://127.0.0.1:1", dtype="float32", allow_stock_edge_weights=True)
    runtime = EdgeRuntime(config)
    trunk = load_trunk(Checkpoint(base), runtime.plan, torch.float32)
    parts = {"head": runtime.model.head, "trunk": trunk}
    hidden = runtime.model.hidden_size
    timings: dict[str, float] = {}
    outputs: dict[str, torch.Tensor] = {}
    for name, stack in parts.items():
        for context in contexts:
            for widths in SHAPES:
                torch.manual_seed(0)
                rows = []
                for q in widths:
                    cache = runtime.new_cache()
                    prefix = torch.randn(1, context, hidden)
                    stack(prefix, torch.arange(context), torch.arange(-1, context - 1), cache)
                    step = torch.randn(1, q, hidden)
                    rows.append(BatchRow(step, torch.arange(context, context + q), torch.arange(-1, q - 1), cache))

                def step_once(
                    stack: Any = stack, rows: list[BatchRow] = rows, context: int = context
                ) -> list[torch.Tensor]:
                    outs = forward_batch(stack, rows)
                    for row in rows:
                        row.cache.truncate(context)
                    return outs

                for _ in range(3):
                    step_once()
                times = []
                for _ in range(calls):
                    start = time.perf_counter()
                    outs = step_once()
                    times.append(time.perf_counter() - start)
                key = f"{name}/{context}/{shape_label(widths)}"
                timings[key] = statistics.median(times) * 1e3
                outputs[key] = torch.cat([o.reshape(-1) for o in outs])
    save_file(outputs, str(out.with_suffix(".safetensors")))
    out.write_text(json.dumps(timings))


def run_arm(src: Path, calls: int, contexts: tuple[int, ...], tmp: Path, tag: str) -> tuple[dict[str, float], Path]:
    out = tmp / f"{tag}.json"
    env = {**os.environ, "PYTHONPATH": f"{src}{os.pathsep}{Path(__file__).parent}"}
    command = [sys.executable, __file__, "--child", str(out), "--calls", str(calls), "--contexts", *map(str, contexts)]
    subprocess.run(command, check=True, env=env)
    return json.loads(out.read_text()), out.with_suffix(".safetensors")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", help="the commit whose forward_batch is the baseline arm")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--calls", type=int, default=30, help="timed calls per shape and arm")
    parser.add_argument(
        "--contexts", type=int, nargs="+", default=list(CONTEXTS), help="committed tokens per row (default 200 1000)"
    )
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/batched_attention"))
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        child(args.child, args.calls, tuple(args.contexts))
        return
    if min(args.contexts) < 1:
        parser.error(f"--contexts must be at least 1 token, got {args.contexts}")
    if args.baseline is None:
        parser.error("--baseline REF is required (the commit to compare against)")
    from gateway_load import checkouts
    from safetensors.torch import load_file

    from splitspec.run_info import run_environment

    per_arm: dict[str, list[dict[str, float]]] = {"rows": [], "baseline": []}
    with checkouts(args.baseline) as (here, baseline), tempfile.TemporaryDirectory() as tmp:
        assert here is not None  # the working tree's code, from a worktree as REF's
        assert baseline is not None
        for repeat in range(args.repeats):
            order = ["rows", "baseline"] if repeat % 2 == 0 else ["baseline", "rows"]
            files = {}
            for arm in order:
                src = here if arm == "rows" else baseline
                timings, tensors = run_arm(src, args.calls, tuple(args.contexts), Path(tmp), f"{arm}{repeat}")
                per_arm[arm].append(timings)
                files[arm] = load_file(str(tensors))
                print(f"repeat {repeat + 1}/{args.repeats}: {arm} done", file=sys.stderr)
            for key, value in files["rows"].items():
                torch.testing.assert_close(value, files["baseline"][key], rtol=1e-5, atol=1e-5)
    table: list[dict[str, Any]] = []
    for key in per_arm["rows"][0]:
        ratios = [r[key] / b[key] for r, b in zip(per_arm["rows"], per_arm["baseline"], strict=True)]
        table.append(
            {
                "case": key,
                "rows_ms": statistics.median(r[key] for r in per_arm["rows"]),
                "baseline_ms": statistics.median(b[key] for b in per_arm["baseline"]),
                "ratio": statistics.median(ratios),
                "ratio_per_repeat": ratios,
            }
        )
    args.out.mkdir(parents=True, exist_ok=True)
    environment = run_environment()
    results = {
        "environment": environment,
        "baseline": args.baseline,
        "repeats": args.repeats,
        "contexts": args.contexts,
        "table": table,
    }
    (args.out / "batched_attention.json").write_text(json.dumps(results, indent=2))
    lines = [
        "# forward_batch: this checkout against the baseline's",
        "",
        f"Commit `{environment.get('commit')}`, baseline commit `{args.baseline}`. "
        f"Median of {args.calls} calls per shape, {args.repeats} interleaved "
        "repeats; ratio = this checkout / baseline (median of per-repeat ratios; < 1 is faster). Outputs equal (1e-5).",
        "",
        f"Reproduce: `python benchmarks/batched_attention.py --baseline {args.baseline} --repeats {args.repeats} "
        f"--calls {args.calls} --contexts {' '.join(map(str, args.contexts))}`",
        "",
        "| part / context / rows x q (or ragged widths) | this ms | baseline ms | ratio | per repeat |",
        "|---|---:|---:|---:|---|",
    ]
    for row in table:
        per = ", ".join(f"{x:.2f}" for x in row["ratio_per_repeat"])
        lines.append(
            f"| {row['case']} | {row['rows_ms']:.2f} | {row['baseline_ms']:.2f} | {row['ratio']:.2f} | {per} |"
        )
    (args.out / "batched_attention.md").write_text("\n".join(lines) + "\n")
    plot(table, args.out / "batched_attention.png")
    print("\n".join(lines))


def plot(table: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4))
    ax.bar(range(len(table)), [row["ratio"] for row in table])
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks(range(len(table)), [row["case"] for row in table], rotation=70, fontsize=7)
    ax.set_ylabel("this checkout / baseline (time)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
