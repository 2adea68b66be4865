"""Longrope (Phi-3's long contexts): rotary tables that follow the largest position of a call, and depend on the
position limit.

transformers' longrope switches every position of a call to its long frequencies once the call's largest position
passes ``original_max_position_embeddings``, and its attention factor reads ``max_position_embeddings``. So a batched
forward must compute each row's rotary as its step alone does, and a draft head's target check must keep the limit.
The checkpoint is built here (a tiny Phi-3 whose original context is 16), not in the shared family list.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

from splitspec.models.batched import BatchRow, forward_batch
from splitspec.models.checkpoint import Checkpoint
from splitspec.models.draft_head import rope_reads_position_limit, target_fingerprint
from splitspec.models.kv_cache import KVCache
from splitspec.models.loading import load_trunk
from splitspec.models.masks import depths
from splitspec.models.split import SplitPlan

ORIGINAL = 16  # the pretraining context: a step whose positions pass it switches to the long factors


def _phi3_longrope(directory: Path, max_positions: int = 64) -> Path:
    config = transformers.Phi3Config(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        original_max_position_embeddings=ORIGINAL,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "long_factor": [1.0, 2.5, 4.0, 8.0],  # head_dim 8: one factor per frequency
            "short_factor": [1.0, 1.1, 1.2, 1.3],
        },
        initializer_range=0.2,
        bos_token_id=0,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(3)
    transformers.AutoModelForCausalLM.from_config(config).eval().save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def phi3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _phi3_longrope(tmp_path_factory.mktemp("phi3-longrope"))


def _with_position_limit(source: Path, directory: Path, limit: int) -> Path:
    """A copy of checkpoint ``source`` whose config allows ``limit`` positions, its tensors unchanged."""
    shutil.copytree(source, directory)
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config["max_position_embeddings"] = limit
    path.write_text(json.dumps(config))
    return directory


def test_a_short_row_beside_a_long_one_equals_its_step_alone(phi3: Path) -> None:
    ckpt = Checkpoint(phi3)
    trunk = load_trunk(ckpt, SplitPlan(4, 1, 1), torch.float32)
    assert trunk.rope_reads_positions
    torch.manual_seed(0)
    rows, expected, solos = [], [], []
    # (committed prefix, parents of the step): a tree at positions 5..6 beside a decode step at 30 (past 16)
    for past, parents in [(5, [-1, 0, 0]), (30, [-1]), (9, [-1])]:
        solo, batched = KVCache(), KVCache()
        prefix = torch.randn(1, past, 32)
        chain = torch.arange(-1, past - 1, dtype=torch.int32)
        trunk(prefix, torch.arange(past, dtype=torch.int32), chain, solo)
        trunk(prefix, torch.arange(past, dtype=torch.int32), chain, batched)
        parent_t = torch.tensor(parents, dtype=torch.int32)
        positions = (past + depths(parent_t)).to(torch.int32)
        hidden = torch.randn(1, len(parents), 32)
        expected.append(trunk(hidden, positions, parent_t, solo))
        rows.append(BatchRow(hidden, positions, parent_t, batched))
        solos.append(solo)
    outs = forward_batch(trunk, rows)
    for out, want, solo, row in zip(outs, expected, solos, rows, strict=True):
        assert out.shape == want.shape
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(row.cache._keys[1][:, :, : len(solo)], solo._keys[1][:, :, : len(solo)])


def test_the_heads_target_check_keeps_a_longrope_targets_position_limit(
    phi3: Path, make_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    """Longrope's attention factor reads max_position_embeddings: a copy allowed other contexts computes other
    features, and is another target; a default-rope copy computes the same ones, and keeps its heads."""
    longer = _with_position_limit(phi3, tmp_path / "phi3-longer", 128)
    configs = [transformers.Phi3Config.from_pretrained(c) for c in (phi3, longer)]
    scaling = [Phi3RotaryEmbedding(config).attention_scaling for config in configs]
    assert scaling[0] != pytest.approx(scaling[1])  # the features differ indeed
    assert target_fingerprint(Checkpoint(longer)) != target_fingerprint(Checkpoint(phi3))
    llama = make_checkpoint("llama", layers=4)
    longer_llama = _with_position_limit(llama, tmp_path / "llama-longer", 8192)
    assert target_fingerprint(Checkpoint(longer_llama)) == target_fingerprint(Checkpoint(llama))


@pytest.mark.parametrize(
    ("rope", "reads"),
    [
        (None, False),
        ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}, False),
        ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}, False),
        ({"rope_type": "dynamic", "factor": 2.0}, True),
    ],
)  # fmt: skip
def test_which_rotary_types_read_the_position_limit(rope: Any, reads: bool) -> None:
    config = transformers.LlamaConfig(
        hidden_size=32, num_attention_heads=4, max_position_embeddings=64, rope_parameters=rope
    )
    assert rope_reads_position_limit(config) is reads
