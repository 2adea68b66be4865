"""Benchmark: what a reduced draft vocabulary costs the shipped EAGLE head in acceptance, and saves in drafting time.

The shipped head (``embedded_model("base-eagle")``) scores its drafts through the base model's LM head (8,192
rows). ``with_draft_vocab`` (what ``train-drafter --draft-vocab N`` saves) keeps the N tokens most frequent in
the base model's own training split (``scripts/build_corpus.py --out build/corpus``; the held-out prompts below
never were in it). Reported per vocabulary size:

* coverage: the share of the held-out text's tokens inside the vocabulary (a token outside is never drafted);
* greedy chains: tokens per verification of depth-4 and depth-6 chains verified by the whole base model in float32
  (``scripts/demo_head.py measure``'s protocol: 16 held-out prompts of 64 tokens per domain, 48 new tokens);
* drafting time: one ``EagleDrafter.propose`` (an EAGLE-2 tree of ``budget`` nodes, the head fed the base
  model's features after 200 tokens of held-out text, three tokens newly committed as after an accepted step),
  median ms, the heads interleaved call by call, ``--repeats`` rounds, one thread. The base model's LM head is
  prepacked for oneDNN where that measures faster here, as the edge does (``EdgeRuntime``); a reduced head's own
  LM head runs as an ``nn.Linear``. A proposal's time also follows its tree's shape (how many levels it runs),
  which differs between the heads;
* the head's logits alone (``DraftHead.logits`` over 1 and 4 nodes, the LM-head part of every level), median ms;
* the same product at a real model's shape, random weights: Llama 3.2 1B's LM head (V = 128,256, H = 2,048,
  float32) against a 32,768-token draft vocabulary (EAGLE-3's), 1 and 4 rows, median ms.

    python benchmarks/draft_vocab.py [--sizes 1024 2048 4096] [--repeats 3] [--calls 20]
        [--out benchmarks/results/draft_vocab]

Writes draft_vocab.json, draft_vocab.md and draft_vocab.png into --out.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from splitspec.decoding.eagle import EagleDrafter
from splitspec.decoding.local import LocalSequence
from splitspec.decoding.sampling import SamplingParams
from splitspec.demo import embedded_model
from splitspec.models.checkpoint import Checkpoint
from splitspec.models.draft_head import DraftHead
from splitspec.models.draft_head_eval import greedy_chains, heldout_prompts
from splitspec.models.draft_head_io import load_draft_head
from splitspec.models.draft_vocab import frequent_tokens, token_counts, with_draft_vocab
from splitspec.models.loading import load_full
from splitspec.models.prepack import PackedLinear, packed_is_faster
from splitspec.models.stack import FullModel
from splitspec.models.train_draft_head import LocalFeatures, read_corpus
from splitspec.run_info import run_environment

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
from demo_head import HELD_OUT_CODE, HELD_OUT_PROSE, TRAIN  # noqa: E402  (the model card's files)

BUDGETS = (8, 16)
DEPTHS = (4, 6)
ROWS = (1, 4)
REAL_SHAPE = (128_256, 2_048)  # Llama 3.2 1B's LM head (V, H)
REAL_DRAFT_VOCAB = 32_768  # EAGLE-3's draft vocabulary


def interleaved_ms(calls: dict[str, Any], repeats: int, count: int) -> dict[str, dict[str, Any]]:
    """Median ms of each zero-argument callable, the callables interleaved call by call; with each repeat's median."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    rounds: dict[str, list[float]] = {name: [] for name in calls}
    for fn in calls.values():
        fn()  # warm-up
    for _ in range(repeats):
        for _ in range(count):
            for name, fn in calls.items():
                t0 = time.perf_counter()
                fn()
                times[name].append(1e3 * (time.perf_counter() - t0))
        for name in calls:
            rounds[name].append(statistics.median(times[name][-count:]))
    return {name: {"median_ms": statistics.median(times[name]), "per_repeat_ms": rounds[name]} for name in calls}


def heads(base: FullModel, sizes: list[int]) -> dict[str, DraftHead]:
    """The shipped head, and its copies over the ``sizes`` most frequent tokens of the training split."""
    shipped = load_draft_head(embedded_model("base-eagle"), Checkpoint(embedded_model("base")))
    counts = token_counts(read_corpus(TRAIN, embedded_model("base"), 3), base.vocab_size)
    out = {"all": shipped}
    for n in sizes:
        out[str(n)] = with_draft_vocab(shipped, base, frequent_tokens(counts, n))
    return out


