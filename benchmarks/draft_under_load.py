"""Is the draft model worth its CPU under load? ``auto`` with and without it, at 1 and 16 streams.

At 16 streams the edge server is bound by one core (its interpreter), and the draft model's
proposals are about a third of that interpreter's time (py-spy ``--gil``). Each sequence's
controller judges drafting by its own step's latency, in which the queueing of a saturated engine
is part of T(q) while a draft costs only the drafter's own seconds; so drafting could look cheap to
every sequence while it slows all of them. This measures that directly: the gateway stack of
``gateway_load.py`` (``splitspec cloud serve``, the WAN emulator at ``--rtt-ms``, ``splitspec
serve --speculate auto``, demo models in float32) with the draft model (``draft``) and without it
(``no-draft``), in turn, each repeat in the other order. Per arm and level: a closed loop of N
``openai`` streams taking requests from one queue for ``--seconds``, after a warm-up: request j sends
prompt j mod ``--pool`` (128 tokens, each behind a number of its own so the prefix cache never skips a prefill; 64
tokens out, greedy). The level's rate counts the tokens whose chunk arrived within those seconds, over them: the
requests still in flight when they end finish after, with fewer streams running, and are not counted. The lone
stream runs every prompt of the pool once, one after another (as ``gateway_load.py``'s does), so that each level's
multiple of one stream compares the same text. Reported: aggregate output tok/s, the server's CPU ms per output
token, and the cores this script's process tree (the load generator and, as its children, the trunk, emulator and
edge server) kept busy over the level; medians over repeats and the median of the paired per-repeat ratios draft /
no-draft. Writes ``draft_under_load.json``, ``.md`` and ``.png``.

    python benchmarks/draft_under_load.py [--repeats 3] [--streams 1 16] [--seconds 25] [--baseline REF]
        [--max-tokens 64]

``--baseline REF``: a third arm, commit REF's code with the draft model (a git worktree, same venv), to
compare a change of the drafting's policy with what it replaces; with it, every other arm runs this working tree's
code from a worktree too (a commit of the tree as it is, ``engine_commit`` in the results), so that both sides load
their code alike. ``--workers N``: another arm, the draft
model's stack with ``splitspec serve --workers N`` (N interpreters, each batching its own streams).
``--arms no-draft head``: the shipped EAGLE head without the draft model (``head``) against neither.
``--serve-flags "ARGS"`` / ``--trunk-flags "ARGS"``: an arm each, the draft model's stack with those flags after
``splitspec serve``'s / ``cloud serve``'s own (a flag given again wins: ``--trunk-flags "--compute-on threads"``),
reported over the ``draft`` arm paired per repeat: a setting tried side by side with no code of its own.

Beside each arm's tok/s: its multiple of its own one-stream rate on the prompts the level sent (issue #24's targets
are 10x at 16 streams and 16x at 32), and the stack's CPU per output token (the CPU seconds of this script's process
tree, i.e. the edge, the trunk, the emulator and the load generator together, over every token of the level), which
bounds what the machine's cores can deliver. Other processes on the machine are not counted.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import openai

sys.path.insert(0, str(Path(__file__).parent))
from gateway_load import checkouts, prompts, start_stack, stream_one, tree_cpu_seconds
from gateway_measures import arrived

from splitspec.demo import _stop
from splitspec.run_info import git_commit, run_environment

ARMS = ("draft", "no-draft", "head")  # head: the shipped EAGLE head, no draft model
FLAG_ARMS = ("serve-flags", "trunk-flags")  # the draft arm's stack with more flags for splitspec serve / cloud serve


def flags_key(arm: str) -> str:
    """A flags arm's attribute of the parsed arguments and its key in the results (``serve-flags``: ``serve_flags``)."""
    return arm.replace("-", "_")


PROMPT_POOL = 16  # distinct prompts every level draws from (--pool); the lone stream runs each once
MAX_TOKENS = 64  # tokens out per request (--max-tokens)


def prompt_pool(texts: list[str], size: int) -> list[str]:
    """``size`` of ``texts`` 97 apart (mod their count): prompts 0, 1, 2, ... would be consecutive windows of one
    document, and how many tokens a speculative step delivers depends on the text."""
    return [texts[(i * 97) % len(texts)] for i in range(size)]


