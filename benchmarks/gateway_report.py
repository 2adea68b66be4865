"""The report of ``gateway_load.py``: its summary (medians, each level against the lone stream), markdown and plot."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from gateway_load import lone_rate
from gateway_measures import quantile

# per-level figures of runs since 2026-12-04: throughput while every stream is active, vLLM's inter-token latency
# (per delivery) and time per output token
LATER_KEYS = (
    "all_active_tokens_per_s", "delivery_itl_p50_s", "delivery_itl_p99_s", "tpot_p50_s", "tpot_p99_s"
)  # fmt: skip


LATENCY_KEYS = (
    "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s", "delivery_itl_p50_s", "delivery_itl_p99_s", "tpot_p50_s",
    "tpot_p99_s",
)  # fmt: skip
nan = float("nan")


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def schedule_of(run: dict[str, Any]) -> str:
    """How a level spread its requests over its streams (``gateway_load.SCHEDULES``; runs before 2026-12-05 gave
    each stream its own: ``streams``)."""
    return str(run.get("schedule", "streams"))


def same_requests(runs: list[dict[str, Any]], n: int, schedule: str | None = None) -> dict[str, list[float]]:
    """Level ``n`` (of ``schedule``; None: any) against the lone stream on the same requests, paired by repeat:
    each repeat's level tok/s over the lone stream's rate on the prompts that level sent (``x_same``; ``x_active``:
    the level's rate while all its streams were active); the lone stream's inter-token p99 on the level's prompts,
    per token (``lone_itl_p99_s``) and per delivery (``lone_delivery_itl_p99_s``); and the level's inter-token p99
    over those, per token (``itl_p99_ratio``) and per delivery (``delivery_itl_p99_ratio``)."""
    keys = (
        "x_same",
        "x_active",
        "lone_itl_p99_s",
        "lone_delivery_itl_p99_s",
        "itl_p99_ratio",
        "delivery_itl_p99_ratio",
    )
    out: dict[str, list[float]] = {key: [] for key in keys}
    levels = [r for r in runs if r["streams"] == n and (schedule is None or schedule_of(r) == schedule)]
    for level in levels:
        # one stream runs the same requests whatever the schedule
        lone = next((r for r in runs if r["streams"] == 1 and r["repeat"] == level["repeat"]), None)
        if lone is None or "requests" not in lone:
            continue
        used = set(level["prompts"])
        # how often the level sent each prompt (runs before 2026-12-05 sent each once and did not record it)
        rate = lone_rate(lone["requests"], {p: c for p, c in level.get("prompt_uses", [(p, 1) for p in used])})
        out["x_same"].append(level["tokens_per_s"] / rate)
        if "all_active_tokens_per_s" in level:
            out["x_active"].append(level["all_active_tokens_per_s"] / rate)
        mine = [r for r in lone["requests"] if r["prompt"] in used]
        lone_p99 = quantile([g for r in mine for g in r["gaps"]], 0.99)
        out["lone_itl_p99_s"].append(lone_p99)
        if "itl_p99_s" in level:
            out["itl_p99_ratio"].append(level["itl_p99_s"] / lone_p99)
        if all("delivery_gaps" in r for r in mine):
            lone_delivery_p99 = quantile([g for r in mine for g in r["delivery_gaps"]], 0.99)
            out["lone_delivery_itl_p99_s"].append(lone_delivery_p99)
            if "delivery_itl_p99_s" in level:
                out["delivery_itl_p99_ratio"].append(level["delivery_itl_p99_s"] / lone_delivery_p99)
    return out


def _rows(runs: list[dict[str, Any]], schedule: str) -> list[dict[str, Any]]:
    """The summary rows (one per level, medians over repeats) of ``runs``' levels of ``schedule``."""
    rows = []
    for n in sorted({r["streams"] for r in runs}):
        mine = [r for r in runs if r["streams"] == n and schedule_of(r) == schedule]
        if not mine:
            continue
        row: dict[str, Any] = {"streams": n, "schedule": schedule, "runs": len(mine)}
        for key in ("tokens_per_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s", *LATER_KEYS):
            row[key] = _median([r[key] for r in mine if key in r])
        for group in ("cores", "cpu_ms_per_token", "per_step"):
            names = {name for r in mine for name in r.get(group, {})}
            row[group] = {k: statistics.median(r[group][k] for r in mine if k in r[group]) for k in sorted(names)}
        row["per_repeat_tokens_per_s"] = [r["tokens_per_s"] for r in mine]
        paired = same_requests(runs, n, schedule)
        row["vs_1_stream"] = _median(paired["x_same"])
        row["vs_1_stream_active"] = _median(paired["x_active"])
        row["per_repeat_vs_1_stream"] = paired["x_same"]
        row["lone_itl_p99_s"] = _median(paired["lone_itl_p99_s"])
        row["lone_delivery_itl_p99_s"] = _median(paired["lone_delivery_itl_p99_s"])
        # the level's inter-token p99 over the lone stream's on its prompts: median of the per-repeat ratios
        row["itl_p99_vs_1_stream"] = _median(paired["itl_p99_ratio"])
        row["delivery_itl_p99_vs_1_stream"] = _median(paired["delivery_itl_p99_ratio"])
        row["per_repeat_itl_p99_vs_1_stream"] = paired["itl_p99_ratio"]
        rows.append(row)
    return rows


def summarise(raw: dict[str, Any], primary: str = "streams") -> dict[str, Any]:
    """Medians per server and level, each level against the lone stream, and the targets' checks. Levels of the
    ``primary`` schedule are the server's rows (``out[label]``); another schedule's are ``out["label, schedule"]``
    (``out["servers"]`` lists the keys)."""
    out: dict[str, Any] = {"servers": []}
    others: list[str] = []  # the engine's other schedules
    for label, runs in raw["levels"].items():
        schedules = [primary, *sorted({schedule_of(r) for r in runs if r["streams"] > 1} - {primary})]
        for schedule in schedules:
            key = label if schedule == primary else f"{label}, {schedule}"
            out[key] = _rows(runs, schedule)
            out["servers"].append(key)
            if label == "engine" and schedule != primary:
                others.append(schedule)
    engine = out["engine"]
    by_n = {r["streams"]: r for r in engine}
    checks: dict[str, Any] = {
        "x16 (target >= 10)": by_n[16]["vs_1_stream"] if 16 in by_n else None,
        "x32 (target >= 16)": by_n[32]["vs_1_stream"] if 32 in by_n else None,
        "x16 per repeat": by_n[16]["per_repeat_vs_1_stream"] if 16 in by_n else None,
        "x32 per repeat": by_n[32]["per_repeat_vs_1_stream"] if 32 in by_n else None,
        "itl p99 16 / 1 (target <= 2)": by_n[16]["itl_p99_vs_1_stream"] if 16 in by_n else None,
        "itl p99 16 / 1 per repeat": by_n[16]["per_repeat_itl_p99_vs_1_stream"] if 16 in by_n else None,
        # None: the run skipped the prefill measure (--no-prefill)
        "prefill p99 / p50 (target <= 3)": _median([p["ratio"] for p in raw["prefill"]]) if raw["prefill"] else None,
    }
    if 16 in by_n and by_n[16].get("delivery_itl_p99_s") is not None:  # runs since 2026-12-04
        checks["x16 while all 16 streams are active"] = by_n[16]["vs_1_stream_active"]
        checks["x32 while all 32 streams are active"] = by_n[32]["vs_1_stream_active"] if 32 in by_n else None
        checks["itl p99 16 / 1, per delivery (vLLM's ITL)"] = by_n[16]["delivery_itl_p99_vs_1_stream"]
        if raw["prefill"]:
            delivery = [p["delivery_ratio"] for p in raw["prefill"] if "delivery_ratio" in p]
            checks["prefill p99 / p50, per delivery (vLLM's ITL)"] = _median(delivery)
            control = [p["delivery_ratio"] for p in raw.get("prefill_control", []) if "delivery_ratio" in p]
            checks["same window, no prefill: p99 / p50, per delivery"] = _median(control)
    for schedule in others:  # the same levels under another schedule, in the same run
        for n in (16, 32):
            row = next((r for r in out[f"engine, {schedule}"] if r["streams"] == n), None)
            if row is not None:
                checks[f"x{n}, {schedule} schedule"] = row["vs_1_stream"]
                checks[f"x{n}, {schedule} schedule, per repeat"] = row["per_repeat_vs_1_stream"]
    if raw.get("prefill_control"):  # the same ratio in the same window with no long prompt, and the prefill's share
        checks["same window, no prefill: p99 / p50"] = statistics.median(p["ratio"] for p in raw["prefill_control"])
        checks["prefill p99 / no-prefill p99 (paired by repeat)"] = statistics.median(
            p["itl_p99_during_s"] / c["itl_p99_during_s"]
            for p in raw["prefill"] for c in raw["prefill_control"] if p["repeat"] == c["repeat"]
        )  # fmt: skip
    if "baseline" in out:
        # lone stream, paired by repeat: engine / baseline
        pairs = [
            e["tokens_per_s"] / b["tokens_per_s"]
            for e in raw["levels"]["engine"] for b in raw["levels"]["baseline"]
            if e["streams"] == b["streams"] == 1 and e["repeat"] == b["repeat"]
        ]  # fmt: skip
        checks["lone stream engine / baseline (target >= 0.95)"] = statistics.median(pairs)
        checks["lone stream per repeat"] = pairs
        # 16 streams of the primary schedule (the baseline's), paired by repeat
        pairs16 = [
            e["tokens_per_s"] / b["tokens_per_s"]
            for e in raw["levels"]["engine"] for b in raw["levels"]["baseline"]
            if e["streams"] == b["streams"] == 16 and e["repeat"] == b["repeat"]
            and schedule_of(e) == schedule_of(b) == primary
        ]  # fmt: skip
        if pairs16:
            checks["16 streams engine / baseline"] = statistics.median(pairs16)
            checks["16 streams per repeat"] = pairs16
    out["checks"] = checks
    batches: dict[str, list[float]] = {}
    for r in raw["levels"]["engine"]:
        for key, b in r["edge_batches"].items():
            batches.setdefault(key, []).append(b["ms_per_sequence"])
    out["edge_ms_per_sequence"] = {k: statistics.median(v) for k, v in sorted(batches.items(), key=_batch_key)}
    return out


def _batch_key(item: tuple[str, Any]) -> tuple[str, int]:
    part, rows = item[0].split(":")
    return part, int(rows)


def _long_prompt_sentence(results: dict[str, Any]) -> str:
    """The prefill-interference prompt's length and median prefill time, and the base copy both ends loaded when
    the prompt needed more positions than the demo base declares ("" for results from before they were recorded)."""
    if "long_prompt" not in results or not results["raw"]["prefill"]:  # before they were recorded; --no-prefill
        return ""
    seconds = statistics.median(p["prefill_s"] for p in results["raw"]["prefill"])
    sentence = f" The prefill-interference prompt: {results['long_prompt']} tokens (and prefilled in a median "
    sentence += f"{seconds:.2f} s among 16 streams)"
    if "base_positions" in results:
        return sentence + f"; both ends load a copy of the base model declaring {results['base_positions']} positions."
    return sentence + "."


def schedule_sentence(results: dict[str, Any]) -> str:
    """How the run spread each level's requests over its streams (gateway_load's docstring)."""
    schedules = results.get("schedules", ["streams"])  # runs before 2026-12-05 had the one
    said = {
        "queue": "`queue`: N requests in flight, each of the N streams taking the next request from one queue as its "
        "last one finishes (vLLM's `benchmark_serving --max-concurrency N`)",
        "streams": "`streams`: each of the N streams its own requests, back to back, the level ending with the "
        "slowest stream (this benchmark's schedule until 2026-12-05)",
    }
    sentence = f"Each level of N streams runs {results['requests']} x N requests; schedule {said[schedules[0]]}."
    for other in schedules[1:]:
        sentence += f" Beside it at 16 and 32 streams (rows `engine, {other}`), schedule {said[other]}."
    return sentence


def markdown(results: dict[str, Any]) -> str:
    s = results["summary"]
    lines = [
        "# Gateway load: `splitspec serve` on the edge engine, 80 ms WAN, demo models in float32",
        "",
        f"Commit `{results['commit'][:12]}`"
        + (f", baseline `{results['baseline']}`" if results["baseline"] else "")
        + (f" (the engine from a worktree of `{results['engine_commit']}`)" if results.get("engine_commit") else "")
        + (f"; the engine's server runs {results['workers']} workers" if results.get("workers", 1) > 1 else "")
        + f"; {results['repeats']} interleaved repeats, medians; "
        f"128-token prompts (each unique: no prefix-cache hits), {results['max_tokens']} tokens out, greedy, "
        "`--speculate auto` with the draft model." + _long_prompt_sentence(results),
        f"Reproduce: `{results['command']}`.",
        "",
        schedule_sentence(results),
        "",
        "The lone stream runs every prompt a level may send (since 2026-12-05: each of a pool of 64 once; the "
        'levels send each prompt they use equally often), one after another. "vs 1 stream" is a level\'s tok/s over '
        "the lone stream's on the same prompts, each weighted by how often the level sent it (paired by repeat, "
        "median): how many tokens a speculative step delivers depends on the text.",
        "",
        "| server | streams | aggregate tok/s | while all active | vs 1 stream | vs 1 stream, all active |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for label in s["servers"]:
        for r in s[label]:
            lines.append(
                f"| {label} | {r['streams']} | {r['tokens_per_s']:.1f} | {r.get('all_active_tokens_per_s', nan):.1f} "
                f"| {r['vs_1_stream']:.2f}x | {r.get('vs_1_stream_active', nan):.2f}x |"
            )
    lines += [
        "",
        "Latency, ms (TTFT: time to the first token; ITL per token: a delivery of k tokens g ms after the last gives "
        "each g / k; ITL per delivery: g, as vLLM's benchmark counts it; TPOT: a request's time per token after "
        "its first):",
        "",
        "| server | streams | TTFT p50 | TTFT p99 | ITL per token p50 | p99 | ITL per delivery p50 | p99 | TPOT p50 "
        "| TPOT p99 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label in s["servers"]:
        for r in s[label]:
            cells = [r.get(k, nan) for k in LATENCY_KEYS]
            lines.append(f"| {label} | {r['streams']} | " + " | ".join(f"{v * 1e3:.0f}" for v in cells) + " |")
    lines += ["", "## Targets", "", "Every ratio here is the median of ratios paired by repeat (per repeat: the "
              "values listed beside it).", "", "| check | value |", "|---|---|"]  # fmt: skip
    for key, value in s["checks"].items():
        if value is None:  # a level this run did not measure
            continue
        shown = ", ".join(f"{v:.2f}" for v in value) if isinstance(value, list) else f"{value:.2f}"
        lines.append(f"| {key} | {shown} |")
    cpu_rows = [r for r in s.get("engine", []) if r.get("cores")]
    if cpu_rows:
        names = sorted({n for r in cpu_rows for n in r["cores"]})
        lines += ["", "## Where the CPU goes (engine): cores each process kept busy, and CPU ms per output token", "",
                  "| streams | " + " | ".join(f"{n} cores" for n in names) + " | "
                  + " | ".join(f"{n} ms/token" for n in names) + " |",
                  "|---:|" + "---:|" * (2 * len(names))]  # fmt: skip
        for r in cpu_rows:
            cells = [f"{r['cores'].get(n, float('nan')):.2f}" for n in names]
            cells += [f"{r['cpu_ms_per_token'].get(n, float('nan')):.2f}" for n in names]
            lines.append(f"| {r['streams']} | " + " | ".join(cells) + " |")
        lines += ["", "`serve` is one process whose Python work shares one interpreter lock: past about one core "
                  "its threads (event loop, head, tail, drafting) wait for each other.", "",
                  "## One round trip, by part (engine, mean ms per trip; from serve's /metrics)", "",
                  "| streams | network | of which trunk queue | edge | of which queued | cloud | serialize "
                  "| tokens per decode trip |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
        for r in cpu_rows:
            p = r.get("per_step", {})
            parts = ("network_ms", "cloud_queue_ms", "edge_ms", "edge_queue_ms", "cloud_ms", "serialize_ms")
            cells = [f"{p[k]:.1f}" if k in p else "" for k in parts]
            trips = f"{p['tokens_per_trip']:.2f}" if "tokens_per_trip" in p else ""
            lines.append(f"| {r['streams']} | " + " | ".join(cells) + f" | {trips} |")
        lines += ["", "network: the round trip less the trunk's compute; of which trunk queue: the step's wait on the "
                  "trunk before its compute (its batches), as the trunk reports it; edge: the head's and "
                  "the tail's forwards with their queues; of which queued: the wait for their batches (gathering, "
                  "and the batches ahead).", ""]  # fmt: skip
    lines += ["", "## Edge compute per sequence against the batch size (engine, medians over levels)", "",
              "| part | rows | ms per sequence |", "|---|---:|---:|"]  # fmt: skip
    if not s["edge_ms_per_sequence"]:
        lines.append("| (not collected: with several workers a /metrics scrape reaches one of them) | | |")
    for key, ms in s["edge_ms_per_sequence"].items():
        part, rows = key.split(":")
        lines.append(f"| {part} | {rows} | {ms:.3f} |")
    lines += ["", f"Machine: {results['platform']}, {results['cpu_count']} CPUs shared by the trunk, the link, the "
              "edge server(s) and the load. Read the ratios, not lone absolute times.", ""]  # fmt: skip
    return "\n".join(lines)


def plot(results: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    summary = results["summary"]
    colours = ("tab:blue", "tab:orange", "tab:green", "tab:red")
    for label, colour in zip(summary.get("servers", ["engine", "baseline"]), colours, strict=False):
        rows = summary.get(label, [])
        if rows:
            axes[0].plot(
                [r["streams"] for r in rows], [r["tokens_per_s"] for r in rows], "o-", label=label, color=colour
            )
            axes[1].plot([r["streams"] for r in rows], [r["itl_p99_s"] * 1e3 for r in rows], "o-", label=label,
                         color=colour)  # fmt: skip
    axes[0].set_xlabel("concurrent streams")
    axes[0].set_ylabel("aggregate output tok/s (median)")
    axes[1].set_xlabel("concurrent streams")
    axes[1].set_ylabel("inter-token latency p99 (ms)")
    for ax in axes:
        ax.legend(fontsize=8)
    fig.suptitle("splitspec serve through an 80 ms link")
    fig.tight_layout()
    fig.savefig(out / "gateway_load.png", dpi=120)
    plt.close(fig)
