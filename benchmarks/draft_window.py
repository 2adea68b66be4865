"""How well, and how fast, the demo draft model drafts after a long context: read whole, or through its window.

The demo draft model was trained on 256-token windows. Past its position limit a ``DraftModel`` reads the context's
latest tokens at positions from 0 (its window, :func:`splitspec.prefix.window_start`: between half a window and a
window of tokens); the shipped draft model declares its 256 trained positions, so after 248 tokens (8 positions
are kept for its tree) it drafts through that window. Before, it declared 1,024 positions and read every token
up to them (drafting nothing past them); benchmarks extended it to read whole contexts of 2,000 tokens.

* **Agreement**: teacher-forced, the share of positions at which the draft model's most likely next token is the
  base model's (what a one-token greedy draft would have accepted), on held-out code and prose, by band of
  position: the base model and the whole-context draft model read the text whole (copies of their configs extended
  to 4,096 positions, as ``benchmarks/auto_floor.py`` does), the windowed one reads each position's window.
* **Cost**: ms per greedy proposal (budget ``--budget``, the edge's prepacked LM head, one torch thread) along the
  same code after ``--tokens`` tokens, 3 tokens accepted per step; whole context and window interleaved, each
  repeat's mean over ``--steps`` proposals, the median over ``--repeats``.

    python benchmarks/draft_window.py [--tokens 2000] [--docs 4] [--repeats 3] [--steps 30] [--out DIR]

Writes ``draft_window.json``, ``draft_window.md`` and ``draft_window.png``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from auto_floor import extended_copy  # the sibling benchmark (this directory is on sys.path when run)
from torch import nn

BANDS = ((1, 248), (248, 1024), (1024, None))  # positions scored; None: to the text's end
ARMS = ("whole", "window")
ACCEPTED = 3  # tokens accepted per step in the cost measurement


def band_name(band: tuple[int, int | None], tokens: int) -> str:
    return f"{band[0]}-{band[1] if band[1] is not None else tokens}"


@torch.inference_mode()
def whole_argmax(model: Any, ids: Sequence[int]) -> torch.Tensor:
    """(T,) the model's most likely next token after each prefix of ``ids``, reading it whole."""
    out: torch.Tensor = model(torch.tensor([list(ids)])).logits[0].argmax(-1)
    return out


@torch.inference_mode()
def window_argmax(model: Any, ids: Sequence[int], window: int) -> torch.Tensor:
    """(T,) the most likely next token after each prefix of ``ids`` read through the draft model's window: every
    prefix whose window starts at S is scored by one forward over ids[S:], at positions from 0."""
    from splitspec.prefix import window_start

    out = torch.empty(len(ids), dtype=torch.long)
    starts: dict[int, list[int]] = {}
    for t in range(len(ids)):
        starts.setdefault(window_start(t + 1, window), []).append(t)
    for start, ts in starts.items():
        logits = model(torch.tensor([list(ids[start : ts[-1] + 1])])).logits[0]  # (n, V)
        out[ts] = logits[[t - start for t in ts]].argmax(-1)
    return out


def agreement(results: dict[str, Any], tokens: int) -> dict[str, dict[str, float]]:
    """Per domain and band, per arm: agreeing positions / positions, over the documents."""
    table: dict[str, dict[str, float]] = {}
    for domain in ("code", "prose"):
        for band in BANDS:
            name = band_name(band, tokens)
            docs = [d for d in results["documents"] if d["domain"] == domain]
            total = sum(d["bands"][name]["positions"] for d in docs)
            for arm in ARMS:
                agreed = sum(d["bands"][name][arm] for d in docs)
                table.setdefault(f"{domain} {name}", {})[arm] = agreed / total if total else float("nan")
    return table


