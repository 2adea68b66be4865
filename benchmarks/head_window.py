"""Benchmark: how many committed pairs the EAGLE head should attend to after a long prompt.

The shipped head (``embedded_model("base-eagle")``) was trained on windows of 128 tokens. After a 2,000-token
prompt of third-party code (``auto_floor.py``'s: ``tqdm/std.py``, which the demo models never saw) and after
64 tokens of held-out prose, the base model (positions extended as ``auto_floor.py`` does, float32) continues
greedily for ``--answer`` tokens. Per window W (the head's cache holds the last W committed pairs, at their own
positions; ``all``: every pair), reported:

* teacher-forced first-depth accuracy: over the answer's positions, how often the head's top token, fed the
  pairs of the window ending at that position, is the base model's greedy next token;
* feed time: one forward of the head over the window's pairs (what a catch-up after the prompt costs), median
  ms, one thread.

    python benchmarks/head_window.py [--windows 128 256 512 1024] [--answer 160] [--out benchmarks/results/head_window]

Writes head_window.json, head_window.md and head_window.png into --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from splitspec.decoding.local import LocalSequence
from splitspec.demo import embedded_model
from splitspec.models.checkpoint import Checkpoint
from splitspec.models.draft_head import DraftHead
from splitspec.models.draft_head_io import load_draft_head
from splitspec.models.kv_cache import KVCache
from splitspec.models.loading import load_full
from splitspec.models.masks import chain
from splitspec.models.stack import FullModel
from splitspec.run_info import run_environment

sys.path.insert(0, str(Path(__file__).resolve().parent))
from auto_floor import build_cases, extended_copy  # the same prompts and extended model


def greedy_text(model: FullModel, head: DraftHead, prompt: list[int], answer: int) -> tuple[list[int], torch.Tensor]:
    """The prompt and its greedy continuation, and every token's feature (as the verifier keeps them)."""
    verifier = LocalSequence(model)
    verifier.keep_features(head.config.feature_layers)
    logits = asyncio.run(verifier.forward(prompt))
    tokens = list(prompt)
    for _ in range(answer):
        tokens.append(int(logits[-1].argmax()))
        logits = asyncio.run(verifier.forward(tokens[-1:]))
    assert verifier.features is not None
    return tokens, verifier.features.rows(0, len(tokens))


def head_out(
    model: FullModel, head: DraftHead, tokens: list[int], feats: torch.Tensor, lo: int, i: int
) -> torch.Tensor:
    """ĥ of pairs lo .. i (pair j: x_{j+1} and f_j, at position j) in a fresh cache: (i + 1 - lo, H)."""
    with torch.inference_mode():
        return head.forward(
            model, torch.tensor(tokens[lo + 1 : i + 2]), feats[lo : i + 1], torch.arange(lo, i + 1, dtype=torch.int32),
            torch.tensor(chain(i + 1 - lo), dtype=torch.int32), KVCache(),
        )  # fmt: skip


def measure(model: FullModel, head: DraftHead, tokens: list[int], feats: torch.Tensor, prompt_len: int,
            windows: list[int]) -> list[dict[str, Any]]:  # fmt: skip
    positions = range(prompt_len - 1, len(tokens) - 2)  # pair i's prediction scores x_{i+2}, an answer token
    rows: list[dict[str, Any]] = []  # window (None: all before it), accuracy
    every = head_out(model, head, tokens, feats, 0, len(tokens) - 2)  # causal: row i is pair i's, all before it
    with torch.inference_mode():
        top = head.logits(model, every).argmax(-1)
    rows.append({"window": None, "accuracy": statistics.fmean(int(top[i]) == tokens[i + 2] for i in positions)})
    for w in windows:
        hits = []
        for i in positions:
            out = head_out(model, head, tokens, feats, max(0, i - w + 1), i)
            with torch.inference_mode():
                hits.append(int(head.logits(model, out[-1:])[0].argmax()) == tokens[i + 2])
        rows.append({"window": w, "accuracy": statistics.fmean(hits)})
    for row in rows:  # a catch-up after the prompt: the window's pairs ending at the prompt's last
        w = prompt_len - 1 if row["window"] is None else min(row["window"], prompt_len - 1)
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            head_out(model, head, tokens, feats, prompt_len - 1 - w, prompt_len - 2)
            times.append(time.perf_counter() - t0)
        row["feed_ms"] = 1e3 * statistics.median(times)
        row["positions"] = len(positions)
    return rows


def markdown(results: dict[str, Any]) -> str:
    lines = [
        "# The EAGLE head's window after a long prompt",
        "",
        f"Commit {results['environment']['commit']}; shipped head, base model float32 (positions extended), "
        f"greedy answers of {results['answer']} tokens, one thread.",
        "",
        "| case | window (pairs) | first-depth accuracy | feed after the prompt (ms) |",
        "|---|---:|---:|---:|",
    ]
    for case, rows in results["cases"].items():
        for r in rows:
            label = "all" if r["window"] is None else str(r["window"])
            lines.append(f"| {case} | {label} | {r['accuracy']:.3f} | {r['feed_ms']:.1f} |")
    lines += ["", f"Reproduce: `{results['command']}`", ""]
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for case, rows in results["cases"].items():
        labels = ["all" if r["window"] is None else str(r["window"]) for r in rows]
        ax.plot(labels, [r["accuracy"] for r in rows], "o-", label=case)
    ax.set_xlabel("pairs the head attends to")
    ax.set_ylabel("first-depth accuracy")
    ax.set_title(f"EAGLE head window (commit {results['environment']['commit'][:7]})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--windows", type=int, nargs="+", default=[128, 256, 512, 1024])
    parser.add_argument("--answer", type=int, default=160, help="greedy tokens after each prompt")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/head_window"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="head_window_"))
    base = extended_copy(embedded_model("base"), work / "base")
    model = load_full(Checkpoint(base), torch.float32)
    head = load_draft_head(embedded_model("base-eagle"), Checkpoint(embedded_model("base")))
    cases, sources = build_cases(base, 2000, (args.answer,))
    command = "python benchmarks/head_window.py " + shlex.join(sys.argv[1:])
    results: dict[str, Any] = {
        "environment": run_environment(),
        "answer": args.answer,
        "sources": sources,
        "command": command,
        "cases": {},
    }
    for case in cases:
        name = case.name.split("/")[0]
        tokens, feats = greedy_text(model, head, list(case.prompt), args.answer)
        results["cases"][name] = measure(model, head, tokens, feats, len(case.prompt), args.windows)
        print(name, results["cases"][name], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "head_window.json").write_text(json.dumps(results, indent=2) + "\n")
    (args.out / "head_window.md").write_text(markdown(results))
    plot(results, args.out / "head_window.png")
    sys.stdout.write(markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
