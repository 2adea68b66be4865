"""Profile: what host work one growable-KV trunk step does, against transformers on the same layers.

``device_targets.py`` times one decode step of the trunk's layers (``LayerStack`` with our growable
``KVCache``) against transformers' ``LlamaModel`` of the same layers and weights with its ``DynamicCache``.
On an H200 ours took 12.1 ms against 8.1 ms, with the host-side time about the wall time (launch bound),
while the aten op counts per layer on CPU were equal. This script builds the same two steps with
``device_targets``'s own checkpoint, shapes and step bodies, warms each up, times ``--repeats`` (default 3)
blocks of ``--steps`` steps per side (synchronised around each), the sides' blocks interleaved in alternating
order, and reports the median of the blocks' medians with each block's; then profiles ``--steps`` more per side
under ``torch.profiler`` and counts, per step,
the aten ops (top-level and all), the CUDA runtime calls (kernel launches, memcpys, synchronisations and
every other runtime call by name) and the device kernels and copies, so that the extra host work shows.

Found on the H200 (2026-12-04, ``benchmarks/results/gpu/h200-2026-12-04b/trunk_step_profile/``): there is
none. Per step ours launched 514 kernels against transformers' 522, with 1 small host-to-device copy and no
synchronisation, and took 9.4 ms against transformers' 18.2 ms in that run, while ``device_targets.py`` in the
same session gave 14.5 against 9.4: a launch-bound step's time follows the host's state, not the code.

    PYTHONPATH=src:. python benchmarks/trunk_step_profile.py --device cuda --dtype bfloat16 \\
        --shape llama-3.2-1b --context 512 --steps 20 --with-stack --out /tmp/trunk_step_profile
    python benchmarks/trunk_step_profile.py --device cpu --dtype float32 --shape tiny --steps 3 --out /tmp/tsp

Writes into --out: ``{side}_ops.txt`` (``prof.key_averages().table`` by self CPU time; it includes the
harness's synchronisations between steps, which the counts below leave out), ``{side}_stacks.txt`` with
``--with-stack`` (the same grouped by the 8 innermost Python frames), ``{side}_trace.json`` with ``--trace``
(a Chrome trace), ``summary.json`` and ``summary.md``. Sides: ``ours`` (growable KV, eager) and
``transformers``. Every count is over the events inside the ``trunk_step`` ranges, divided by the steps.
"""

from __future__ import annotations

import argparse
import bisect
import json
import logging
import re
import shlex
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers
from torch._C._autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

from splitspec.devices import resolve_device, synchronize
from splitspec.models.kv_cache import KVCache
from splitspec.models.precision import dtype_from_name

sys.path.insert(0, str(Path(__file__).resolve().parent))
from device_targets import (  # the sibling benchmark
    EDGE_LAYERS,
    SHAPES,
    _time_steps,
    build_checkpoint,
    transformers_step,
    trunk_and_transformers,
    trunk_step,
)

log = logging.getLogger("bench.trunk_step_profile")

SIDES = ("ours", "transformers")
STEP_RANGE = "trunk_step"  # the record_function around each profiled step
WARM_UP = 10
LAUNCH = re.compile(r"^cu(da)?(LaunchKernel|LaunchCooperativeKernel|GraphLaunch)")
MEMCPY = re.compile(r"^cu(da)?Memcpy")
SYNC = re.compile(r"^cu(da)?(StreamSynchronize|DeviceSynchronize|EventSynchronize|CtxSynchronize)")
RUNTIME = re.compile(r"^cu(da)?[A-Z]")  # a CUDA runtime or driver API call


def build_steps(
    directory: Path, dtype: torch.dtype, device: torch.device, context: int
) -> dict[str, Callable[[], Any]]:
    """The two one-token steps of ``device_targets.trunk_vs_transformers`` (growable KV and transformers),
    after a prefill of ``context`` tokens; each leaves its cache at ``context`` entries again."""
    trunk, hf, hf_config, prefix, token = trunk_and_transformers(directory, dtype, device, context)
    ours = trunk_step(trunk, KVCache(), prefix, token)
    log.info("trunk of %d layers, context %d, on %s", len(trunk.layers), context, device)
    return {"ours": ours, "transformers": transformers_step(hf, hf_config, prefix, token)}


def _per_step(counter: Counter[str], steps: int) -> dict[str, float]:
    return {name: n / steps for name, n in counter.most_common()}


def _matching(counter: Counter[str], pattern: re.Pattern[str]) -> dict[str, int]:
    return {name: n for name, n in counter.items() if pattern.search(name)}


