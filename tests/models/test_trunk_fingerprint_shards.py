"""The trunk fingerprint of a sharded checkpoint reads, stats and is keyed on the shards holding trunk tensors only.

A provider given only the trunk's shards (no embedding, no LM head) computed a raw FileNotFoundError, and the cached
fingerprint was thrown away whenever an edge-only shard changed.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import transformers

from splitspec.exceptions import CheckpointError
from splitspec.models import trunk_fingerprint as tf
from splitspec.models.checkpoint import INDEX_FILE, Checkpoint
from splitspec.models.split import SplitPlan

PLAN = SplitPlan(4, 1, 1)  # trunk: layers 1 and 2


@pytest.fixture
def fresh_hashes() -> Iterator[None]:
    tf._hash_trunk.cache_clear()
    yield
    tf._hash_trunk.cache_clear()


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A llama whose embedding and LM head (vocab 4096) each fill shards of their own."""
    config = transformers.LlamaConfig(
        vocab_size=4096,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=4,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    directory = tmp_path_factory.mktemp("sharded")
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(directory, max_shard_size="300KB")
    return directory


def shard_roles(directory: Path) -> tuple[set[str], set[str]]:
    """(shards holding trunk tensors, shards holding none)."""
    weight_map: dict[str, str] = json.loads((directory / INDEX_FILE).read_text())["weight_map"]
    trunk = tuple(f"model.layers.{i}." for i in PLAN.trunk_layers)
    needed = {f for name, f in weight_map.items() if name.startswith(trunk)}
    return needed, set(weight_map.values()) - needed


def test_a_trunk_without_the_edge_shards_has_the_same_fingerprint(
    sharded: Path, tmp_path: Path, fresh_hashes: None
) -> None:
    expected = tf.trunk_fingerprint(Checkpoint(sharded), PLAN)
    needed, edge_only = shard_roles(sharded)
    assert edge_only, "every shard holds trunk tensors: the test would prove nothing"
    trunk_only = shutil.copytree(sharded, tmp_path / "trunk-only", ignore=shutil.ignore_patterns(*edge_only))
    (trunk_only / tf.CACHE_FILE).unlink(missing_ok=True)
    tf._hash_trunk.cache_clear()
    assert tf.trunk_fingerprint(Checkpoint(trunk_only), PLAN) == expected
    (trunk_only / sorted(needed)[0]).unlink()  # a shard the trunk needs: a clear error, not a raw OSError
    tf._hash_trunk.cache_clear()
    with pytest.raises(CheckpointError, match="holds trunk tensors"):
        tf.trunk_fingerprint(Checkpoint(trunk_only), PLAN)


def test_an_edge_only_shard_changing_keeps_the_cached_fingerprint(
    sharded: Path, tmp_path: Path, fresh_hashes: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = shutil.copytree(sharded, tmp_path / "model", ignore=shutil.ignore_patterns(tf.CACHE_FILE))
    expected = tf.trunk_fingerprint(Checkpoint(model), PLAN)
    _, edge_only = shard_roles(model)
    for name in edge_only:  # the edge's shards rewritten (their mtimes move): the trunk's bytes are the same
        os.utime(model / name, ns=(1, 1))
    tf._hash_trunk.cache_clear()

    def no_rehash(*args: object) -> None:
        raise AssertionError("rehashed")

    monkeypatch.setattr(tf, "_hash_trunk", no_rehash)
    assert tf.trunk_fingerprint(Checkpoint(model), PLAN) == expected
