"""What a draft-model proposal costs alone, prepacked, and in lockstep with other sequences' proposals.

Under load ``splitspec serve`` asks the draft model for the next steps of the sequences one tail batch resumed,
all at once. Each proposal is a catch-up forward (the tokens the verifier accepted) and one forward per tree level.
This times, per proposal (demo draft model, float32, one torch thread, greedy trees at ``--budget`` along held-out
code, 3 accepted tokens per step after 128 tokens of prompt):

* ``alone, MKL``: each proposal by itself, the draft model's LM head through PyTorch's matmul (before 81f1110);
* ``alone``: each by itself, its LM head prepacked for oneDNN (``EdgeRuntime`` packs it now);
* ``lockstep N``: N sequences' proposals advanced together (``decoding/lockstep.finish_together``), each round's
  forwards as one batched forward and one LM-head product.

The settings interleave, ``--repeats`` times; each figure is a median over the repeats of the mean ms per
proposal over ``--steps`` steps.

    python benchmarks/draft_lockstep.py [--repeats 3] [--steps 40] [--budget 8] [--out DIR]

Writes ``draft_lockstep.json``, ``draft_lockstep.md`` and ``draft_lockstep.png``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

LOCKSTEP = (2, 4, 8)  # sequences proposing together
PROMPT, ACCEPTED, STRIDE = 128, 3, 600  # prompt tokens, tokens accepted per step, tokens between sequences' texts


def settings() -> list[str]:
    return ["alone, MKL", "alone", *(f"lockstep {n}" for n in LOCKSTEP)]


def measure(setting: str, models: dict[str, Any], ids: Sequence[int], steps: int, budget: int) -> float:
    """Mean ms per proposal of ``setting`` over ``steps`` steps, on fresh draft models prepared for their prompts."""
    from splitspec.decoding.drafters import DraftModel
    from splitspec.decoding.lockstep import finish_together
    from splitspec.decoding.sampling import SamplingParams

    count = 1 if setting.startswith("alone") else int(setting.split()[-1])
    model = models["plain" if setting == "alone, MKL" else "packed"]
    drafters = [DraftModel(model, SamplingParams()) for _ in range(count)]
    texts = [ids[i * STRIDE :] for i in range(count)]
    for drafter, text in zip(drafters, texts, strict=True):
        drafter.prepare(text[:PROMPT])
    t0 = time.perf_counter()
    for step in range(steps):
        contexts = [text[: PROMPT + 1 + ACCEPTED * step] for text in texts]
        if count == 1:
            drafters[0].propose(contexts[0], budget)
        else:
            outcomes = finish_together([d.propose_steps(c, budget) for d, c in zip(drafters, contexts, strict=True)])
            for outcome in outcomes:
                outcome.result()  # raises what a proposal raised
    return (time.perf_counter() - t0) / (steps * count) * 1e3


def markdown(results: dict[str, Any]) -> str:
    summary = results["summary"]
    alone = summary["alone"]
    lines = [
        f"# Draft-model proposals alone and in lockstep (commit {results['commit']})",
        "",
        f"`{results['command']}`",
        "",
        f"Demo draft model, float32, one torch thread; greedy trees at budget {results['budget']} along held-out "
        f"code, {ACCEPTED} accepted tokens per step after {PROMPT} prompt tokens, {results['steps']} steps; median "
        f"over {results['repeats']} interleaved repeats of the mean ms per proposal (each repeat in brackets).",
        "",
        "| setting | ms per proposal | x alone (prepacked) | repeats |",
        "|---|---:|---:|---|",
    ]
    for setting in settings():
        per = ", ".join(f"{ms:.2f}" for ms in results["raw"][setting])
        lines.append(f"| {setting} | {summary[setting]:.2f} | {summary[setting] / alone:.2f} | {per} |")
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = settings()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.bar(names, [results["summary"][n] for n in names], color="#4c72b0")
    ax.set_ylabel("ms per proposal")
    ax.set_title(f"Draft-model proposals, budget {results['budget']} (commit {results['commit'][:8]})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40, help="proposals per sequence, setting and repeat")
    parser.add_argument("--budget", type=int, default=8, help="draft tokens per proposal")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/draft_lockstep"))
    args = parser.parse_args()
    if args.repeats < 1 or args.steps < 1 or args.budget < 1:
        parser.error("--repeats, --steps and --budget must be at least 1")
    from transformers import AutoTokenizer

    from splitspec.demo import ASSETS, embedded_model
    from splitspec.models.checkpoint import Checkpoint
    from splitspec.models.loading import load_full
    from splitspec.models.prepack import PackedLinear
    from splitspec.run_info import run_environment

    torch.set_num_threads(1)
    plain = load_full(Checkpoint(embedded_model("draft")), torch.float32)
    packed = load_full(Checkpoint(embedded_model("draft")), torch.float32)
    head = packed.lm_head
    if not isinstance(head, nn.Linear):
        parser.error(f"the draft model's LM head is a {type(head).__name__}, not a linear layer to prepack")
    packed.lm_head = PackedLinear(head)
    text = (ASSETS / "corpus" / "heldout" / "code" / "pdb.txt").read_text()
    tokenizer = AutoTokenizer.from_pretrained(embedded_model("base"), local_files_only=True)
    ids = tokenizer(text, add_special_tokens=False).input_ids
    needed = STRIDE * (max(LOCKSTEP) - 1) + PROMPT + 1 + ACCEPTED * args.steps
    if len(ids) < needed:
        parser.error(f"--steps {args.steps} needs {needed} tokens of text, the corpus file has {len(ids)}")
    models = {"plain": plain, "packed": packed}
    raw: dict[str, list[float]] = {s: [] for s in settings()}
    measure("lockstep 2", models, ids, 2, args.budget)  # warm both paths
    measure("alone, MKL", models, ids, 2, args.budget)
    for repeat in range(args.repeats):
        order = settings() if repeat % 2 == 0 else list(reversed(settings()))
        for setting in order:
            raw[setting].append(measure(setting, models, ids, args.steps, args.budget))
            print(f"repeat {repeat} {setting}: {raw[setting][-1]:.2f} ms per proposal", flush=True)
    command = "python benchmarks/draft_lockstep.py"
    for flag, value, default in (
        ("--repeats", args.repeats, 3),
        ("--steps", args.steps, 40),
        ("--budget", args.budget, 8),
    ):
        command += f" {flag} {value}" if value != default else ""
    results = {**run_environment(), "command": command, "repeats": args.repeats, "steps": args.steps}
    results |= {"budget": args.budget, "raw": raw, "summary": {s: statistics.median(v) for s, v in raw.items()}}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "draft_lockstep.json").write_text(json.dumps(results, indent=2))
    (args.out / "draft_lockstep.md").write_text(markdown(results))
    plot(results, args.out / "draft_lockstep.png")
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
