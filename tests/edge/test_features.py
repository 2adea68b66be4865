"""Per-token features: what a split edge keeps for a draft head equals what the whole model computes.

The edge builds each committed token's features from its head's output, the trunk's reply and its
tail's output; through a real trunk server on loopback, with a draft tree whose accepted path is
kept, they must be the local whole model's hidden states at those layers (float32).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from splitspec.cloud.config import CloudConfig
from splitspec.cloud.server import TrunkServer
from splitspec.decoding.local import LocalSequence
from splitspec.edge import EdgeConfig, SplitClient
from splitspec.exceptions import ConfigError
from splitspec.models.checkpoint import Checkpoint
from splitspec.models.features import FeatureLog, edge_feature_sources, full_model_step, trunk_feature_layer
from splitspec.models.loading import load_full

LAYERS = 6  # the tiny model's decoder layers; the edge keeps 2 + 2 (head ends at 2, trunk at 4)


def _whole_model_features(model_dir: Path, tokens: list[int], layers: tuple[int, ...]) -> torch.Tensor:
    model = load_full(Checkpoint(model_dir), torch.float32)
    ids = torch.tensor(tokens)
    positions = torch.arange(len(tokens), dtype=torch.int32)
    parents = torch.arange(-1, len(tokens) - 1, dtype=torch.int32)
    _, features = full_model_step(model, ids, positions, parents, None, layers)
    return features


def test_feature_log_mirrors_token_edits() -> None:
    log = FeatureLog([3])
    rows = torch.arange(10, dtype=torch.float32)[:, None].repeat(1, 4)  # row i holds i
    log.append(rows[:3])
    log.append(rows[3:8])  # a step of 5 (a tree), of which nodes 0, 2, 3 are kept
    log.keep(3, [0, 2, 3])
    assert log.rows()[:, 0].tolist() == [0, 1, 2, 3, 5, 6]
    log.truncate(4)
    log.append(rows[8:10].repeat(40, 1)[:70])  # grows past its first buffer
    assert len(log) == 74
    assert log.rows(0, 4)[:, 0].tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="do not match"):
        log.append(torch.zeros(1, 5))
    with pytest.raises(IndexError):
        log.rows(0, 75)
    with pytest.raises(ValueError, match=">= 1"):
        FeatureLog([0])


def test_edge_feature_sources_name_what_the_edge_holds() -> None:
    assert edge_feature_sources([2, 4, 6], 6, 2, 2) == ("head", "trunk", "tail")
    assert edge_feature_sources([3, 6], 6, 2, 2) == ("middle", "tail")  # inside the trunk: asked of it per step
    assert trunk_feature_layer([3, 6], 6, 2, 2) == 3
    assert trunk_feature_layer([2, 6], 6, 2, 2) is None
    with pytest.raises(ConfigError, match="inside this edge's own layers"):
        edge_feature_sources([1], 6, 2, 2)
    with pytest.raises(ConfigError, match="several trunk layers"):
        edge_feature_sources([3, 5], 8, 2, 2)


@pytest.mark.parametrize(
    ("family", "layers", "batching"),
    [
        ("llama", (2, 4, 6), True),
        ("qwen2", (2, 4, 6), True),
        ("llama", (3,), True),  # a state inside the trunk, returned beside its output (EAGLE-3's middle layer)
        ("qwen2", (6, 3), False),  # ... by a trunk computing each step alone
    ],
)
async def test_split_features_equal_the_whole_models(
    make_checkpoint: Callable[..., Path], family: str, layers: tuple[int, ...], batching: bool
) -> None:
    model = make_checkpoint(family, layers=LAYERS)
    prompt = [5, 9, 14, 3, 77, 21, 8, 40, 12]
    async with TrunkServer(CloudConfig(model_dir=model, port=0, batching=batching)) as server:
        config = EdgeConfig(allow_stock_edge_weights=True, model_dir=model, cloud_url=server.url, edge_layers=(2, 2))
        async with SplitClient(config) as client:
            log = client.sequence.keep_features(layers)
            assert log is not None
            await client.forward(prompt, logits_from=len(prompt) - 1)  # a prefill keeps every row's features
            # a tree step: pending token 30, then two branches [31, 32] and [33]; keep 30 and the branch [33]
            await client.forward([30, 31, 32, 33], [-1, 0, 1, 0])
            client.keep([0, 3])
            await client.forward([34])
            committed = list(client.sequence.tokens)
            split = log.rows()
            sequence = client.sequence  # a kept conversation's memory counts the features too (prefix cache bound)
            assert sequence.edge_cache_bytes == sequence.head_cache.nbytes + sequence.tail_cache.nbytes + log.nbytes
            assert log.nbytes >= split.numel() * split.element_size() > 0
            fed = [s.feature_bytes_down for s in client.steps]
    assert committed == [*prompt, 30, 33, 34]
    expected = _whole_model_features(model, committed, layers)
    assert split.shape == expected.shape == (len(committed), len(layers) * 64)
    asked = 4 if 3 in layers else 0  # bytes per value of a float32 state inside the trunk, when asked
    assert fed == [asked * 64 * q for q in (len(prompt), 4, 1)]  # counted per step
    torch.testing.assert_close(split, expected, rtol=1e-4, atol=1e-4)


async def test_a_prefill_cut_into_chunks_returns_the_whole_trunk_state(make_checkpoint: Callable[..., Path]) -> None:
    """A batching trunk runs a long prefill in chunks of 32; the returned state inside the trunk is joined as its
    output is."""
    model = make_checkpoint("llama", layers=LAYERS)
    prompt = random.Random(0).choices(range(3, 90), k=100)
    async with TrunkServer(CloudConfig(model_dir=model, port=0, prefill_chunk_tokens=32)) as server:
        config = EdgeConfig(allow_stock_edge_weights=True, model_dir=model, cloud_url=server.url, edge_layers=(2, 2))
        async with SplitClient(config) as client:
            log = client.sequence.keep_features((3,))
            assert log is not None
            await client.forward(prompt, logits_from=len(prompt) - 1)
            split = log.rows()
        forwards = server.metrics.registry.get_sample_value("splitspec_trunk_batch_size_count")
    assert forwards is not None
    assert forwards >= 4  # 100 tokens in chunks of 32
    torch.testing.assert_close(split, _whole_model_features(model, prompt, (3,)), rtol=1e-4, atol=1e-4)


def test_local_sequence_keeps_the_same_features(make_checkpoint: Callable[..., Path]) -> None:
    model_dir = make_checkpoint("llama", layers=LAYERS)
    local = LocalSequence(load_full(Checkpoint(model_dir), torch.float32))
    log = local.keep_features((6,))
    assert log is not None
    local.run([5, 9, 14])
    local.run([30, 31, 33], [-1, 0, 0])
    local.keep([0, 2])
    assert local.keep_features((6,)) is log  # asking again keeps the log
    assert local.keep_features((4,)) is None  # a sequence holding tokens cannot start a new log
    local.keep_features((6,))  # no log now: the sequence has tokens without features
    assert local.features is None
    torch.testing.assert_close(
        log.rows(), _whole_model_features(model_dir, [5, 9, 14, 30, 33], (6,)), rtol=1e-4, atol=1e-4
    )
