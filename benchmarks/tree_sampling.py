"""Benchmark: sampled drafting, a single chain against dynamic trees, per budget and each at its best.

The embedded demo base model verifies; the drafter is the demo draft model (``--drafter draft``) or
the shipped EAGLE head over the base model's own features (``--drafter head``). float32, one
thread, temperature 0.8 (or ``--temperature``; 0 is greedy, where a tree is EAGLE-2's top-k
expansion and rerank), verified locally (a :class:`~splitspec.decoding.local.LocalSequence`: the
ratio of tokens per step is what a split gains, each step being one round trip there).

Shapes (``top_k`` children per expanded node, ``depth`` levels at most): ``chain`` (top_k 1, as
deep as the budget), ``tree`` (top_k 4 at the drafter's default depth: 8 for the draft model, 6
for the head) and ``tree-2`` (top_k 2, depth 8). For each held-out prompt (code and prose) and
repeat, every shape decodes the same number of tokens at the same fixed budget, interleaved, at
each budget. Reported per budget: tokens per verification step, drafting ms per step, the
verifier's ms per step here, and the tok/s those give over a link of RTT r, modelled as tokens per
step / (r + verify + draft) (the trunk's share of a step sits inside "verify" here). Then each
shape at its best budget per RTT, and best tree / best chain: the comparison a controller that
picks each shape's budget faces. Also the measured chance that the j-th sampled sibling is
accepted once the ones before it were rejected (:class:`~splitspec.decoding.trees.SiblingStats`,
at the end of each run, averaged): what a tree's width can add to a chain's depth.

    python benchmarks/tree_sampling.py [--drafter draft|head] [--budgets 6 8 12 16] [--tokens 64]
        [--repeats 3] [--temperature 0.8] [--out benchmarks/results/trees]

Writes tree_sampling.json and tree_sampling.md into --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

from splitspec.decoding.controller import FixedPolicy
from splitspec.decoding.drafters import DraftModel
from splitspec.decoding.eagle import EagleDrafter
from splitspec.decoding.local import LocalSequence
from splitspec.decoding.sampling import SamplingParams
from splitspec.decoding.speculative import SpecStep, speculative_decode
from splitspec.demo import embedded_model
from splitspec.models.checkpoint import Checkpoint
from splitspec.models.draft_head import DraftHead
from splitspec.models.draft_head_io import load_draft_head
from splitspec.models.loading import load_full
from splitspec.models.stack import FullModel
from splitspec.paths import display_path
from splitspec.run_info import run_environment

REPO = Path(__file__).resolve().parents[1]
HELDOUT = REPO / "src" / "splitspec" / "assets" / "corpus" / "heldout"
PROMPTS = (("code", "code/chunk.txt"), ("code", "code/asyncio.taskgroups.txt"), ("prose", None), ("prose", None))
PROMPT_CHARS = 400  # of each held-out text
RTTS_MS = (20.0, 80.0, 150.0)
DEFAULT_DEPTH = {"draft": 8, "head": 6}  # DraftModel's and EagleDrafter's default tree depths


def shapes(drafter: str) -> dict[str, tuple[int, int | None]]:
    """name -> (top_k, depth): top_k 1 is one chain as deep as the budget (depth None)."""
    return {"chain": (1, None), "tree": (4, DEFAULT_DEPTH[drafter]), "tree-2": (2, 8)}


@dataclass(frozen=True)
class Models:
    target: FullModel
    draft: FullModel | None  # the draft model (--drafter draft)
    head: DraftHead | None  # the EAGLE head (--drafter head)


def prompt_texts() -> list[tuple[str, str, str]]:
    """(label, file, text) for each prompt: named code files, the first prose files."""
    prose = sorted((HELDOUT / "prose").iterdir())
    out = []
    for i, (label, name) in enumerate(PROMPTS):
        path = HELDOUT / name if name else prose[i - 2]
        out.append((label, path.name, path.read_text()[:PROMPT_CHARS]))
    return out


async def one(
    models: Models, ids: list[int], shape: tuple[int, int | None], budget: int, tokens: int, seed: int, temp: float
) -> tuple[list[SpecStep], list[float]]:
    """One decode at a fixed budget -> its drafted steps and the drafter's measured sibling rates at the end."""
    params = SamplingParams(temperature=temp)
    top_k, depth = shape
    generator = torch.Generator().manual_seed(10_000 + seed)
    verifier = LocalSequence(models.target)
    drafter: DraftModel | EagleDrafter
    if models.head is not None:
        verifier.keep_features(models.head.config.feature_layers)
        target = models.target
        drafter = EagleDrafter(models.head, lambda: target, verifier, params, generator, top_k, depth or budget)
    elif models.draft is not None:
        drafter = DraftModel(models.draft, params, generator, top_k=top_k, depth=depth)
    else:
        raise ValueError("no drafter loaded")
    trace: list[SpecStep] = []
    out = speculative_decode(
        verifier,
        ids,
        tokens,
        params,
        torch.Generator().manual_seed(seed),
        {drafter.name: drafter},
        FixedPolicy(drafter.name, budget),
        trace=trace,
    )
    async for _ in out:
        pass
    return [s for s in trace if s.drafter is not None], drafter.siblings.rates()


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
    models: Models,
    kinds: dict[str, tuple[int, int | None]],
    prompts: list[tuple[str, list[int]]],
    budget: int,
    tokens: int,
    repeats: int,
    temperature: float,
) -> dict[str, Any]:
    """Every shape at one budget, interleaved per prompt and repeat: overall and per-prompt figures."""
    steps: dict[str, list[SpecStep]] = {shape: [] for shape in kinds}
    rates: dict[str, list[list[float]]] = {shape: [] for shape in kinds}
    per_prompt: list[dict[str, Any]] = []
    for name, ids in prompts:
        mine: dict[str, list[SpecStep]] = {shape: [] for shape in kinds}
        for repeat in range(repeats):
            for shape, spec in kinds.items():  # interleaved: every shape sees the machine in the same state
                trace, measured = asyncio.run(one(models, ids, spec, budget, tokens, repeat, temperature))
                mine[shape] += trace
                steps[shape] += trace
                rates[shape].append(measured)
        row: dict[str, Any] = {"prompt": name, "prompt_tokens": len(ids)}
        row.update({shape: summarise(mine[shape]) for shape in kinds})
        per_prompt.append(row)
        print(budget, name, {s: round(row[s]["tokens_per_step"], 2) for s in kinds}, flush=True)
    overall = {shape: summarise(steps[shape]) for shape in kinds}
    ratios = {
        shape: {key: overall[shape][key] / overall["chain"][key] for key in overall[shape] if key != "steps"}
        for shape in kinds
        if shape != "chain"
    }
    sibling_rates = {shape: [statistics.fmean(col) for col in zip(*rs, strict=True)] for shape, rs in rates.items()}
    return {
        "budget": budget,
        "overall": overall,
        "over_chain": ratios,
        "sibling_rates": sibling_rates,
        "per_prompt": per_prompt,
    }