def proposal_ms(drafter_factory: Any, ids: Sequence[int], tokens: int, steps: int, budget: int) -> float:
    """Mean ms per greedy proposal of a fresh drafter prepared for ids[:tokens], ``steps`` steps of ACCEPTED."""
    drafter = drafter_factory()
    drafter.prepare(ids[:tokens])
    drafter.propose(ids[: tokens + 1], budget)  # its first proposal after the prompt: not timed
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        drafter.propose(ids[: tokens + 1 + ACCEPTED * step], budget)
    return (time.perf_counter() - t0) / steps * 1e3


def markdown(results: dict[str, Any]) -> str:
    tokens = results["tokens"]
    lines = [
        f"# The draft model after a long context: whole, or through its window (commit {results['commit']})",
        "",
        f"`{results['command']}`",
        "",
        f"Demo draft model against the demo base model, float32. Window: {results['window']} tokens (its 256 "
        "positions less 8 for its tree), moving by half its size. Documents (first "
        f"{tokens} tokens each): " + ", ".join(f"{d['name']} ({d['domain']})" for d in results["documents"]) + ".",
        "",
        "Teacher-forced agreement of the draft model's most likely next token with the base model's:",
        "",
        "| domain, positions | whole context | window | window / whole |",
        "|---|---:|---:|---:|",
    ]
    for name, row in results["agreement"].items():
        lines.append(f"| {name} | {row['whole']:.3f} | {row['window']:.3f} | {row['window'] / row['whole']:.2f} |")
    cost = results["cost"]
    per = {arm: ", ".join(f"{ms:.2f}" for ms in cost["raw"][arm]) for arm in ARMS}
    lines += [
        "",
        f"Greedy proposals at budget {results['budget']} along {results['cost_document']} from {results['context']} "
        f"tokens of context on, {ACCEPTED} tokens accepted a step, {results['steps']} steps (prepacked LM head, one "
        "torch thread); median "
        f"over {results['repeats']} interleaved repeats of the mean ms per proposal:",
        "",
        "| reading | ms per proposal | repeats |",
        "|---|---:|---|",
        f"| whole context | {cost['whole']:.2f} | {per['whole']} |",
        f"| window | {cost['window']:.2f} | {per['window']} |",
        f"| window / whole | {cost['window'] / cost['whole']:.2f} | |",
        "",
        "Before this change the shipped draft model declared 1,024 positions: it read contexts whole up to them and "
        "drafted nothing past them.",
    ]
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["agreement"])
    xs = range(len(names))
    fig, ax = plt.subplots(figsize=(8, 3.8))
    for i, arm in enumerate(ARMS):
        ax.bar([x + (i - 0.5) * 0.4 for x in xs], [results["agreement"][n][arm] for n in names], 0.4, label=arm)
    ax.set_xticks(list(xs), names, rotation=20, ha="right")
    ax.set_ylabel("agreement with the base model")
    ax.set_title(f"Draft model after long contexts (commit {results['commit'][:8]})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2000, help="tokens of each document read")
    parser.add_argument("--docs", type=int, default=4, help="the longest held-out documents per domain")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30, help="proposals per arm and repeat")
    parser.add_argument("--budget", type=int, default=8, help="draft tokens per proposal")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/draft_window"))
    args = parser.parse_args()
    if min(args.repeats, args.steps, args.budget, args.docs) < 1 or args.tokens <= BANDS[-1][0]:
        parser.error(f"--repeats, --steps, --budget and --docs must be >= 1, --tokens > {BANDS[-1][0]}")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from splitspec.decoding.drafters import DraftModel
    from splitspec.decoding.sampling import SamplingParams
    from splitspec.demo import ASSETS, embedded_model
    from splitspec.models.checkpoint import Checkpoint
    from splitspec.models.loading import load_full
    from splitspec.models.prepack import PackedLinear
    from splitspec.run_info import run_environment

    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="draft_window_"))
    base_dir, whole_dir = (
        extended_copy(embedded_model("base"), work / "base"),
        extended_copy(embedded_model("draft"), work / "draft"),
    )
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    whole = AutoModelForCausalLM.from_pretrained(whole_dir, dtype=torch.float32).eval()
    shipped = AutoModelForCausalLM.from_pretrained(embedded_model("draft"), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(embedded_model("base"), local_files_only=True)
    drafter_window = DraftModel(load_full(Checkpoint(embedded_model("draft")), torch.float32), SamplingParams()).window
    if drafter_window is None:
        parser.error("the shipped draft model has no window: does its config still declare 256 positions?")
    documents: list[dict[str, Any]] = []
    texts: dict[str, list[int]] = {}
    for domain in ("code", "prose"):
        paths = sorted((ASSETS / "corpus" / "heldout" / domain).glob("*.txt"), key=lambda p: -p.stat().st_size)
        for path in paths[: args.docs]:
            ids = tokenizer(path.read_text(), add_special_tokens=False).input_ids[: args.tokens]
            if len(ids) < args.tokens:
                continue
            texts[path.stem] = ids
            target = whole_argmax(base, ids)
            guesses = {"whole": whole_argmax(whole, ids), "window": window_argmax(shipped, ids, drafter_window)}
            bands = {}
            for band in BANDS:
                lo, hi = band[0], band[1] if band[1] is not None else len(ids)
                bands[band_name(band, args.tokens)] = {
                    "positions": hi - lo,
                    **{arm: int((guesses[arm][lo:hi] == target[lo:hi]).sum()) for arm in ARMS},
                }
            documents.append({"name": path.stem, "domain": domain, "bands": bands})
            print(f"{domain} {path.stem}: {bands}", flush=True)
    if not documents:
        parser.error(f"no held-out document has {args.tokens} tokens")
    cost_document = next(d["name"] for d in documents if d["domain"] == "code")
    ids = texts[cost_document]
    tokens = args.tokens - 1 - ACCEPTED * args.steps
    if tokens < BANDS[-1][0]:
        parser.error(f"--steps {args.steps} leaves {tokens} tokens of context: raise --tokens or lower --steps")
    models = {"whole": load_full(Checkpoint(whole_dir), torch.float32)}
    models["window"] = load_full(Checkpoint(embedded_model("draft")), torch.float32)
    for model in models.values():
        if isinstance(model.lm_head, nn.Linear):
            model.lm_head = PackedLinear(model.lm_head)  # as the edge packs it (EdgeRuntime._prepack_draft_model)
    raw: dict[str, list[float]] = {arm: [] for arm in ARMS}
    for repeat in range(args.repeats):
        for arm in ARMS if repeat % 2 == 0 else tuple(reversed(ARMS)):
            factory = lambda arm=arm: DraftModel(models[arm], SamplingParams())  # noqa: E731
            raw[arm].append(proposal_ms(factory, ids, tokens, args.steps, args.budget))
            print(f"repeat {repeat} {arm}: {raw[arm][-1]:.2f} ms per proposal", flush=True)
    command = "python benchmarks/draft_window.py"
    for flag, value, default in (
        ("--tokens", args.tokens, 2000),
        ("--docs", args.docs, 4),
        ("--repeats", args.repeats, 3),
        ("--steps", args.steps, 30),
        ("--budget", args.budget, 8),
    ):
        command += f" {flag} {value}" if value != default else ""
    results: dict[str, Any] = {**run_environment(), "command": command, "tokens": args.tokens}
    results |= {"window": drafter_window, "documents": documents, "repeats": args.repeats, "steps": args.steps}
    results |= {"budget": args.budget, "cost_document": cost_document, "context": tokens}
    results["agreement"] = agreement(results, args.tokens)
    results["cost"] = {"raw": raw, **{arm: statistics.median(v) for arm, v in raw.items()}}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "draft_window.json").write_text(json.dumps(results, indent=2))
    (args.out / "draft_window.md").write_text(markdown(results))
    plot(results, args.out / "draft_window.png")
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
