"""Speculative decoding over a real split: identical greedy output, fewer round trips, flat step size."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from splitspec.cloud.config import CloudConfig
from splitspec.cloud.server import TrunkServer
from splitspec.edge import EdgeConfig, SplitClient
from tests.conftest import local_greedy

PROMPT = [5, 9, 17, 3, 44, 2, 8, 5, 9, 17, 3, 61, 30, 12, 7, 5, 9]


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
@pytest.mark.parametrize("mode", ["ngram", "prompt-lookup", "draft", "mix", "auto"])
async def test_split_speculation_equals_local_greedy(
    make_checkpoint: Callable[..., Path], family: str, mode: str
) -> None:
    model = make_checkpoint(family)
    draft = make_checkpoint(family, layers=2, seed=99)
    async with TrunkServer(CloudConfig(model_dir=model, port=0)) as server:
        config = EdgeConfig(allow_stock_edge_weights=True, model_dir=model, cloud_url=server.url, draft_model_dir=draft)
        async with SplitClient(config) as client:
            result = await client.generate(PROMPT, 48, speculate=mode)
    assert result.token_ids == local_greedy(model, PROMPT, 48)
    assert len(result.spec_steps) == len(result.decode_steps)


async def test_step_size_does_not_grow_with_context(make_checkpoint: Callable[..., Path]) -> None:
    """The same draft tree costs the same bytes at 100 and at 10,000 tokens of context."""
    model = make_checkpoint("llama", max_positions=10_240)
    gen = torch.Generator().manual_seed(0)
    sizes = []
    async with TrunkServer(CloudConfig(model_dir=model, port=0)) as server:
        for context in (100, 10_000):
            async with SplitClient(
                EdgeConfig(allow_stock_edge_weights=True, model_dir=model, cloud_url=server.url)
            ) as client:
                tokens = torch.randint(3, 96, (context,), generator=gen).tolist()
                for part in range(5):  # same number of steps (so the same step counters) in both runs
                    await client.forward(tokens[part * context // 5 : (part + 1) * context // 5])
                await client.forward([20, 21, 30, 31, 22], [-1, 0, -1, 2, 1])
                client.keep((0, 1))
                await client.forward([40])  # carries the cache command
                assert client.steps[-1].query_tokens == 1
                sizes.append((client.steps[-2].bytes_up, client.steps[-1].bytes_up, client.steps[-1].bytes_down))
    assert sizes[0][:2] == sizes[1][:2]  # the step messages are byte-for-byte the same size
    # replies too, up to the text width of the cloud's timing figure in the JSON header
    assert abs(sizes[0][2] - sizes[1][2]) <= 8
