"""Benchmark: the shipped float16 base model on this CPU, computed in float16 and in float32.

What ``--dtype auto`` decides from (models/precision.py): a 1-token and a 9-token decode step after a
64-token prefix, and a 512-token prefill, through splitspec's own whole-model stack (the layers both
sides of a split run), one thread, both dtypes interleaved round by round, medians. Also records
what ``auto`` picks here and why (the CPU's flags as torch reports them).

    python benchmarks/cpu_dtype.py [--out benchmarks/results/cpu_dtype] [--rounds 3] [--repeats 15]

Writes cpu_dtype.json and cpu_dtype.md into --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from splitspec.demo import embedded_model
from splitspec.models.checkpoint import Checkpoint
from splitspec.models.kv_cache import KVCache
from splitspec.models.loading import load_full
from splitspec.models.masks import chain
from splitspec.models.precision import auto_dtype, dtype_name
from splitspec.models.stack import FullModel
from splitspec.run_info import run_environment

PREFIX = 64  # committed tokens before each timed decode step
STEPS = (1, 9)  # decode step sizes, tokens
PREFILL = 512  # prefill length, tokens


def time_step(model: FullModel, cache: KVCache, tokens: torch.Tensor, start: int) -> float:
    """One forward of ``tokens`` (q,) at positions ``start..``, then the cache is cut back; milliseconds."""
    q = tokens.shape[0]
    positions = torch.arange(start, start + q, dtype=torch.int32)
    parents = torch.tensor(chain(q), dtype=torch.int32)
    t0 = time.perf_counter()
    with torch.inference_mode():
        model.forward(tokens, positions, parents, cache)
    ms = (time.perf_counter() - t0) * 1e3
    cache.truncate(start)
    return ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/cpu_dtype"))
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument("--repeats", type=int, default=15, help="timed forwards per case and round (default 15)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    base = embedded_model("base")
    ckpt = Checkpoint(base)
    vocab = int(ckpt.config.vocab_size)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, vocab, (PREFILL,), generator=gen)
    models = {dt: load_full(ckpt, dt) for dt in (torch.float16, torch.float32)}
    caches = {}
    for dt, model in models.items():  # the committed prefix, once per dtype
        caches[dt] = KVCache()
        with torch.inference_mode():
            model.forward(
                tokens[:PREFIX], torch.arange(PREFIX, dtype=torch.int32), torch.tensor(chain(PREFIX)), caches[dt]
            )
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.rounds):
        for dt, model in models.items():
            for q in STEPS:
                step = tokens[PREFIX : PREFIX + q]
                ms = [time_step(model, caches[dt], step, PREFIX) for _ in range(args.repeats)]
                times.setdefault((dtype_name(dt), f"decode q={q}"), []).extend(ms)
            empty = KVCache()
            prefill = [time_step(model, empty, tokens, 0) for _ in range(max(1, args.repeats // 5))]
            times.setdefault((dtype_name(dt), f"prefill {PREFILL}"), []).extend(prefill)
    chosen, why = auto_dtype(torch.float16, torch.device("cpu"))
    cases = sorted({case for _, case in times}, key=lambda c: (c.startswith("prefill"), c))
    rows = []
    for case in cases:
        f16, f32 = statistics.median(times[("float16", case)]), statistics.median(times[("float32", case)])
        rows.append({"case": case, "float16_ms": f16, "float32_ms": f32, "float16_over_float32": f16 / f32})
    results = {
        "model": str(Path(base).resolve().relative_to(Path(__file__).resolve().parents[1])),  # repository-relative
        "auto_on_this_cpu": {"dtype": dtype_name(chosen), "why": why},
        "threads": 1,
        "rounds": args.rounds,
        "repeats": args.repeats,
        "rows": rows,
        "environment": run_environment(),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cpu_dtype.json").write_text(json.dumps(results, indent=2) + "\n")
    lines = [
        "# The shipped float16 base model on this CPU: float16 vs float32",
        "",
        f"`--dtype auto` here: {dtype_name(chosen)} ({why}). One thread, medians of {args.rounds} interleaved "
        f"rounds x {args.repeats} forwards; decode steps after a {PREFIX}-token prefix.",
        "",
        "| case | float16 (ms) | float32 (ms) | float16 / float32 |",
        "|---|---:|---:|---:|",
        *(
            f"| {r['case']} | {r['float16_ms']:.2f} | {r['float32_ms']:.2f} | {r['float16_over_float32']:.2f}x |"
            for r in rows
        ),
        "",
    ]
    (args.out / "cpu_dtype.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