async def closed_loop(
    url: str, pool: list[str], streams: int, until: float, max_tokens: int = MAX_TOKENS
) -> list[dict[str, Any]]:
    """``streams`` streams taking requests from one queue until ``until`` (``time.perf_counter``) -> every request's
    result (``stream_one``'s: start, chunks' arrival times, tokens, end), with its prompt (``prompt``).

    Request j (in the order they start) sends prompt j mod the pool, whatever the level, so every level sends the
    pool's prompts in turn and the lone stream, which runs them all (:func:`lone_pass`), ran the same text."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    queued = itertools.count()  # one event loop: next() is never interleaved
    out: list[dict[str, Any]] = []

    async def stream() -> None:
        while time.perf_counter() < until:
            prompt = next(queued) % len(pool)
            out.append({**await stream_one(client, pool[prompt], max_tokens), "prompt": prompt})

    await asyncio.gather(*(stream() for _ in range(streams)))
    await client.close()
    return out


async def lone_pass(url: str, pool: list[str], max_tokens: int = MAX_TOKENS) -> list[dict[str, Any]]:
    """The lone stream: every prompt of the pool once, one after another -> each request's result with its prompt."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    out = [{**await stream_one(client, text, max_tokens), "prompt": prompt} for prompt, text in enumerate(pool)]
    await client.close()
    return out


def level_figures(requests: list[dict[str, Any]], t0: float, until: float) -> dict[str, Any]:
    """A level's rate from its requests: the tokens that arrived in [t0, until] over until - t0 (those of requests
    still in flight at ``until`` arrive during the ramp-down, as fewer streams run, and are left out), and how much
    of each prompt the rate counted (``prompt_weights``: [prompt, counted tokens / its tokens], summed per prompt),
    the weights of the lone stream's rate on the same text."""
    weights: dict[int, float] = {}
    for r in requests:
        if r["tokens"]:
            weights[r["prompt"]] = weights.get(r["prompt"], 0.0) + arrived(r, until) / r["tokens"]
    window = sum(arrived(r, until) for r in requests)
    return {
        "window_tokens": window,
        "window_s": until - t0,
        "tok_s": window / (until - t0),
        "prompt_weights": [[p, w] for p, w in sorted(weights.items()) if w > 0],
    }


def lone_rate_on(lone: list[dict[str, Any]], weights: list[list[float]]) -> float:
    """The lone stream's tok/s on a level's prompts, each weighted as the level counted it (``prompt_weights``):
    their weighted tokens over their weighted seconds."""
    weight = {int(p): w for p, w in weights}
    mine = [(weight[r["prompt"]], r) for r in lone if r["prompt"] in weight]
    seconds = sum(w * (r["end"] - r["start"]) for w, r in mine)
    return sum(w * r["tokens"] for w, r in mine) / seconds if seconds > 0 else float("nan")


def measure_level(
    url: str, pool: list[str], streams: int, seconds: float, serve: int, max_tokens: int = MAX_TOKENS
) -> dict[str, Any]:
    """One level: ``streams`` streams for ``seconds`` (one stream: the pool once), its rate, and the CPU that the
    edge server ``serve`` and this script's whole process tree (the stack and the load generator) used over the
    level, ramp-down included, per token the level produced."""
    cpu0, stack0 = tree_cpu_seconds(serve), tree_cpu_seconds(os.getpid())
    t0 = time.perf_counter()
    if streams == 1:
        requests = asyncio.run(lone_pass(url, pool, max_tokens))
        until = time.perf_counter()
    else:
        until = t0 + seconds
        requests = asyncio.run(closed_loop(url, pool, streams, until, max_tokens))
    wall = time.perf_counter() - t0
    cpu1, stack1 = tree_cpu_seconds(serve), tree_cpu_seconds(os.getpid())
    tokens = int(sum(r["tokens"] for r in requests))
    row: dict[str, Any] = {
        "streams": streams,
        "tokens": tokens,
        "wall_s": wall,
        **level_figures(requests, t0, until),
        "serve_cpu_ms_per_token": 1e3 * (cpu1 - cpu0) / max(1, tokens),
        "stack_busy_cores": (stack1 - stack0) / wall,
        "stack_cpu_ms_per_token": 1e3 * (stack1 - stack0) / max(1, tokens),
    }
    if streams == 1:  # the lone stream's requests one by one, for lone_rate_on
        row["requests"] = [{k: r[k] for k in ("prompt", "tokens", "start", "end")} for r in requests]
    return row


