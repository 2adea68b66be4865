"""Benchmark: what vLLM's sampling fields cost a split reply: ``repetition_penalty``, ``bad_words`` and ``min_p``.

Processes on loopback (``structured_bench.start_link_stack``: a trunk server, the WAN emulator at 80 ms RTT,
``splitspec serve`` on the demo models with the draft model and ``--speculate auto``). Modes on the same prompts,
interleaved (the order rotates each repeat):

* greedy: ``plain``; ``repetition_penalty`` 1.05 (what Qwen2.5-Instruct publishes, and ``serve`` now applies by
  default as vLLM does) and 1.3; ``bad_words`` (five common words);
* sampled at temperature 0.8, unseeded (a seeded sample decodes one token per round trip): without and with
  ``min_p`` 0.1.

Reported per mode: decode tok/s and tokens per round trip (medians), and the paired per-prompt-and-repeat ratio
of decode tok/s against ``plain`` (greedy modes) or ``T=0.8`` (``min_p``). A penalty lowers the logits of tokens
already seen, which is what n-gram and prompt-lookup drafts propose, so it costs speculation acceptance; a
logits processor also keeps drafts to one chain. Then the edge's own cost: ``RepetitionPenalty.process`` and
``BadWords.process`` on a 2,000-token context and a 5-row verification block, microseconds per call.

    python benchmarks/sampling_fields_bench.py [--repeats 3] [--max-tokens 40]
        [--out benchmarks/results/sampling_fields]
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from typing import Any

import httpx
import torch
from structured_bench import PROMPTS, link_bench_args, start_link_stack, timed_completion, write_report

from splitspec.decoding.adjusters import BadWords, RepetitionPenalty
from splitspec.demo import _stop
from splitspec.run_info import run_environment

BAD_WORDS = ["the", "and", "self", "of", "to"]
MODES: dict[str, dict[str, Any]] = {
    "plain": {"temperature": 0},
    "repetition 1.05": {"temperature": 0, "repetition_penalty": 1.05},
    "repetition 1.3": {"temperature": 0, "repetition_penalty": 1.3},
    "bad_words": {"temperature": 0, "bad_words": BAD_WORDS},
    "T=0.8": {"temperature": 0.8},
    "T=0.8 min_p 0.1": {"temperature": 0.8, "min_p": 0.1},
}
BASELINE = {"repetition 1.05": "plain", "repetition 1.3": "plain", "bad_words": "plain", "T=0.8 min_p 0.1": "T=0.8"}


async def run(base: str, repeats: int, max_tokens: int) -> list[dict[str, Any]]:
    rows = []
    names = list(MODES)
    async with httpx.AsyncClient(timeout=600) as http:
        for name in names:  # warm up: connections, the controller, each mode's path
            await timed_completion(http, base, {"model": "demo", "prompt": PROMPTS[0], "max_tokens": 4, **MODES[name]})
        for rep in range(repeats):
            order = names[rep % len(names) :] + names[: rep % len(names)]
            for p, prompt in enumerate(PROMPTS):
                for name in order:
                    body = {"model": "demo", "prompt": prompt, "max_tokens": max_tokens, **MODES[name]}
                    row = {"mode": name, "prompt": p, "repeat": rep, **await timed_completion(http, base, body)}
                    rows.append(row)
                    rate, trip = row["decode_tok_s"] or 0.0, row["tokens_per_trip"] or 0.0
                    print(f"  repeat {rep} prompt {p} {name}: {row['tokens']} tokens, {rate:.1f} tok/s, "
                          f"{trip:.2f} tok/trip", file=sys.stderr)  # fmt: skip
    return rows


def summarize(rows: list[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    by = {(r["mode"], r["prompt"], r["repeat"]): r for r in rows}
    out: dict[str, dict[str, float | None]] = {}
    for name in MODES:
        mine = [r for r in rows if r["mode"] == name]
        stats: dict[str, float | None] = {}
        for k in ("decode_tok_s", "tokens_per_trip"):
            values = [r[k] for r in mine if r[k] is not None]  # None: a one-token reply has no decode
            stats[k] = statistics.median(values) if values else None
        base = BASELINE.get(name)
        ratios = [
            r["decode_tok_s"] / by[(base, r["prompt"], r["repeat"])]["decode_tok_s"]
            for r in mine
            if base is not None and r["decode_tok_s"] and by[(base, r["prompt"], r["repeat"])]["decode_tok_s"]
        ]
        stats["ratio"] = statistics.median(ratios) if ratios else None
        stats["ratio_min"] = min(ratios) if ratios else None
        stats["ratio_max"] = max(ratios) if ratios else None
        out[name] = stats
    return out


def edge_cost(repeats: int) -> dict[str, float]:
    """Microseconds per ``process`` call on a (5, 8192) block after a 2,000-token context (median of calls)."""
    generator = torch.Generator().manual_seed(0)
    context = torch.randint(0, 8192, (2000,), generator=generator).tolist()
    draft = torch.randint(0, 8192, (4,), generator=generator).tolist()
    logits = torch.randn(5, 8192, generator=generator)
    pairs = zip(context[3:9:2], context[4:10:2], strict=True)
    words = [[int(t)] for t in context[:3]] + [[int(a), int(b)] for a, b in pairs]  # 3 one-token words, 3 pairs
    out = {}
    for name, make in (("repetition_penalty", lambda: RepetitionPenalty(1.05)), ("bad_words", lambda: BadWords(words))):
        times = []
        for _ in range(repeats):
            processor = make()
            processor.accept(context[:200])
            processor.process(logits.clone(), context[:1980], draft)  # the first call reads the context
            for step in range(20):  # then it grows by a token a step, as a decoding sequence's does
                block = logits.clone()
                t0 = time.perf_counter()
                processor.process(block, context[: 1981 + step], draft)
                times.append((time.perf_counter() - t0) * 1e6)
                processor.accept(context[1981 + step : 1982 + step])
        out[name] = statistics.median(times)
    return out


def markdown(results: dict[str, Any]) -> str:
    s = results["summary"]

    def number(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    def ratio(m: str) -> str:
        r = s[m]
        if r["ratio"] is None:
            return "-"
        return f"{r['ratio']:.2f} ({r['ratio_min']:.2f}-{r['ratio_max']:.2f}) vs {BASELINE[m]}"

    return "\n".join([
        f"# vLLM's sampling fields through splitspec serve ({results['rtt_ms']:g} ms RTT, demo models)",
        "",
        f"Commit `{results['commit'][:12]}`, {results['repeats']} interleaved repeats x {len(PROMPTS)} prompts, "
        f"{results['max_tokens']} tokens at most, medians. Reproduce: `{results['command']}`.",
        "",
        "| mode | decode tok/s | tokens per round trip | decode tok/s ratio, median (range) |",
        "|---|---:|---:|---|",
        *[f"| {m} | {number(s[m]['decode_tok_s'])} | {number(s[m]['tokens_per_trip'])} | {ratio(m)} |" for m in MODES],
        "",
        f"Edge cost per `process` call (a 5-row block of 8,192 logits after a 2,000-token context): repetition "
        f"penalty {results['edge_us']['repetition_penalty']:.0f} us, bad words (3 one-token and 3 two-token words) "
        f"{results['edge_us']['bad_words']:.0f} us.",
    ])  # fmt: skip


def main() -> int:
    args = link_bench_args(__doc__, "benchmarks/results/sampling_fields")
    procs, base = start_link_stack(args.rtt_ms)
    try:
        rows = asyncio.run(run(base, args.repeats, args.max_tokens))
    finally:
        _stop(procs)
    env = run_environment()
    command = (f"python benchmarks/sampling_fields_bench.py --repeats {args.repeats} --max-tokens {args.max_tokens} "
               f"--rtt-ms {args.rtt_ms:g}")  # fmt: skip
    results = {"commit": env.get("commit", ""), "command": command, "repeats": args.repeats,
               "max_tokens": args.max_tokens, "rtt_ms": args.rtt_ms, "environment": env, "rows": rows,
               "summary": summarize(rows), "edge_us": edge_cost(args.repeats)}  # fmt: skip
    write_report(args.out, "sampling_fields", results, markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
