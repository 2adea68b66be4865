"""Structured outputs through ``splitspec serve`` and the WAN emulator: cost of a JSON schema.

Processes on loopback, as ``serve_bench.py`` has them: a trunk server, the WAN emulator (80 ms
RTT) and ``splitspec serve`` on the demo models (draft model, ``--speculate auto``).

1. **tok/s and tokens per round trip** with and without a JSON schema (``response_format``) on the
   same prompts, greedy: decode tok/s of each streamed completion (tokens after the first / time
   after the first), completion tokens after the first (the prefill's) per decode round trip (``/metrics``). Repeats
   interleave the two modes. Under a grammar drafts are cut at the first token it forbids before
   they are sent, and every verified row is masked (speculation goes on under the grammar).
2. **The grammar's per-token cost on the edge:** ``GrammarProcessor.process`` + ``accept`` over the
   tokens of the constrained completions, on the demo tokenizer (8,192 ids), ms per token.

Prompt-logprob (``echo``) throughput: ``benchmarks/echo_logprobs_bench.py``.

    python benchmarks/structured_bench.py [--repeats 3] [--max-tokens 40] [--out benchmarks/results/structured]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import torch
from transformers import AutoTokenizer

from splitspec.decoding.grammar import GrammarCompiler
from splitspec.demo import _spawn, _stop, _wait_for_port, embedded_model, free_port
from splitspec.run_info import run_environment

PROMPTS = ["KING HENRY.\nNow, lords, what news", "def main():\n    ", "HAMLET.\nTo be, or not"]
SCHEMA = {
    "type": "object",
    "properties": {
        "speaker": {"type": "string", "maxLength": 24},
        "line": {"type": "string", "maxLength": 80},
        "act": {"type": "integer", "minimum": 1, "maximum": 5},
    },
    "required": ["speaker", "line", "act"],
    "additionalProperties": False,
}


def metric(text: str, name: str) -> float:
    return sum(float(line.split(" ")[1]) for line in text.splitlines() if line.startswith(name + " "))


async def timed_completion(http: httpx.AsyncClient, base: str, body: dict[str, Any]) -> dict[str, Any]:
    """One streamed ``/v1/completions`` request: its text, completion tokens, decode tok/s (tokens after the first /
    time after the first) and completion tokens after the first per decode round trip (from ``/metrics``)."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    m0 = (await http.get(f"{base}/metrics")).text
    t0 = time.perf_counter()
    t_first, text, usage = None, [], None
    async with http.stream("POST", f"{base}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for choice in chunk["choices"]:
                if choice["text"] and t_first is None:
                    t_first = time.perf_counter()
                text.append(choice["text"])
    t_end = time.perf_counter()
    m1 = (await http.get(f"{base}/metrics")).text
    trips = metric(m1, 'splitspec_serve_round_trips_total{kind="decode"}') - metric(
        m0, 'splitspec_serve_round_trips_total{kind="decode"}'
    )
    n = usage["completion_tokens"] if usage else 0
    first = t_first or t_end
    return {"text": "".join(text), "tokens": n, "total_s": t_end - t0,
            "decode_tok_s": (n - 1) / (t_end - first) if n > 1 and t_end > first else None,
            # the first token comes from the prefill, whose round trips count under their own label
            "tokens_per_trip": (n - 1) / trips if trips and n > 0 else None}  # fmt: skip


async def one(http: httpx.AsyncClient, base: str, prompt: str, schema: bool, max_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "demo", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    if schema:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "line", "schema": SCHEMA}}
    return {"schema": schema, "prompt": prompt, **await timed_completion(http, base, body)}


def start_link_stack(rtt_ms: float) -> tuple[list[Any], str]:
    """A trunk server of the demo base model, the WAN emulator at ``rtt_ms`` and ``splitspec serve`` with the demo
    draft model (``--speculate auto``), each a process on loopback: the processes and serve's base URL."""
    base_model, draft = embedded_model("base"), embedded_model("draft")
    trunk_port, link_port, port = free_port(), free_port(), free_port()
    procs = [_spawn(["cloud", "serve", "--model", str(base_model), "--port", str(trunk_port), "--threads", "1"])]
    try:
        _wait_for_port(trunk_port, procs[0], 120)
        procs.append(_spawn(["netem", "--listen", f"127.0.0.1:{link_port}", "--upstream",
                             f"127.0.0.1:{trunk_port}", "--rtt-ms", str(rtt_ms)]))  # fmt: skip
        _wait_for_port(link_port, procs[1], 60)
        procs.append(_spawn(["serve", "--model", str(base_model), "--draft-model", str(draft), "--cloud",
                             f"ws://127.0.0.1:{link_port}", "--served-model-name", "demo", "--port", str(port),
                             "--threads", "1", "--allow-stock-edge-weights"]))  # fmt: skip
        _wait_for_port(port, procs[-1], 120)
    except BaseException:
        _stop(procs)
        raise
    return procs, f"http://127.0.0.1:{port}"