def count_events(prof: profile, steps: int) -> dict[str, Any]:
    """Per-step counts of the events inside the ``trunk_step`` ranges (host) and of the device's activity."""
    events = list(prof.events())
    ranges = sorted(
        (e.time_range.start, e.time_range.end)
        for e in events
        if e.name == STEP_RANGE and e.device_type == DeviceType.CPU
    )
    if len(ranges) != steps:
        log.warning("%d %s ranges for %d steps", len(ranges), STEP_RANGE, steps)
    starts = [s for s, _ in ranges]

    def in_step(e: Any) -> bool:
        i = bisect.bisect_right(starts, e.time_range.start) - 1
        return i >= 0 and e.time_range.end <= ranges[i][1]

    host = [e for e in events if e.device_type == DeviceType.CPU and e.name != STEP_RANGE and in_step(e)]
    python = [e for e in host if getattr(e, "is_python_function", False)]  # only with --with-stack
    host = [e for e in host if not getattr(e, "is_python_function", False)]
    device = [e for e in events if e.device_type != DeviceType.CPU and e.name != STEP_RANGE]

    def top_level(e: Any) -> bool:
        parent = e.cpu_parent
        while parent is not None:
            if parent.name.startswith("aten::"):
                return False
            parent = parent.cpu_parent
        return True

    aten_all = Counter(e.name for e in host if e.name.startswith("aten::"))
    aten_top = Counter(e.name for e in host if e.name.startswith("aten::") and top_level(e))
    runtime = Counter(e.name for e in host if RUNTIME.search(e.name))
    runtime_anywhere = Counter(e.name for e in events if e.device_type == DeviceType.CPU and RUNTIME.search(e.name))
    if runtime_anywhere and not runtime:
        log.warning(
            "no CUDA runtime call falls inside a %s range (clock domains?): see the _ops.txt tables", STEP_RANGE
        )
    self_us: Counter[str] = Counter()
    calls: Counter[str] = Counter()
    for e in host:
        self_us[e.name] += e.self_cpu_time_total
        calls[e.name] += 1
    kernels = Counter(e.name for e in device)
    device_copies = Counter(e.name for e in device if e.name.startswith(("Memcpy", "Memset")))
    launches, memcpys, syncs = _matching(runtime, LAUNCH), _matching(runtime, MEMCPY), _matching(runtime, SYNC)
    python_self_us: Counter[str] = Counter()
    python_calls = Counter(e.name for e in python)
    for e in python:
        python_self_us[e.name] += e.self_cpu_time_total
    step_cpu_us = [e - s for s, e in ranges]
    return {
        "profiled_steps": len(ranges),
        "profiled_step_cpu_ms_median": statistics.median(step_cpu_us) / 1e3 if step_cpu_us else None,
        "aten_ops_top_level_per_step": aten_top.total() / steps,
        "aten_ops_all_per_step": aten_all.total() / steps,
        "kernel_launches_per_step": sum(launches.values()) / steps,
        "memcpy_calls_per_step": sum(memcpys.values()) / steps,
        "sync_calls_per_step": sum(syncs.values()) / steps,
        "runtime_calls_per_step": runtime.total() / steps,
        "device_events_per_step": kernels.total() / steps,
        "device_copies_per_step": device_copies.total() / steps,
        "kernel_launches_by_name": _per_step(Counter(launches), steps),
        "memcpy_calls_by_name": _per_step(Counter(memcpys), steps),
        "sync_calls_by_name": _per_step(Counter(syncs), steps),
        "runtime_calls_by_name": _per_step(runtime, steps),
        "runtime_calls_by_name_incl_harness": _per_step(runtime_anywhere, steps),
        "device_copies_by_name": _per_step(device_copies, steps),
        "device_events_by_name": _per_step(kernels, steps),
        "aten_top_level_by_name": _per_step(aten_top, steps),
        "python_calls_per_step": python_calls.total() / steps,
        "top_self_cpu_python": [
            {"name": name, "self_cpu_us_per_step": us / steps, "count_per_step": python_calls[name] / steps}
            for name, us in python_self_us.most_common(15)
        ],
        "top_self_cpu": [
            {"name": name, "self_cpu_us_per_step": us / steps, "count_per_step": calls[name] / steps}
            for name, us in self_us.most_common(15)
        ],
    }