def measure_arm(
    arm: str, args: argparse.Namespace, pool: list[str], baseline: Path | None, engine: Path | None = None
) -> list[dict[str, Any]]:
    """One arm's stack, warmed, then each load level; ``baseline`` / ``engine``: the ``src`` the baseline's arm /
    every other arm runs (None: this checkout as installed)."""
    src = baseline if arm == "baseline" else engine
    workers = args.workers if arm.startswith("workers") else 1
    draft_model = (
        arm in ("draft", *FLAG_ARMS) or arm.startswith("workers") or (arm == "baseline" and args.baseline_draft == "on")
    )
    procs, urls, pids = start_stack(
        args.rtt_ms,
        None,
        workers,
        draft_model=draft_model,
        engine_src=src,
        draft_head=arm == "head",
        serve_flags=shlex.split(args.serve_flags) if arm == "serve-flags" else (),
        trunk_flags=shlex.split(args.trunk_flags) if arm == "trunk-flags" else (),
    )
    try:
        url, serve = urls["engine"], pids["engine"]["serve"]
        asyncio.run(closed_loop(url, pool, 8, time.perf_counter() + args.warm_s, args.max_tokens))
        out = []
        for streams in args.streams:
            row = {"arm": arm, **measure_level(url, pool, streams, args.seconds, serve, args.max_tokens)}
            print(f"{arm:9s} {streams:3d} streams: {row['tok_s']:6.1f} tok/s, serve {row['serve_cpu_ms_per_token']:.2f}"
                  f" CPU ms/token, stack {row['stack_busy_cores']:.2f} cores busy", flush=True)  # fmt: skip
            out.append(row)
        return out
    finally:
        _stop(procs)


def summarise(
    rows: list[dict[str, Any]], streams: list[int], repeats: int, arms: list[str], beside: str = "draft"
) -> dict[str, Any]:
    """Per level: each arm's medians (with its multiple of its own one-stream tok/s on the level's prompts, median
    of per-repeat multiples, when 1 is a level), and the paired per-repeat ratios of draft over no-draft and of
    ``beside`` (the arm the baseline's is compared with: draft, or no-draft) over the baseline."""
    summary: dict[str, Any] = {}
    for n in streams:
        cell: dict[str, Any] = {}
        for arm in arms:
            mine = [r for r in rows if r["arm"] == arm and r["streams"] == n]
            for key in ("tok_s", "serve_cpu_ms_per_token", "stack_busy_cores", "stack_cpu_ms_per_token"):
                cell[f"{arm}:{key}"] = statistics.median(r[key] for r in mine)
            # each repeat's level over the same repeat's lone stream on the prompts the level sent
            lone = {r["repeat"]: r["requests"] for r in rows if r["arm"] == arm and r["streams"] == 1}
            if lone:
                cell[f"{arm}:x_one_stream"] = statistics.median(
                    r["tok_s"] / lone_rate_on(lone[r["repeat"]], r["prompt_weights"]) for r in mine
                )

        def tok_s(arm: str, k: int, n: int = n) -> float:
            return float(next(r for r in rows if r["arm"] == arm and r["streams"] == n and r["repeat"] == k)["tok_s"])

        # (numerator, denominator, key): draft over the others; the workers' arm over one process's draft
        pairings = [("draft", "no-draft", "ratio"), ("head", "no-draft", "ratio_head")]
        pairings += [(beside, "baseline", "ratio_baseline")]
        pairings += [(arm, "draft", "ratio_workers") for arm in arms if arm.startswith("workers")]
        pairings += [(arm, "draft", f"ratio_{arm}") for arm in arms if arm in FLAG_ARMS]
        for top, bottom, key in pairings:
            if top in arms and bottom in arms:
                pairs = [tok_s(top, k) / tok_s(bottom, k) for k in range(repeats)]
                cell[f"{key}_per_repeat"] = pairs
                cell[key] = statistics.median(pairs)
        summary[str(n)] = cell
    return summary


def against_no_draft(results: dict[str, Any], arm: str, key: str) -> list[str]:
    """The table of ``arm`` against ``no-draft`` per level (``key``: their paired ratio in the summary)."""
    lines = [
        f"| streams | {arm} tok/s | no-draft tok/s | {arm} / no-draft | per repeat | serve CPU ms/token {arm}, "
        f"no-draft | stack busy cores {arm}, no-draft |",
        "|---:|---:|---:|---:|---|---|---|",
    ]
    for n, c in results["summary"].items():
        per = ", ".join(f"{x:.2f}" for x in c[f"{key}_per_repeat"])
        lines.append(
            f"| {n} | {c[f'{arm}:tok_s']:.1f} | {c['no-draft:tok_s']:.1f} | {c[key]:.2f} | {per} "
            f"| {c[f'{arm}:serve_cpu_ms_per_token']:.2f}, {c['no-draft:serve_cpu_ms_per_token']:.2f} "
            f"| {c[f'{arm}:stack_busy_cores']:.2f}, {c['no-draft:stack_busy_cores']:.2f} |"
        )
    return lines


