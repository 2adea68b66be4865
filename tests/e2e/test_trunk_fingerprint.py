"""The right trunk or nothing: the edge checks the cloud's trunk content fingerprint at the handshake.

Real trunk servers on loopback; the edge's expected fingerprint comes from its own copy of the
checkpoint (or a pin). Plus the fingerprint's own properties: independent of sharding, sensitive
to dtype, cached beside the checkpoint, and harmless in a directory it cannot write to.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from splitspec.cloud.config import CloudConfig
from splitspec.cloud.server import TrunkServer
from splitspec.edge import EdgeConfig, SplitClient
from splitspec.exceptions import CheckpointError, ConfigError, TrunkMismatch
from splitspec.models import trunk_fingerprint as tf
from splitspec.models.checkpoint import Checkpoint
from splitspec.models.split import SplitPlan
from splitspec.protocol.trunk_fingerprint import TrunkFingerprint, check_trunk
from tests.conftest import local_model

PROMPT = [5, 9, 17, 3, 44, 2, 8]
PLAN = SplitPlan(6, 2, 2)  # the tiny checkpoints' 6 layers, the default edge layers: trunk = layers 2..3


def fingerprint_of(model: Path) -> TrunkFingerprint:
    return tf.trunk_fingerprint(Checkpoint(model), PLAN)


def edge(model: Path, url: str, **kw: object) -> SplitClient:
    return SplitClient(EdgeConfig(model_dir=model, cloud_url=url, allow_stock_edge_weights=True, **kw))  # type: ignore[arg-type]


@pytest.fixture
def fresh_hashes() -> Iterator[None]:
    """Forget in-memory results so a test sees what the disk cache does."""
    tf._hash_trunk.cache_clear()
    yield
    tf._hash_trunk.cache_clear()


def edge_only_copy(model: Path, tmp_path: Path) -> Path:
    """The checkpoint without its trunk layers' tensors (an edge that never held the trunk)."""
    target = tmp_path / "edge-only"
    shutil.copytree(model, target, ignore=shutil.ignore_patterns("*.safetensors", tf.CACHE_FILE))
    tensors = load_file(model / "model.safetensors")
    trunk = tuple(f"model.layers.{i}." for i in PLAN.trunk_layers)
    save_file({k: v for k, v in tensors.items() if not k.startswith(trunk)}, target / "model.safetensors")
    return target


async def test_a_trunk_with_other_weights_is_refused_and_the_right_one_accepted(
    make_checkpoint: Callable[..., Path],
) -> None:
    ours = make_checkpoint("llama")
    other = make_checkpoint("llama", seed=99)  # same config, other weights: the config hash cannot tell
    async with TrunkServer(CloudConfig(model_dir=other, port=0)) as server:
        client = edge(ours, server.url)
        with pytest.raises(TrunkMismatch) as info:
            await client.connect()
        assert client.session_id is None  # refused before any session was opened
    message = str(info.value)
    assert "but other weights" in message
    assert str(fingerprint_of(ours)) in message
    assert str(fingerprint_of(other)) in message
    assert fingerprint_of(ours) != fingerprint_of(other)

    async with TrunkServer(CloudConfig(model_dir=ours, port=0)) as server:
        assert server.trunk_fingerprint == fingerprint_of(ours)
        async with edge(ours, server.url) as client:
            result = await client.generate(PROMPT, 4)
    assert len(result.token_ids) == 4


async def test_an_edge_without_the_trunk_needs_a_pin(make_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    ours = make_checkpoint("llama")
    stripped = edge_only_copy(ours, tmp_path)
    with pytest.raises(CheckpointError, match="--trunk-fingerprint"):
        edge(stripped, "ws://127.0.0.1:9")
    right = str(fingerprint_of(ours))
    wrong = right[:-6] + "abcdef"
    with pytest.raises(ConfigError, match=r"for layers 1\.\.3"):
        edge(stripped, "ws://127.0.0.1:9", trunk_fingerprint=right.replace("2-4", "1-4", 1))
    async with TrunkServer(CloudConfig(model_dir=ours, port=0)) as server:
        with pytest.raises(TrunkMismatch, match="than the pinned --trunk-fingerprint"):
            await edge(stripped, server.url, trunk_fingerprint=wrong).connect()
        async with edge(stripped, server.url, trunk_fingerprint=right) as client:
            assert len((await client.generate(PROMPT, 2)).token_ids) == 2


def test_fingerprint_ignores_sharding_and_names_the_stored_dtype(
    make_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    single, sharded = make_checkpoint("llama"), make_checkpoint("llama", sharded=True)
    assert len(Checkpoint(sharded).tensor_files) > 1
    assert fingerprint_of(sharded) == fingerprint_of(single)
    assert str(fingerprint_of(single)).startswith("2-4:float32:")
    bf16 = tmp_path / "bf16"
    local_model(single, torch.bfloat16).save_pretrained(bf16)  # the same weights, stored in bfloat16
    with pytest.raises(TrunkMismatch, match=r"the stored dtype differs \(here: float32; cloud: bfloat16\)"):
        check_trunk(fingerprint_of(single), fingerprint_of(bf16), "here")


def test_the_cache_spares_a_rehash_until_a_file_changes(
    make_checkpoint: Callable[..., Path], tmp_path: Path, fresh_hashes: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tmp_path / "model"
    shutil.copytree(make_checkpoint("llama"), model, ignore=shutil.ignore_patterns(tf.CACHE_FILE))
    expected = fingerprint_of(model)
    assert (model / tf.CACHE_FILE).is_file()

    def no_rehash(*args: object) -> TrunkFingerprint:
        raise AssertionError("rehashed")

    monkeypatch.setattr(tf, "_hash_trunk", no_rehash)
    assert fingerprint_of(model) == expected  # a restart reads the cache
    stat = (model / "model.safetensors").stat()
    os.utime(model / "model.safetensors", ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    with pytest.raises(AssertionError, match="rehashed"):
        fingerprint_of(model)  # a touched file is hashed again


def test_an_unwritable_cache_costs_only_a_rehash(
    make_checkpoint: Callable[..., Path], tmp_path: Path, fresh_hashes: None
) -> None:
    model = tmp_path / "model"
    shutil.copytree(make_checkpoint("llama"), model, ignore=shutil.ignore_patterns(tf.CACHE_FILE))
    (model / tf.CACHE_FILE).mkdir()  # neither readable nor replaceable as a file (root ignores chmod)
    before = sorted(p.name for p in model.iterdir())
    assert fingerprint_of(model) == fingerprint_of(make_checkpoint("llama"))
    assert sorted(p.name for p in model.iterdir()) == before  # no stray temporary file