def timed_blocks(
    steps: dict[str, Callable[[], Any]], device: torch.device, n: int, repeats: int
) -> dict[str, dict[str, Any]]:
    """Warm each side up, then time ``repeats`` blocks of ``n`` steps per side, interleaved: the sides in their
    order in even repeats, reversed in odd ones, so that neither always runs first on a drifting host.

    Per side: ``wall_ms_median`` and ``launch_ms_median``, the medians of the blocks' medians, and each block's
    median (``..._per_repeat``, in repeat order).
    """
    for step in steps.values():
        _time_steps(step, device, WARM_UP)
    names = list(steps)
    launch: dict[str, list[float]] = {name: [] for name in names}
    wall: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            block_launch, block_wall = _time_steps(steps[name], device, n)
            launch[name].append(statistics.median(block_launch))
            wall[name].append(statistics.median(block_wall))
            log.info("repeat %d %s: %.3f ms/step (launch %.3f)", r, name, wall[name][-1], launch[name][-1])
    return {
        name: {
            "wall_ms_median": statistics.median(wall[name]),
            "launch_ms_median": statistics.median(launch[name]),
            "wall_ms_per_repeat": wall[name],
            "launch_ms_per_repeat": launch[name],
        }
        for name in names
    }


def profile_side(
    name: str, step: Callable[[], Any], device: torch.device, steps: int, out: Path, with_stack: bool, trace: bool
) -> dict[str, Any]:
    """Profile ``steps`` steps (after :func:`timed_blocks` warmed them up); write the op tables; return the counts."""
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda" and torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities), record_function(STEP_RANGE):
        pass  # the profiler's first record_function imports a module: not in a counted step
    profiled_ms = []
    with profile(activities=activities, record_shapes=False, with_stack=with_stack) as prof:
        for _ in range(steps):
            synchronize(device)
            t0 = time.perf_counter()
            with record_function(STEP_RANGE):
                step()
            synchronize(device)
            profiled_ms.append((time.perf_counter() - t0) * 1e3)
    averages = prof.key_averages()
    (out / f"{name}_ops.txt").write_text(
        f"# {name}: {steps} profiled steps (the harness's synchronisations between steps are included here)\n"
        + averages.table(sort_by="self_cpu_time_total", row_limit=60)
        + "\n"
    )
    if with_stack:
        stacks = prof.key_averages(group_by_stack_n=8)
        (out / f"{name}_stacks.txt").write_text(stacks.table(sort_by="self_cpu_time_total", row_limit=60) + "\n")
    if trace:
        prof.export_chrome_trace(str(out / f"{name}_trace.json"))
    figures = {
        "profiled_wall_ms_median": statistics.median(profiled_ms),
        **count_events(prof, steps),
    }
    log.info(
        "%s: %.1f top-level aten ops, %.1f launches, %.1f syncs, %.1f memcpys per step",
        name,
        figures["aten_ops_top_level_per_step"],
        figures["kernel_launches_per_step"],
        figures["sync_calls_per_step"],
        figures["memcpy_calls_per_step"],
    )
    return figures


ROWS = (
    ("wall ms / step (median of the repeats' medians, synced)", "wall_ms_median", "{:.3f}"),
    ("host launch ms / step (median of the repeats' medians)", "launch_ms_median", "{:.3f}"),
    ("profiled wall ms / step (median, one block per side)", "profiled_wall_ms_median", "{:.3f}"),
    ("top-level aten ops / step", "aten_ops_top_level_per_step", "{:.1f}"),
    ("all aten ops / step (incl. nested)", "aten_ops_all_per_step", "{:.1f}"),
    ("kernel launches / step", "kernel_launches_per_step", "{:.1f}"),
    ("sync calls / step", "sync_calls_per_step", "{:.1f}"),
    ("memcpy calls / step", "memcpy_calls_per_step", "{:.1f}"),
    ("CUDA runtime calls / step (all)", "runtime_calls_per_step", "{:.1f}"),
    ("Python calls / step (with --with-stack only)", "python_calls_per_step", "{:.1f}"),
    ("device kernels + copies / step", "device_events_per_step", "{:.1f}"),
)


def _names(d: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:g}" for k, v in d.items()) or "-"