def markdown(results: dict[str, Any]) -> str:
    env = results["environment"]
    lines = [
        "# `auto` with and without the draft model under load (gateway, demo models, float32)",
        "",
        f"Commit `{env['commit']}`; {results['repeats']} repeats (arms alternate order), {results['seconds']:g} s of "
        f"closed-loop load per level after an {results['warm_s']:g} s warm-up, {results['rtt_ms']:g} ms RTT; "
        f"128-token prompts (a pool of {results.get('pool', PROMPT_POOL)}, request j on prompt j mod the pool, each "
        f"unique: no prefix-cache hits), {results.get('max_tokens', MAX_TOKENS)} tokens out, greedy. tok/s counts the "
        "tokens that arrived within the level's seconds, over them (the requests in flight at the end finish with "
        "fewer streams running: not counted); the lone stream runs the pool once. Medians; the ratio is the median of "
        "paired per-repeat ratios.",
        f"Reproduce: `{results['command']}`.",
    ]
    if "draft" in results["arms"] and "no-draft" in results["arms"]:
        lines += ["", *against_no_draft(results, "draft", "ratio")]
    if "head" in results["arms"] and "no-draft" in results["arms"]:
        lines += ["", "With the shipped EAGLE head and no draft model (`head`), against neither (`no-draft`):", ""]
        lines += against_no_draft(results, "head", "ratio_head")
    if results.get("baseline"):
        beside = results.get("beside", "draft")  # results saved before --baseline-draft: with the draft model
        lines += [
            "",
            f"Beside the baseline: commit `{results['baseline']}`'s code with"
            + (" the draft model (its own stack)." if beside == "draft" else "out the draft model (its own stack).")
            + (
                f" Both from git worktrees: the other arms ran `{results['engine_commit']}` (this working tree)."
                if results.get("engine_commit")
                else ""
            ),
            "",
            f"| streams | {beside} tok/s | baseline tok/s | {beside} / baseline | per repeat "
            "| serve CPU ms/token baseline |",
            "|---:|---:|---:|---:|---|---|",
        ]
        for n, c in results["summary"].items():
            per = ", ".join(f"{x:.2f}" for x in c["ratio_baseline_per_repeat"])
            lines.append(
                f"| {n} | {c[f'{beside}:tok_s']:.1f} | {c['baseline:tok_s']:.1f} | {c['ratio_baseline']:.2f} | {per} "
                f"| {c['baseline:serve_cpu_ms_per_token']:.2f} |"
            )
    lines += [
        "",
        "Each arm against its own one stream on the prompts the level sent (each weighted by how much of it the level "
        "counted; paired by repeat, median), and the stack's CPU: the CPU seconds of the benchmark's process tree "
        "(edge server, trunk, emulator and load generator; not the rest of the machine) over the level, as busy "
        "cores and per output token (every token of the level, ramp-down included).",
        "",
        "| streams | arm | tok/s | x its one stream | serve CPU ms/token | stack busy cores | stack CPU ms/token |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for n, c in results["summary"].items():
        for arm in results["arms"]:
            multiple = c.get(f"{arm}:x_one_stream")
            lines.append(
                f"| {n} | {arm} | {c[f'{arm}:tok_s']:.1f} | {'' if multiple is None else f'{multiple:.2f}'} "
                f"| {c[f'{arm}:serve_cpu_ms_per_token']:.2f} | {c[f'{arm}:stack_busy_cores']:.2f} "
                f"| {c[f'{arm}:stack_cpu_ms_per_token']:.2f} |"
            )
    if any("ratio_workers" in c for c in results["summary"].values()):
        per = "; ".join(
            f"{n} streams {c['ratio_workers']:.2f} ({', '.join(f'{x:.2f}' for x in c['ratio_workers_per_repeat'])})"
            for n, c in results["summary"].items()
        )
        lines += ["", f"`--workers` over one process (paired per repeat): {per}."]
    for arm in FLAG_ARMS:
        key = f"ratio_{arm}"
        if any(key in c for c in results["summary"].values()):
            per = "; ".join(
                f"{n} streams {c[key]:.2f} ({', '.join(f'{x:.2f}' for x in c[f'{key}_per_repeat'])})"
                for n, c in results["summary"].items()
            )
            flags = results.get(flags_key(arm), "")
            lines += ["", f"`{arm}` (`{flags}`) over `draft` (paired per repeat): {per}."]
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any], path: Path) -> None:
    levels = list(results["summary"])
    fig, ax = plt.subplots(figsize=(6, 3.5))
    arms = results["arms"]
    width = 0.8 / len(arms)
    for i, arm in enumerate(arms):
        values = [results["summary"][n][f"{arm}:tok_s"] for n in levels]
        ax.bar([x + (i - (len(arms) - 1) / 2) * width for x in range(len(levels))], values, width, label=arm)
    ax.set_xticks(range(len(levels)), [f"{n} streams" for n in levels])
    ax.set_ylabel("aggregate output tok/s (median)")
    ax.set_title("gateway, `auto` with and without the draft model")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--seconds", type=float, default=25.0, help="closed-loop load per level, seconds")
    parser.add_argument("--warm-s", type=float, default=8.0, help="warm-up load (8 streams) per server, seconds")
    parser.add_argument("--rtt-ms", type=float, default=80.0)
    parser.add_argument("--pool", type=int, default=PROMPT_POOL, help="distinct prompts (lone stream: each once)")
    parser.add_argument(
        "--max-tokens", type=int, default=MAX_TOKENS, help=f"tokens out per request (default {MAX_TOKENS})"
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "draft_under_load")
    parser.add_argument("--baseline", help="a commit whose code runs a third arm (with the draft model), in turn")
    parser.add_argument("--workers", type=int, help="N >= 2: an arm with the draft model and `serve --workers N`")
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS[:2]), help="this checkout's arms to run")
    parser.add_argument(
        "--serve-flags", help='an arm: the draft arm\'s stack with these `splitspec serve` flags too ("--threads 2")'
    )
    parser.add_argument(
        "--trunk-flags", help='an arm: the draft arm\'s stack with these `cloud serve` flags too ("--batch-gather 0")'
    )
    parser.add_argument(
        "--baseline-draft",
        choices=("on", "off"),
        default="on",
        help="the baseline's arm with the draft model (on: beside the draft arm) or without it (off: beside no-draft)",
    )
    args = parser.parse_args()
    if args.repeats < 1 or args.seconds <= 0 or args.pool < 1 or not args.streams or min(args.streams) < 1:
        parser.error("--repeats, --seconds, --pool and every --streams level must be positive")
    if args.max_tokens < 1:
        parser.error(f"--max-tokens must be positive, got {args.max_tokens}")
    if args.workers is not None and args.workers < 2:
        parser.error("--workers adds an arm of N >= 2 serve processes")
    given = {arm: getattr(args, flags_key(arm)) for arm in FLAG_ARMS}  # arm -> its flags (None: no such arm)
    flag_arms = [arm for arm, flags in given.items() if flags is not None]
    for arm in flag_arms:
        if not shlex.split(given[arm]):
            parser.error(f"--{arm} names no flag")
    if flag_arms and "draft" not in args.arms:
        parser.error("--serve-flags and --trunk-flags are compared with the draft arm: add it to --arms")
    pool = prompt_pool(prompts(200, 128), args.pool)
    rows: list[dict[str, Any]] = []
    beside = "draft" if args.baseline_draft == "on" else "no-draft"
    if args.baseline and beside not in args.arms:
        parser.error(f"--baseline-draft {args.baseline_draft} compares the baseline with the {beside} arm: add it")
    arms = [
        *args.arms,
        *(["baseline"] if args.baseline else []),
        *([f"workers{args.workers}"] if args.workers else []),
        *flag_arms,
    ]
    with checkouts(args.baseline) as (engine, baseline):
        for repeat in range(args.repeats):
            shift = repeat % len(arms)  # each repeat starts with another arm
            for arm in arms[shift:] + arms[:shift]:
                rows += [{**r, "repeat": repeat} for r in measure_arm(arm, args, pool, baseline, engine)]
        engine_commit = git_commit(engine) if engine is not None else None
    results: dict[str, Any] = {
        "environment": run_environment(),
        "engine_commit": engine_commit,  # with --baseline, the working tree as the other arms ran it
        "command": "python benchmarks/draft_under_load.py " + shlex.join(sys.argv[1:]),
        "arms": arms,
        "baseline": args.baseline,
        "beside": beside,
        "serve_flags": args.serve_flags,
        "trunk_flags": args.trunk_flags,
        "repeats": args.repeats,
        "seconds": args.seconds,
        "warm_s": args.warm_s,
        "rtt_ms": args.rtt_ms,
        "pool": args.pool,
        "max_tokens": args.max_tokens,
        "rows": rows,
        "summary": summarise(rows, args.streams, args.repeats, arms, beside),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "draft_under_load.json").write_text(json.dumps(results, indent=1))
    (args.out / "draft_under_load.md").write_text(markdown(results))
    plot(results, args.out / "draft_under_load.png")
    print(markdown(results))


if __name__ == "__main__":
    main()