def coverage(heads_: dict[str, DraftHead], base: FullModel) -> dict[str, float]:
    held = token_counts(read_corpus([*HELD_OUT_CODE, *HELD_OUT_PROSE], embedded_model("base"), 3), base.vocab_size)
    out = {}
    for name, head in heads_.items():
        if head.d2t is None:
            out[name] = 1.0
            continue
        ids = torch.arange(head.d2t.shape[0]) + head.d2t
        out[name] = float(held[ids].sum()) / float(held.sum())
    return out


def chains(heads_: dict[str, DraftHead], source: LocalFeatures) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {name: {} for name in heads_}
    for domain, files in (("code", HELD_OUT_CODE), ("prose", HELD_OUT_PROSE)):
        prompts = heldout_prompts(read_corpus(files, embedded_model("base"), 65), 16, 64, 0)
        for depth in DEPTHS:
            for name, head in heads_.items():
                report = greedy_chains(head, source, prompts, 48, depth)
                out[name][f"{domain} depth {depth}"] = round(report.mean_accepted_length, 3)
            print(f"{domain} depth {depth}: {[out[n][f'{domain} depth {depth}'] for n in heads_]}", file=sys.stderr)
    return out


def drafting_ms(heads_: dict[str, DraftHead], base: FullModel, repeats: int, calls: int) -> dict[str, dict[str, Any]]:
    """Median ms of one proposal per head and budget, interleaved call by call across the heads."""
    context = read_corpus(HELD_OUT_CODE[:1], embedded_model("base"), 202)[0][:200].tolist()
    verifier = LocalSequence(base)
    verifier.keep_features(heads_["all"].config.feature_layers)
    verifier.run(context)
    pending = [*context, int(context[-1])]  # the last context token repeated as the pending one
    out: dict[str, dict[str, Any]] = {name: {} for name in heads_}
    for budget in BUDGETS:
        drafters = {n: EagleDrafter(h, lambda: base, verifier, SamplingParams()) for n, h in heads_.items()}
        for drafter in drafters.values():
            drafter.propose(pending, budget)  # the head's cache holds the context's pairs

        def propose(drafter: EagleDrafter, budget: int = budget) -> None:
            drafter._fed = drafter._fed[:-3]  # three pairs to feed again, as after an accepted step
            drafter.propose(pending, budget)

        timed = interleaved_ms({n: (lambda d=d: propose(d)) for n, d in drafters.items()}, repeats, calls)
        for name in heads_:
            out[name][f"budget {budget}"] = timed[name]
    return out


@torch.inference_mode()
def logits_ms(heads_: dict[str, DraftHead], base: FullModel, repeats: int, calls: int) -> dict[str, dict[str, Any]]:
    """Median ms of the head's logits over 1 and 4 nodes, interleaved across the heads."""
    out: dict[str, dict[str, Any]] = {name: {} for name in heads_}
    for rows in ROWS:
        hidden = torch.randn(rows, base.hidden_size)  # (rows, H)
        timed = interleaved_ms(
            {n: (lambda h=h, x=hidden: h.logits(base, x)) for n, h in heads_.items()}, repeats, calls
        )
        for name in heads_:
            out[name][f"{rows} row{'s' if rows > 1 else ''}"] = timed[name]
    return out


@torch.inference_mode()
def real_shape_ms(repeats: int, calls: int) -> dict[str, dict[str, Any]]:
    """A real model's LM-head product against a 32,768-token draft vocabulary's (random float32 weights)."""
    vocab, hidden = REAL_SHAPE
    whole = torch.randn(vocab, hidden)  # (V, H): 1 GB
    reduced = whole[:REAL_DRAFT_VOCAB].clone()  # (Vd, H)
    out: dict[str, dict[str, Any]] = {}
    for rows in ROWS:
        x = torch.randn(rows, hidden)
        timed = interleaved_ms(
            {
                f"{vocab:,} rows": lambda x=x: torch.nn.functional.linear(x, whole),
                f"{REAL_DRAFT_VOCAB:,} rows": lambda x=x: torch.nn.functional.linear(x, reduced),
            },
            repeats,
            calls,
        )
        out[f"{rows} row{'s' if rows > 1 else ''}"] = timed
    return out