def write_summary(results: dict[str, Any], out: Path) -> str:
    (out / "summary.json").write_text(json.dumps(results, indent=2))
    sides = results["sides"]
    md = [
        f"# Trunk step profile: {results['device_name']}, {results['shape']} ({results['dtype']})",
        "",
        f"torch {results['torch']}, transformers {results['transformers']}; {results['trunk_layers']} trunk layers,"
        f" context {results['context']}; after {WARM_UP} warm-up steps, {results['repeats']} interleaved repeats"
        f" (sides' order alternating) of {results['steps']} timed steps per side, then {results['steps']} profiled"
        " steps per side. Counts are per step, inside the step ranges.",
        "",
        "| figure | " + " | ".join(SIDES) + " |",
        "|---|" + "---|" * len(SIDES),
        *(f"| {label} | " + " | ".join(fmt.format(sides[s][key]) for s in SIDES) + " |" for label, key, fmt in ROWS),
        "| wall ms / step, each repeat's median | "
        + " | ".join(", ".join(f"{v:.3f}" for v in sides[s]["wall_ms_per_repeat"]) for s in SIDES)
        + " |",
        *(
            f"| {label} by name | " + " | ".join(_names(sides[s][key]) for s in SIDES) + " |"
            for label, key in (
                ("sync calls", "sync_calls_by_name"),
                ("memcpy calls", "memcpy_calls_by_name"),
                ("device copies", "device_copies_by_name"),
            )
        ),
        "",
    ]
    for title, key in (
        ("top-level aten ops", "aten_top_level_by_name"),
        ("CUDA runtime calls", "runtime_calls_by_name"),
        ("device kernels and copies", "device_events_by_name"),
    ):
        a, b = (sides[s][key] for s in SIDES)
        differ = sorted(
            (n for n in a.keys() | b.keys() if a.get(n, 0) != b.get(n, 0)),
            key=lambda n: -abs(a.get(n, 0) - b.get(n, 0)),
        )
        md += [f"## {title} whose count per step differs", "", "| name | " + " | ".join(SIDES) + " |", "|---|---|---|"]
        md += [f"| {n} | {a.get(n, 0):g} | {b.get(n, 0):g} |" for n in differ] or ["| (none) | | |"]
        md.append("")
    for s in SIDES:
        if sides[s]["top_self_cpu_python"]:
            md += [
                f"## {s}: top 15 Python frames by self CPU time",
                "",
                "| frame | self CPU us / step | calls / step |",
            ]
            md.append("|---|---|---|")
            md += [
                f"| {r['name']} | {r['self_cpu_us_per_step']:.1f} | {r['count_per_step']:g} |"
                for r in sides[s]["top_self_cpu_python"]
            ]
            md.append("")
    for s in SIDES:
        md += [f"## {s}: top 15 by self CPU time", "", "| op | self CPU us / step | count / step |", "|---|---|---|"]
        md += [
            f"| {r['name']} | {r['self_cpu_us_per_step']:.1f} | {r['count_per_step']:g} |"
            for r in sides[s]["top_self_cpu"]
        ]
        md.append("")
    text = "\n".join(md)
    (out / "summary.md").write_text(text)
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--device", default="cuda", help="cpu, cuda, cuda:N or auto")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--shape", default="llama-3.2-1b", choices=sorted(SHAPES))
    parser.add_argument("--context", type=int, default=512, help="prefix before the steps")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per block and profiled steps per side")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved timed blocks per side (default 3)")
    parser.add_argument("--with-stack", action="store_true", help="also write {side}_stacks.txt (Python frames)")
    parser.add_argument("--trace", action="store_true", help="also write {side}_trace.json (Chrome trace)")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/trunk_step_profile"), help="folder")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("splitspec").setLevel(logging.WARNING)
    if args.steps < 1:
        raise SystemExit("--steps must be at least 1")
    if args.repeats < 1:
        raise SystemExit("--repeats must be at least 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    dtype = dtype_from_name(args.dtype)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        log.info("building a random %s checkpoint (%s) on %s", args.shape, args.dtype, device)
        build_checkpoint(directory, args.shape, dtype, device)
        steps = build_steps(directory, dtype, device, args.context)
        timed = timed_blocks(steps, device, args.steps, args.repeats)
        sides = {
            name: {**timed[name], **profile_side(name, fn, device, args.steps, args.out, args.with_stack, args.trace)}
            for name, fn in steps.items()
        }
    results = {
        "argv": shlex.join(sys.argv[1:] if argv is None else argv),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "shape": args.shape,
        "dtype": args.dtype,
        "trunk_layers": SHAPES[args.shape]["num_hidden_layers"] - sum(EDGE_LAYERS),
        "context": args.context,
        "steps": args.steps,
        "repeats": args.repeats,
        "warm_up": WARM_UP,
        "torch_threads": torch.get_num_threads(),
        "run_s": time.perf_counter() - started,
        "sides": sides,
    }
    text = write_summary(results, args.out)
    log.info("wrote %s\n%s", args.out, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