async def run(base: str, repeats: int, max_tokens: int) -> list[dict[str, Any]]:
    rows = []
    async with httpx.AsyncClient(timeout=600) as http:
        await one(http, base, PROMPTS[0], False, 4)  # warm up: connections, controller, grammar tokenizer
        await one(http, base, PROMPTS[0], True, 4)
        for rep in range(repeats):
            for prompt in PROMPTS:
                for schema in (False, True) if rep % 2 == 0 else (True, False):
                    row = {**await one(http, base, prompt, schema, max_tokens), "repeat": rep}
                    rows.append(row)
                    rate, trip = row["decode_tok_s"] or 0.0, row["tokens_per_trip"]
                    print(f"  repeat {rep} schema={schema}: {row['tokens']} tokens, {rate:.1f} tok/s, {trip}",
                          file=sys.stderr)  # fmt: skip
    return rows


def grammar_cost(texts: list[str], repeats: int) -> dict[str, Any]:
    """ms per token of process + accept over the constrained completions' tokens (demo tokenizer)."""
    tokenizer = AutoTokenizer.from_pretrained(embedded_model("base"), local_files_only=True)
    compiler = GrammarCompiler(tokenizer, int(tokenizer.vocab_size))
    grammar = compiler.json_schema(SCHEMA)
    eos = {int(tokenizer.eos_token_id)} if tokenizer.eos_token_id is not None else set()
    per_token = []
    for _ in range(repeats):
        for text in texts:
            ids = tokenizer.encode(text, add_special_tokens=False)
            p = compiler.processor(grammar, eos)
            allowed = p.validate_draft(ids)
            logits = torch.zeros(1, compiler.logits_size)
            t0 = time.perf_counter()
            for token in ids[:allowed]:
                p.process(logits, [], [])
                p.accept([token])
            if allowed:
                per_token.append((time.perf_counter() - t0) * 1000 / allowed)
    return {"ms_per_token_median": statistics.median(per_token), "ms_per_token_max": max(per_token),
            "documents": len(per_token)}  # fmt: skip


def markdown(results: dict[str, Any]) -> str:
    s = results["summary"]
    return "\n".join([
        f"# Structured outputs through splitspec serve ({results['rtt_ms']:g} ms RTT, demo models)",
        "",
        f"Commit `{results['commit'][:12]}`, {results['repeats']} interleaved repeats x {len(PROMPTS)} prompts, "
        f"greedy, {results['max_tokens']} tokens at most, medians. Reproduce: `python benchmarks/structured_bench.py`.",
        "",
        "| mode | decode tok/s | tokens per round trip | completion tokens |",
        "|---|---|---|---|",
        *[f"| {m} | {s[m]['decode_tok_s']:.2f} | {s[m]['tokens_per_trip']:.2f} | {s[m]['tokens']:.0f} |"
          for m in ("plain", "json_schema")],
        "",
        f"Grammar cost on the edge (process + accept, demo tokenizer of 8,192 ids): "
        f"{results['grammar']['ms_per_token_median']:.3f} ms per token (median over "
        f"{results['grammar']['documents']} documents; max {results['grammar']['ms_per_token_max']:.3f}).",
        "",
        "Under a grammar, drafts are cut at the first token it forbids (`validate_draft`) before they are",
        "sent, and every verified row is masked: speculation goes on, with output equal to one-token decoding.",
    ])  # fmt: skip


def link_bench_args(doc: str | None, out: str) -> argparse.Namespace:
    """The arguments of a benchmark over :func:`start_link_stack`: repeats, tokens per reply, RTT, results folder."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0] if doc else None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=40)
    parser.add_argument("--rtt-ms", type=float, default=80.0)
    parser.add_argument("--out", type=Path, default=Path(out))
    return parser.parse_args()


def write_report(out: Path, stem: str, results: dict[str, Any], text: str) -> None:
    """``<stem>.json`` and ``<stem>.md`` into ``out``, the markdown also printed."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(results, indent=2))
    (out / f"{stem}.md").write_text(text + "\n")
    print(text)


def main() -> int:
    args = link_bench_args(__doc__, "benchmarks/results/structured")
    procs, base = start_link_stack(args.rtt_ms)
    try:
        rows = asyncio.run(run(base, args.repeats, args.max_tokens))
    finally:
        _stop(procs)
    for row in rows:  # a document finished within max_tokens must parse
        if row["schema"] and row["tokens"] < args.max_tokens:
            json.loads(row["text"])
    summary = {}
    for label, schema in (("plain", False), ("json_schema", True)):
        mine = [r for r in rows if r["schema"] == schema]
        summary[label] = {k: statistics.median(r[k] for r in mine if r[k] is not None)
                          for k in ("decode_tok_s", "tokens_per_trip", "tokens")}  # fmt: skip
    texts = [r["text"] for r in rows if r["schema"]]
    grammar = grammar_cost(texts, args.repeats)
    env = run_environment()
    results = {"commit": env.get("commit", ""), "repeats": args.repeats, "max_tokens": args.max_tokens,
               "rtt_ms": args.rtt_ms, "platform": platform.platform(), "environment": env, "rows": rows,
               "summary": summary, "grammar": grammar}  # fmt: skip
    write_report(args.out, "structured_bench", results, markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
