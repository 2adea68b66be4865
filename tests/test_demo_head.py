"""The EAGLE draft head shipped for the demo base model: pinned to it, small, trained on text the benchmark
prompts avoid, and its drafts accepted by the base model far more often than an untrained head's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import splitspec
from splitspec.exceptions import ConfigError
from splitspec.models.checkpoint import Checkpoint, load_tokenizer
from splitspec.models.draft_head_eval import greedy_chains
from splitspec.models.draft_head_io import load_draft_head
from splitspec.models.loading import load_full
from splitspec.models.train_draft_head import LocalFeatures

ASSETS = Path(splitspec.__file__).parent / "assets"
HEAD = ASSETS / "models" / "base-eagle"
BASE = ASSETS / "models" / "base"
MAX_HEAD_BYTES = 2 * 1024 * 1024
HELD_OUT = ("alls_well_that_ends_well.txt", "pkgutil.txt")  # never trained on: the benchmark's prompts
# tokens per verification of depth-4 greedy chains on these prompts, well under the model card's figure
# (an untrained head scores about 1.0)
FLOOR = 1.3

pytestmark = pytest.mark.skipif(not (HEAD / "config.json").is_file(), reason="the demo head is not built")


def test_the_head_is_small_and_never_saw_the_benchmark_prompts() -> None:
    assert (HEAD / "model.safetensors").stat().st_size <= MAX_HEAD_BYTES
    notes = json.loads((HEAD / "config.json").read_text())["splitspec_draft_head"]["notes"]
    assert notes["steps"] > 0
    assert not set(HELD_OUT) & set(notes["corpus"])
    for name in ("README.md", "config.json", "model.safetensors"):
        assert (HEAD / name).is_file()


def test_the_head_loads_for_base_only() -> None:
    load_draft_head(HEAD, Checkpoint(BASE))
    with pytest.raises(ConfigError, match="trained for base"):
        load_draft_head(HEAD, Checkpoint(ASSETS / "models" / "draft"))


def test_base_accepts_the_heads_drafts_on_held_out_text() -> None:
    torch.set_num_threads(1)
    target = Checkpoint(BASE)
    head = load_draft_head(HEAD, target)
    tokenizer = load_tokenizer(BASE)
    prose = (ASSETS / "corpus" / "heldout" / "prose" / HELD_OUT[0]).read_text()[20_000:24_000]
    code = (ASSETS / "corpus" / "heldout" / "code" / HELD_OUT[1]).read_text()[2_000:6_000]
    prompts = [tokenizer(text)["input_ids"][:48] for text in (prose, code)]
    report = greedy_chains(head, LocalFeatures(load_full(target, torch.float32), (8,)), prompts, 32, 4)
    assert report.mean_accepted_length >= FLOOR, report
