"""Benchmark: sampled drafting with the draft model, a single chain against a dynamic tree, same budget.

The embedded demo models (base verifies, draft drafts), float32, one thread, temperature 0.8 (or
``--temperature``; 0 is greedy, where the tree is EAGLE-2's top-k expansion and rerank),
verified locally (a :class:`~splitspec.decoding.local.LocalSequence`: the ratio of tokens per
step is what a split gains, each step being one round trip there). For each held-out prompt (code
and prose) and repeat, both shapes decode the same number of tokens with the same fixed budget,
interleaved, at each budget. Reported: tokens per verification step, drafting ms per step, the verifier's ms per
step here, and the tok/s those give over a link of RTT r, modelled as tokens per step /
(r + verify + draft) (the trunk's share of a step sits inside "verify" here).

    python benchmarks/tree_sampling.py [--budgets 8 16] [--tokens 64] [--repeats 3] [--temperature 0.8]
        [--out benchmarks/results/trees]

Writes tree_sampling.json and tree_sampling.md into --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

from splitspec.decoding.controller import FixedPolicy
from splitspec.decoding.drafters import DraftModel
from splitspec.decoding.local import LocalSequence
from splitspec.decoding.sampling import SamplingParams
from splitspec.decoding.speculative import SpecStep, speculative_decode
from splitspec.demo import embedded_model
from splitspec.models.checkpoint import Checkpoint
from splitspec.models.stack import FullModel, load_full
from splitspec.paths import display_path
from splitspec.run_info import run_environment

REPO = Path(__file__).resolve().parents[1]
HELDOUT = REPO / "src" / "splitspec" / "assets" / "corpus" / "heldout"
PROMPTS = (("code", "code/chunk.txt"), ("code", "code/asyncio.taskgroups.txt"), ("prose", None), ("prose", None))
PROMPT_CHARS = 400  # of each held-out text
RTTS_MS = (20.0, 80.0)
# (top_k, depth): top_k 1 is one chain as deep as the budget; the tree is DraftModel's default
SHAPES = {"chain": (1, None), "tree": (4, 8)}


def prompt_texts() -> list[tuple[str, str, str]]:
    """(label, file, text) for each prompt: named code files, the first prose files."""
    prose = sorted((HELDOUT / "prose").iterdir())
    out = []
    for i, (label, name) in enumerate(PROMPTS):
        path = HELDOUT / name if name else prose[i - 2]
        out.append((label, path.name, path.read_text()[:PROMPT_CHARS]))
    return out


async def one(
    model: FullModel,
    draft: FullModel,
    ids: list[int],
    shape: str,
    budget: int,
    tokens: int,
    seed: int,
    temperature: float,
) -> list[SpecStep]:
    params = SamplingParams(temperature=temperature)
    top_k, depth = SHAPES[shape]
    drafter = DraftModel(draft, params, torch.Generator().manual_seed(10_000 + seed), top_k=top_k, depth=depth)
    trace: list[SpecStep] = []
    out = speculative_decode(
        LocalSequence(model),
        ids,
        tokens,
        params,
        torch.Generator().manual_seed(seed),
        {"draft": drafter},
        FixedPolicy("draft", budget),
        trace=trace,
    )
    async for _ in out:
        pass
    return [s for s in trace if s.drafter is not None]


def summarise(steps: list[SpecStep]) -> dict[str, float]:
    emitted = sum(s.emitted for s in steps)
    verify_ms = statistics.median(s.step_s for s in steps) * 1e3
    draft_ms = statistics.median(s.draft_s for s in steps) * 1e3
    per_step = emitted / len(steps)
    out = {
        "steps": len(steps),
        "tokens_per_step": per_step,
        "draft_ms": draft_ms,
        "verify_ms": verify_ms,
        "accepted_per_step": sum(s.accepted for s in steps) / len(steps),
    }
    for rtt in RTTS_MS:
        out[f"tok_s_at_{rtt:g}ms"] = per_step / ((rtt + verify_ms + draft_ms) / 1e3)
    return out


def run_budget(
    model: FullModel,
    draft: FullModel,
    prompts: list[tuple[str, list[int]]],
    budget: int,
    tokens: int,
    repeats: int,
    temperature: float,
) -> dict[str, Any]:
    """Both shapes at one budget, interleaved per prompt and repeat: overall and per-prompt figures."""
    steps: dict[str, list[SpecStep]] = {shape: [] for shape in SHAPES}
    per_prompt: list[dict[str, Any]] = []
    for name, ids in prompts:
        mine: dict[str, list[SpecStep]] = {shape: [] for shape in SHAPES}
        for repeat in range(repeats):
            for shape in SHAPES:  # interleaved: both shapes see the machine in the same state
                trace = asyncio.run(one(model, draft, ids, shape, budget, tokens, repeat, temperature))
                mine[shape] += trace
                steps[shape] += trace
        row: dict[str, Any] = {"prompt": name, "prompt_tokens": len(ids)}
        row.update({shape: summarise(mine[shape]) for shape in SHAPES})
        row["tree_over_chain_tokens_per_step"] = row["tree"]["tokens_per_step"] / row["chain"]["tokens_per_step"]
        per_prompt.append(row)
        print(budget, name, {s: round(row[s]["tokens_per_step"], 2) for s in SHAPES}, flush=True)
    overall = {shape: summarise(steps[shape]) for shape in SHAPES}
    ratios = {key: overall["tree"][key] / overall["chain"][key] for key in overall["tree"] if key != "steps"}
    return {"budget": budget, "overall": overall, "tree_over_chain": ratios, "per_prompt": per_prompt}


def table(results: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| budget | shape | tokens/step | accepted/step | draft ms | verify ms | "
        + " | ".join(f"tok/s @ {r:g} ms" for r in RTTS_MS)
        + " |",
        "|---:|---|---:|---:|---:|---:|" + "---:|" * len(RTTS_MS),
    ]
    for res in results:
        b = res["budget"]
        for shape, s in res["overall"].items():
            lines.append(
                f"| {b} | {shape} | {s['tokens_per_step']:.2f} | {s['accepted_per_step']:.2f} | {s['draft_ms']:.1f} | "
                f"{s['verify_ms']:.1f} | " + " | ".join(f"{s[f'tok_s_at_{r:g}ms']:.1f}" for r in RTTS_MS) + " |"
            )
        q = res["tree_over_chain"]
        lines.append(
            f"| {b} | **tree / chain** | **{q['tokens_per_step']:.2f}x** | {q['accepted_per_step']:.2f}x | "
            f"{q['draft_ms']:.2f}x | {q['verify_ms']:.2f}x | "
            + " | ".join(f"**{q[f'tok_s_at_{r:g}ms']:.2f}x**" for r in RTTS_MS)
            + " |"
        )
    lines += [
        "",
        "| budget | prompt | chain tokens/step | tree tokens/step | tree / chain |",
        "|---:|---|---:|---:|---:|",
    ]
    for res in results:
        for row in res["per_prompt"]:
            lines.append(
                f"| {res['budget']} | {row['prompt']} | {row['chain']['tokens_per_step']:.2f} | "
                f"{row['tree']['tokens_per_step']:.2f} | {row['tree_over_chain_tokens_per_step']:.2f}x |"
            )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", type=int, nargs="+", default=[8, 16], help="draft tokens (tree nodes) per step")
    parser.add_argument("--tokens", type=int, default=64, help="tokens decoded per prompt and repeat")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats (seeds) per prompt")
    parser.add_argument("--temperature", type=float, default=0.8, help="sampling temperature (0: greedy)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/trees"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    env = run_environment()
    base_dir, draft_dir = embedded_model("base"), embedded_model("draft")
    model = load_full(Checkpoint(base_dir), torch.float32)
    draft = load_full(Checkpoint(draft_dir), torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    prompts = [(f"{name} ({label})", list(tokenizer(text)["input_ids"])) for label, name, text in prompt_texts()]
    t0 = time.perf_counter()
    with torch.inference_mode():
        results = [
            run_budget(model, draft, prompts, b, args.tokens, args.repeats, args.temperature) for b in args.budgets
        ]
    result = {
        "environment": env,
        "wall_s": time.perf_counter() - t0,
        "models": {
            "verifier": display_path(base_dir, REPO),
            "draft": display_path(draft_dir, REPO),
            "dtype": "float32",
        },
        "settings": {
            "temperature": args.temperature,
            "tokens": args.tokens,
            "repeats": args.repeats,
            "shapes": {k: {"top_k": v[0], "depth": v[1]} for k, v in SHAPES.items()},
            "prompt_chars": PROMPT_CHARS,
            "rtts_ms": list(RTTS_MS),
        },
        "results": results,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tree_sampling.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        f"# Drafting at temperature {args.temperature:g}: one chain vs a dynamic tree, same budget",
        "",
        f"The demo draft model drafting for the demo base model (float32, one thread), {args.tokens} tokens per "
        f"prompt, {args.repeats} interleaved repeats, commit `{env['commit']}`. chain: top_k 1, as deep as the "
        "budget; tree: top_k 4, depth 8 (DraftModel's default). Verified locally (LocalSequence); tok/s over a "
        "link is modelled as tokens per step / (RTT + verify + draft), per-step medians.",
        "",
        "    python benchmarks/tree_sampling.py "
        + " ".join(f"--budgets {' '.join(map(str, args.budgets))}".split())
        + f" --tokens {args.tokens} --repeats {args.repeats} --temperature {args.temperature:g}",
        "",
        *table(results),
    ]
    (args.out / "tree_sampling.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
