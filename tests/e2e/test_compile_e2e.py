"""``--compile`` end to end: a trunk whose decode steps run compiled over static KV buffers, on loopback.

Greedy split output equals transformers' ``generate``, sequentially and speculatively (draft
trees and keep_last run eager on the same static buffers), with every decode step through the
one compiled graph; then with the edge's head and tail compiled as well. The compile backend is
``--compile-backend`` (default ``eager``: dynamo's whole-graph capture, seconds; ``inductor``
compiles for real, as scripts/gpu_check.sh runs it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
from torch._dynamo.utils import counters

from splitspec.cloud.config import CloudConfig
from splitspec.cloud.server import TrunkServer
from splitspec.edge import EdgeConfig, SplitClient
from splitspec.exceptions import ConfigError, PositionOutOfRange
from splitspec.models.static_kv import StaticKVCache
from tests.conftest import local_greedy

PROMPT = [5, 9, 17, 3, 44, 2, 8, 5, 9, 17, 3, 61, 30, 12, 7, 5, 9]


async def test_compiled_trunk_keeps_greedy_identity(
    make_checkpoint: Callable[..., Path], compile_backend: str, device: str
) -> None:
    model = make_checkpoint("llama")
    draft = make_checkpoint("llama", layers=2, seed=99)
    expected = local_greedy(model, PROMPT, 24, device=device)
    before = counters["stats"]["unique_graphs"]
    cloud = CloudConfig(
        model_dir=model,
        port=0,
        device=device,
        batching=False,
        compile="auto",
        compile_backend=compile_backend,
        max_cache_tokens=64,
    )
    async with TrunkServer(cloud) as server:
        fixed = server.trunk.fixed_decode
        assert fixed is not None
        assert fixed.steps == 2
        edge = EdgeConfig(
            allow_stock_edge_weights=True, model_dir=model, cloud_url=server.url, device=device, draft_model_dir=draft
        )
        async with SplitClient(edge) as client:
            result = await client.generate(PROMPT, 24, speculate="off")
            assert result.token_ids == expected
            assert fixed.steps == 2 + 23  # every decode step took the compiled path
            (session,) = server.sessions._sessions.values()
            assert isinstance(session.cache, StaticKVCache)
            assert session.cache.nbytes == server.budget.bytes_at(64)
            speculative = await client.generate(PROMPT, 24, speculate="draft")
            assert speculative.token_ids == expected
            with pytest.raises(PositionOutOfRange, match="static KV capacity of 64 entries"):
                await client.generate(PROMPT, 60, speculate="off")
        # the edge compiled too (--compile on generate/chat/serve): head and tail, each one graph
        edge = dataclasses.replace(edge, compile="auto", compile_backend=compile_backend, max_cache_tokens=64)
        async with SplitClient(edge) as client:
            head, tail = client.model.head.fixed_decode, client.model.tail.fixed_decode
            assert head is not None
            assert tail is not None
            assert (await client.generate(PROMPT, 24, speculate="off")).token_ids == expected
            assert (head.steps, tail.steps) == (2 + 23, 2 + 23)
            assert (await client.generate(PROMPT, 24, speculate="draft")).token_ids == expected
            with pytest.raises(ConfigError, match="exceeds the edge's static KV size of 64"):
                client.check_length(len(PROMPT), 60)
    assert counters["stats"]["unique_graphs"] - before == 3  # trunk, head, tail: reused by every session and step


def test_compile_settings_are_checked(make_checkpoint: Callable[..., Path]) -> None:
    model = make_checkpoint("llama")
    with pytest.raises(ConfigError, match="--compile runs each session's decode step alone"):
        TrunkServer(CloudConfig(model_dir=model, port=0, compile="auto"))
    with pytest.raises(ConfigError, match="--max-cache-tokens sizes the static KV buffers"):
        TrunkServer(CloudConfig(model_dir=model, port=0, batching=False, max_cache_tokens=64))
    with pytest.raises(ConfigError, match="between 1 and the model's 4096 positions"):
        TrunkServer(CloudConfig(model_dir=model, port=0, batching=False, compile="auto", max_cache_tokens=5000))