def best(results: list[dict[str, Any]], kinds: list[str]) -> dict[str, dict[str, Any]]:
    """Each shape's best budget per RTT (modelled tok/s), and each tree's best / the chain's best."""
    out: dict[str, dict[str, Any]] = {}
    for rtt in RTTS_MS:
        key = f"tok_s_at_{rtt:g}ms"
        row: dict[str, Any] = {}
        for shape in kinds:
            top = max(results, key=lambda res: res["overall"][shape][key])
            row[shape] = {"budget": top["budget"], "tok_s": top["overall"][shape][key]}
        for shape in kinds:
            if shape != "chain":
                row[f"{shape}/chain"] = row[shape]["tok_s"] / row["chain"]["tok_s"]
        out[f"{rtt:g}"] = row
    return out


def table(results: list[dict[str, Any]], kinds: list[str], bests: dict[str, dict[str, Any]]) -> list[str]:
    lines = [
        "| budget | shape | tokens/step | accepted/step | draft ms | verify ms | "
        + " | ".join(f"tok/s @ {r:g} ms" for r in RTTS_MS)
        + " | sibling acceptance by rank |",
        "|---:|---|---:|---:|---:|---:|" + "---:|" * len(RTTS_MS) + "---|",
    ]
    for res in results:
        b = res["budget"]
        for shape, s in res["overall"].items():
            siblings = ", ".join(f"{x:.2f}" for x in res["sibling_rates"][shape]) if shape != "chain" else "-"
            lines.append(
                f"| {b} | {shape} | {s['tokens_per_step']:.2f} | {s['accepted_per_step']:.2f} | {s['draft_ms']:.1f} | "
                f"{s['verify_ms']:.1f} | "
                + " | ".join(f"{s[f'tok_s_at_{r:g}ms']:.1f}" for r in RTTS_MS)
                + f" | {siblings} |"
            )
        for shape, q in res["over_chain"].items():
            lines.append(
                f"| {b} | **{shape} / chain** | **{q['tokens_per_step']:.2f}x** | {q['accepted_per_step']:.2f}x | "
                f"{q['draft_ms']:.2f}x | {q['verify_ms']:.2f}x | "
                + " | ".join(f"**{q[f'tok_s_at_{r:g}ms']:.2f}x**" for r in RTTS_MS)
                + " | |"
            )
    trees = [k for k in kinds if k != "chain"]
    lines += [
        "",
        "Each shape at its best budget (modelled tok/s, budget in brackets):",
        "",
        "| RTT ms | " + " | ".join(kinds) + " | " + " | ".join(f"best {t} / best chain" for t in trees) + " |",
        "|---:|" + "---:|" * (len(kinds) + len(trees)),
    ]
    for rtt, row in bests.items():
        lines.append(
            f"| {rtt} | "
            + " | ".join(f"{row[k]['tok_s']:.1f} ({row[k]['budget']})" for k in kinds)
            + " | "
            + " | ".join(f"**{row[f'{t}/chain']:.2f}x**" for t in trees)
            + " |"
        )
    lines += ["", "| budget | prompt | " + " | ".join(f"{k} tokens/step" for k in kinds) + " |"]
    lines.append("|---:|---|" + "---:|" * len(kinds))
    for res in results:
        for row in res["per_prompt"]:
            cells = " | ".join(f"{row[k]['tokens_per_step']:.2f}" for k in kinds)
            lines.append(f"| {res['budget']} | {row['prompt']} | {cells} |")
    return lines