def markdown(results: dict[str, Any]) -> list[str]:
    names = list(results["coverage"])
    lines = [
        f"# A reduced draft vocabulary for the shipped EAGLE head (commit {results['commit']})",
        "",
        f"`{results['command']}`",
        "",
        "| draft vocabulary | held-out tokens inside | "
        + " | ".join(f"{k} (tokens / verification)" for k in results["chains"]["all"])
        + " | "
        + " | ".join(f"propose, {k} (ms)" for k in results["drafting"]["all"])
        + " |",
        "|---" * (2 + len(results["chains"]["all"]) + len(results["drafting"]["all"])) + "|",
    ]
    ms = "{:.2f} ({})".format
    for name in names:
        label = "all 8,192 (shipped)" if name == "all" else f"{int(name):,}"
        cells = [f"{results['coverage'][name]:.3f}"]
        cells += [f"{v:.3f}" for v in results["chains"][name].values()]
        cells += [
            ms(v["median_ms"], ", ".join(f"{x:.2f}" for x in v["per_repeat_ms"]))
            for v in results["drafting"][name].values()
        ]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += ["", "| draft vocabulary | " + " | ".join(f"logits, {k} (ms)" for k in results["logits"]["all"]) + " |"]
    lines.append("|---" * (1 + len(results["logits"]["all"])) + "|")
    for name in names:
        label = "all 8,192 (shipped)" if name == "all" else f"{int(name):,}"
        values = results["logits"][name].values()
        lines.append(
            f"| {label} | "
            + " | ".join(ms(v["median_ms"], ", ".join(f"{x:.3f}" for x in v["per_repeat_ms"])) for v in values)
            + " |"
        )
    lines += ["", f"A real model's LM head (random float32 weights, H = {REAL_SHAPE[1]:,}), one product, ms:", ""]
    rows = list(results["real_shape"])
    lines += ["| LM head | " + " | ".join(rows) + " |", "|---" * (1 + len(rows)) + "|"]
    for head in results["real_shape"][rows[0]]:
        cells = [
            ms(
                results["real_shape"][r][head]["median_ms"],
                ", ".join(f"{x:.1f}" for x in results["real_shape"][r][head]["per_repeat_ms"]),
            )
            for r in rows
        ]
        lines.append(f"| {head} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Medians over every call, then each repeat's median in brackets (the compared callables interleaved call by"
        " call). The base model's LM head "
        + ("was" if results["lm_head_prepacked"] else "was not")
        + " prepacked for oneDNN (measured faster here, as the edge decides).",
    ]
    return lines


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["coverage"])
    sizes = [8192 if n == "all" else int(n) for n in names]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for key in results["chains"]["all"]:
        axes[0].plot(sizes, [results["chains"][n][key] for n in names], "o-", label=key)
    axes[0].set(xlabel="draft vocabulary (tokens)", ylabel="tokens per verification", xscale="log", xticks=sizes)
    axes[0].set_xticklabels([str(s) for s in sizes])
    axes[0].legend(fontsize=8)
    for key in results["drafting"]["all"]:
        axes[1].plot(sizes, [results["drafting"][n][key]["median_ms"] for n in names], "o-", label=key)
    axes[1].set(xlabel="draft vocabulary (tokens)", ylabel="one proposal, ms", xscale="log", xticks=sizes)
    axes[1].set_xticklabels([str(s) for s in sizes])
    axes[1].legend(fontsize=8)
    fig.suptitle("The shipped EAGLE head over a reduced draft vocabulary")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--calls", type=int, default=20, help="proposals per head, budget and repeat")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "draft_vocab")
    args = parser.parse_args()
    if not TRAIN:
        raise SystemExit("no training split in build/corpus/train: run scripts/build_corpus.py --out build/corpus")
    torch.set_num_threads(1)
    env = run_environment()
    base = load_full(Checkpoint(embedded_model("base")), torch.float32)
    heads_ = heads(base, sorted(args.sizes))
    results: dict[str, Any] = {
        **env,
        "command": "python benchmarks/draft_vocab.py " + shlex.join(sys.argv[1:]),
        "coverage": coverage(heads_, base),
        "chains": chains(heads_, LocalFeatures(base, heads_["all"].config.feature_layers)),
    }
    if isinstance(base.lm_head, torch.nn.Linear) and packed_is_faster(base.lm_head):
        base.lm_head = PackedLinear(base.lm_head)  # as the edge holds it (EdgeRuntime._prepack)
    results["lm_head_prepacked"] = isinstance(base.lm_head, PackedLinear)
    results["drafting"] = drafting_ms(heads_, base, args.repeats, args.calls)
    results["logits"] = logits_ms(heads_, base, args.repeats, 10 * args.calls)
    results["real_shape"] = real_shape_ms(args.repeats, max(3, args.calls // 4))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "draft_vocab.json").write_text(json.dumps(results, indent=1) + "\n")
    (args.out / "draft_vocab.md").write_text("\n".join(markdown(results)) + "\n")
    plot(results, args.out / "draft_vocab.png")
    print("\n".join(markdown(results)))


if __name__ == "__main__":
    main()
