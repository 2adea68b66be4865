"""The edge's tail over a batch of sequences: one LM-head product for all rows, or one per row.

``splitspec serve`` batches the tail layers of every sequence whose trunk reply is in, then turns
each row's outputs into logits. Until 6244bd1 that was one LM-head product per row, each reading
the whole head (the demo's 256 x 8192 float32 head is 8 MB, a real model's 0.5-1 GB); since then it
is one product for the batch (``ModelEnds.row_logits``). This times both on the demo base model as
``splitspec serve`` loads it (float32, prepacked, one CPU thread): the tail's forward over B rows of
q query tokens after a 200-token context, then the logits either way. Per (B, q): the median of
``--calls`` calls, the two ways interleaved and their order alternated over ``--repeats``; the
logits are checked equal.

    python benchmarks/tail_logits.py [--repeats 3] [--calls 50] [--out benchmarks/results/tail_logits]

Writes ``tail_logits.json`` and ``tail_logits.md``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from splitspec.demo import embedded_model
from splitspec.edge.config import EdgeConfig
from splitspec.edge.runtime import EdgeRuntime
from splitspec.models.batched import BatchRow, forward_batch
from splitspec.models.stack import EdgeModel
from splitspec.run_info import run_environment

SHAPES = ((1, 1), (2, 2), (4, 2), (8, 1), (8, 2), (8, 5), (16, 2), (32, 2))  # (rows, query tokens per row)
CONTEXT = 200  # committed tokens per row


def rows_for(model: EdgeModel, runtime: EdgeRuntime, batch: int, q: int) -> list[BatchRow]:
    """``batch`` rows of ``q`` query tokens, each after CONTEXT tokens in its own tail cache."""
    torch.manual_seed(0)
    rows = []
    hidden = model.hidden_size
    for _ in range(batch):
        cache = runtime.new_cache()
        model.tail(torch.randn(1, CONTEXT, hidden), torch.arange(CONTEXT), torch.arange(-1, CONTEXT - 1), cache)
        rows.append(
            BatchRow(torch.randn(1, q, hidden), torch.arange(CONTEXT, CONTEXT + q), torch.arange(-1, q - 1), cache)
        )
    return rows


def tail_step(model: EdgeModel, rows: list[BatchRow], joined: bool) -> list[torch.Tensor]:
    outs = forward_batch(model.tail, rows)
    logits = model.row_logits(outs) if joined else [model.logits(out) for out in outs]
    for row in rows:
        row.cache.truncate(CONTEXT)
    return logits


def timed(model: EdgeModel, rows: list[BatchRow], joined: bool, calls: int) -> float:
    for _ in range(3):
        tail_step(model, rows, joined)
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        tail_step(model, rows, joined)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/tail_logits"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    runtime = EdgeRuntime(
        EdgeConfig(
            model_dir=embedded_model("base"),
            cloud_url="ws://127.0.0.1:1",
            dtype="float32",
            allow_stock_edge_weights=True,
        )
    )
    model = runtime.model
    results: list[dict[str, Any]] = []
    with torch.inference_mode():
        for batch, q in SHAPES:
            rows = rows_for(model, runtime, batch, q)
            same = all(
                torch.allclose(a, b, rtol=1e-5, atol=1e-5)
                for a, b in zip(tail_step(model, rows, True), tail_step(model, rows, False), strict=True)
            )
            per_row: list[float] = []
            joined: list[float] = []
            for repeat in range(args.repeats):
                order = (False, True) if repeat % 2 == 0 else (True, False)
                for way in order:
                    (joined if way else per_row).append(timed(model, rows, way, args.calls))
            ratios = [b / a for a, b in zip(per_row, joined, strict=True)]
            results.append({"rows": batch, "q": q, "per_row_ms": per_row, "joined_ms": joined,
                            "ratio": statistics.median(ratios), "equal": same})  # fmt: skip
            print(f"B={batch:2d} q={q}: per row {statistics.median(per_row):6.2f} ms, "
                  f"joined {statistics.median(joined):6.2f} ms, ratio {statistics.median(ratios):.2f}")  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    env = run_environment()
    (args.out / "tail_logits.json").write_text(json.dumps({"environment": env, "results": results}, indent=1))
    lines = [
        "# The edge's tail over a batch: one LM-head product for all rows against one per row",
        "",
        f"Commit `{env['commit']}`; the demo base model as `splitspec serve` loads it (float32, prepacked), one "
        f"thread; rows after a {CONTEXT}-token context; median of {args.calls} calls, {args.repeats} interleaved "
        "repeats (order alternated); the ratio is the median of the per-repeat ratios.",
        "",
        "    python benchmarks/tail_logits.py " + f"--repeats {args.repeats} --calls {args.calls}",
        "",
        "| rows | query tokens per row | tail + logits, one product per row (ms) | one product for all (ms) "
        "| all / per row | per repeat | logits equal |",
        "|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in results:
        per_repeat = ", ".join(f"{b / a:.2f}" for a, b in zip(r["per_row_ms"], r["joined_ms"], strict=True))
        lines.append(
            f"| {r['rows']} | {r['q']} | {statistics.median(r['per_row_ms']):.2f} "
            f"| {statistics.median(r['joined_ms']):.2f} | **{r['ratio']:.2f}** | {per_repeat} | {r['equal']} |"
        )
    one_row = "At one row both ways are the same call (one row's `row_logits` is `logits`): its ratio is the noise."
    lines += ["", one_row, "", f"Machine: {env.get('platform', '')}; a noisy shared 2-core machine: read the ratios."]
    (args.out / "tail_logits.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