def load_models(drafter: str) -> tuple[Models, dict[str, str]]:
    base_dir = embedded_model("base")
    target = load_full(Checkpoint(base_dir), torch.float32)
    if drafter == "head":
        head_dir = embedded_model("base-eagle")
        models = Models(target, None, load_draft_head(head_dir, Checkpoint(base_dir)))
        names = {"verifier": display_path(base_dir, REPO), "draft head": display_path(head_dir, REPO)}
    else:
        draft_dir = embedded_model("draft")
        models = Models(target, load_full(Checkpoint(draft_dir), torch.float32), None)
        names = {"verifier": display_path(base_dir, REPO), "draft model": display_path(draft_dir, REPO)}
    return models, {**names, "dtype": "float32"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafter", choices=("draft", "head"), default="draft", help="the draft model or the head")
    parser.add_argument("--budgets", type=int, nargs="+", default=[8, 16], help="draft tokens (tree nodes) per step")
    parser.add_argument("--tokens", type=int, default=64, help="tokens decoded per prompt and repeat")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats (seeds) per prompt")
    parser.add_argument("--temperature", type=float, default=0.8, help="sampling temperature (0: greedy)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/trees"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    env = run_environment()
    models, names = load_models(args.drafter)
    kinds = shapes(args.drafter)
    tokenizer = AutoTokenizer.from_pretrained(embedded_model("base"))
    prompts = [(f"{name} ({label})", list(tokenizer(text)["input_ids"])) for label, name, text in prompt_texts()]
    t0 = time.perf_counter()
    with torch.inference_mode():
        results = [
            run_budget(models, kinds, prompts, b, args.tokens, args.repeats, args.temperature) for b in args.budgets
        ]
    bests = best(results, list(kinds))
    command = (
        f"python benchmarks/tree_sampling.py --drafter {args.drafter} --budgets {' '.join(map(str, args.budgets))} "
        f"--tokens {args.tokens} --repeats {args.repeats} --temperature {args.temperature:g}"
    )
    result = {
        "environment": env,
        "command": command,
        "wall_s": time.perf_counter() - t0,
        "models": names,
        "settings": {
            "drafter": args.drafter,
            "temperature": args.temperature,
            "tokens": args.tokens,
            "repeats": args.repeats,
            "shapes": {k: {"top_k": v[0], "depth": v[1]} for k, v in kinds.items()},
            "prompt_chars": PROMPT_CHARS,
            "rtts_ms": list(RTTS_MS),
        },
        "results": results,
        "best": bests,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tree_sampling.json").write_text(json.dumps(result, indent=2) + "\n")
    who = "the shipped EAGLE head" if args.drafter == "head" else "the demo draft model"
    lines = [
        f"# Drafting at temperature {args.temperature:g}: one chain against dynamic trees ({who})",
        "",
        f"{who[0].upper()}{who[1:]} drafting for the demo base model (float32, one thread), {args.tokens} tokens "
        f"per prompt, {args.repeats} interleaved repeats, commit `{env['commit']}`. Shapes (top_k, depth): "
        + ", ".join(f"{k} {v}" for k, v in kinds.items())
        + " (depth None: the budget). Verified locally (LocalSequence); tok/s over a link is modelled as tokens "
        "per step / (RTT + verify + draft), per-step medians.",
        "",
        f"    {command}",
        "",
        *table(results, list(kinds), bests),
    ]
    (args.out / "tree_sampling.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
