"""Streaming detokenization: decoding every generated id again per token, against a short window per token.

A stream that prints ``decode(ids)[len(shown):]`` per token decodes the whole answer per token: its
cost grows with the square of the answer's length, and in ``splitspec serve`` it runs on the event
loop every stream shares. :class:`splitspec.detokenize.IncrementalText` decodes a short window of
the last ids instead. This streams the demo tokenizer's ids of held-out code through both and
reports the milliseconds for the whole answer and for its last token, at several answer lengths
(median over ``--repeats``, the two ways interleaved); the texts are checked equal.

    python benchmarks/detokenize.py [--repeats 3] [--out benchmarks/results/detokenize]

Writes ``detokenize.json`` and ``detokenize.md``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from splitspec.bench.scenario import DEFAULT_CORPUS_DIR
from splitspec.demo import embedded_model
from splitspec.detokenize import IncrementalText
from splitspec.run_info import run_environment

LENGTHS = (64, 256, 1000, 2000)  # generated tokens


def whole(decode: Callable[[list[int]], str], ids: list[int]) -> tuple[str, float, float]:
    """The decode-all pattern -> (text, total ms, last token's ms)."""
    shown, generated, last = "", [], 0.0
    t0 = time.perf_counter()
    for token in ids:
        t = time.perf_counter()
        generated.append(token)
        text = decode(generated)
        shown += text[len(shown) :]
        last = time.perf_counter() - t
    return shown, (time.perf_counter() - t0) * 1e3, last * 1e3


def windowed(decode: Callable[[list[int]], str], ids: list[int]) -> tuple[str, float, float]:
    """IncrementalText -> (text, total ms, last token's ms)."""
    text, last = IncrementalText(decode), 0.0
    t0 = time.perf_counter()
    for token in ids:
        t = time.perf_counter()
        text.push(token)
        last = time.perf_counter() - t
    text.finish()
    return text.text, (time.perf_counter() - t0) * 1e3, last * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/detokenize"))
    args = parser.parse_args()
    tok = AutoTokenizer.from_pretrained(embedded_model("base"))
    corpus = "".join(p.read_text() for p in sorted((DEFAULT_CORPUS_DIR / "code").iterdir()))
    all_ids = tok.encode(corpus)

    def decode(ids: list[int]) -> str:
        return str(tok.decode(ids, skip_special_tokens=True))

    rows: list[dict[str, Any]] = []
    for n in LENGTHS:
        ids = all_ids[:n]
        runs: dict[str, list[tuple[float, float]]] = {"whole": [], "window": []}
        equal = True
        for repeat in range(args.repeats):
            for way in ("whole", "window") if repeat % 2 == 0 else ("window", "whole"):
                text, total, last = (whole if way == "whole" else windowed)(decode, ids)
                equal = equal and text == decode(ids)
                runs[way].append((total, last))
        row: dict[str, Any] = {"tokens": n, "equal": equal}
        for way, figures in runs.items():
            row[f"{way}_total_ms"] = statistics.median(t for t, _ in figures)
            row[f"{way}_last_ms"] = statistics.median(x for _, x in figures)
        rows.append(row)
    args.out.mkdir(parents=True, exist_ok=True)
    env = run_environment()
    (args.out / "detokenize.json").write_text(json.dumps({"environment": env, "rows": rows}, indent=1))
    lines = [
        "# Streaming detokenization: every id decoded again per token, against a short window",
        "",
        f"Commit `{env['commit']}`; the demo tokenizer on held-out code; medians of {args.repeats} interleaved "
        "repeats.",
        "",
        f"    python benchmarks/detokenize.py --repeats {args.repeats}",
        "",
        "| answer tokens | decode all: answer ms | its last token ms | window: answer ms | its last token ms "
        "| answer ratio | texts equal |",
        "|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['tokens']} | {r['whole_total_ms']:.1f} | {r['whole_last_ms']:.3f} | {r['window_total_ms']:.1f} "
            f"| {r['window_last_ms']:.3f} | {r['whole_total_ms'] / r['window_total_ms']:.1f}x | {r['equal']} |"
        )
    (args.out / "detokenize.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
