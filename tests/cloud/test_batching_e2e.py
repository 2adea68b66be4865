"""Continuous batching (#15 item 1): concurrent sessions through the batched trunk each get exactly
their solo output (greedy, float32), on two families, while a prompt longer than a chunk is spread
over batching iterations. Rows of ragged steps (a draft tree among them) are checked against solo
steps tensor by tensor in tests/models/test_batched.py."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from pathlib import Path

import pytest

from splitspec.cloud import server as server_module
from splitspec.cloud.config import CloudConfig
from splitspec.cloud.server import TrunkServer
from splitspec.edge import EdgeConfig, SplitClient
from tests.conftest import local_greedy

KINDS = ("decode", "tree", "prefill")  # the trunk's step kinds (cloud/metrics.step_kind)
_rng = random.Random(15)
# (prompt, new tokens, speculation): a repetitive prompt makes the n-gram drafters send draft trees
SESSIONS = [
    ([5, 9, 17, 3, 44, 2, 8, 5, 9, 17, 3, 61, 30, 12, 7, 5, 9], 16, "ngram"),
    (_rng.choices(range(3, 96), k=90), 10, "off"),  # 90 tokens: > 64, prefilled in chunks of 16
    ([4, 8, 15, 16, 23, 42], 14, "off"),
    ([7, 7, 1, 7, 7, 1, 7, 7, 1, 7, 7], 12, "prompt-lookup"),
]


@pytest.mark.parametrize("family", ["llama", "mistral"])
async def test_concurrent_sessions_each_equal_their_solo_output(
    make_checkpoint: Callable[..., Path], family: str
) -> None:
    model = make_checkpoint(family)
    expected = [local_greedy(model, prompt, n) for prompt, n, _ in SESSIONS]
    async with TrunkServer(CloudConfig(model_dir=model, port=0, prefill_chunk_tokens=16)) as server:
        edge = EdgeConfig(allow_stock_edge_weights=True, model_dir=model, cloud_url=server.url)

        async def run(prompt: list[int], n: int, mode: str) -> list[int]:
            async with SplitClient(edge) as client:
                return (await client.generate(prompt, n, speculate=mode)).token_ids

        outputs = await asyncio.gather(*(run(*s) for s in SESSIONS))
        registry = server.metrics.registry
        batched_steps = registry.get_sample_value("splitspec_trunk_batch_size_sum")
        forwards = registry.get_sample_value("splitspec_trunk_batch_size_count")
        drafts = registry.get_sample_value("splitspec_trunk_steps_total", {"kind": "prefill"})
    assert outputs == expected
    assert batched_steps is not None
    assert forwards is not None
    assert batched_steps > forwards  # some forwards carried several sessions' steps
    assert drafts is not None
    assert drafts > len(SESSIONS)  # speculative verify steps (several tokens) went through the batch too


async def test_big_replies_are_encoded_off_the_event_loop_with_identical_output(
    make_checkpoint: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every reply counts as big here: each is encoded on a thread (asyncio.to_thread), and a chunked prompt's
    outputs, joined on the batch worker, still give transformers' own greedy tokens."""
    model = make_checkpoint("llama")
    encoded_on_threads: list[object] = []
    to_thread = asyncio.to_thread

    async def counting_to_thread(func: Callable[..., object], /, *args: object) -> object:
        if getattr(func, "__func__", None) is server_module._TrunkPeer.encode:  # the peer's own encoder
            encoded_on_threads.append(func)
        return await to_thread(func, *args)

    monkeypatch.setattr(server_module, "BIG_REPLY_BYTES", -1)
    monkeypatch.setattr(asyncio, "to_thread", counting_to_thread)
    prompt, n, _ = SESSIONS[1]  # 90 tokens, in chunks of 16
    async with TrunkServer(CloudConfig(model_dir=model, port=0, prefill_chunk_tokens=16)) as server:
        edge = EdgeConfig(allow_stock_edge_weights=True, model_dir=model, cloud_url=server.url)
        async with SplitClient(edge) as client:
            tokens = (await client.generate(prompt, n)).token_ids
        registry = server.metrics.registry
        steps = sum(registry.get_sample_value("splitspec_trunk_steps_total", {"kind": k}) or 0 for k in KINDS)
    assert tokens == local_greedy(model, prompt, n)
    assert steps >= 2
    assert len(encoded_on_threads) == steps  # every step's reply: the prefill's and each decode step's
