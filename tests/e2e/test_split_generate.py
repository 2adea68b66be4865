"""End to end: real trunk servers on loopback, edge clients, output compared with local generation."""

from __future__ import annotations

import asyncio
import dataclasses
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import TemperatureLogitsWarper, TopPLogitsWarper

from splitspec.cloud.config import CloudConfig
from splitspec.cloud.server import TrunkServer
from splitspec.decoding.sampling import SamplingParams
from splitspec.edge import EdgeConfig, SplitClient
from tests.conftest import greedy_reference, law_fit_pvalue, local_greedy, local_model

PROMPT = [5, 9, 17, 3, 44, 2, 8, 61, 30, 12, 7]


def cloud_config(model: Path, **kw: object) -> CloudConfig:
    return CloudConfig(model_dir=model, port=0, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
@pytest.mark.parametrize("split", [(1, 1), (2, 2), (3, 1)])
async def test_greedy_split_equals_local_generate(
    make_checkpoint: Callable[..., Path], family: str, split: tuple[int, int]
) -> None:
    model = make_checkpoint(family, sharded=(family == "llama"))
    expected = greedy_reference(model, tuple(PROMPT), 24)
    async with TrunkServer(cloud_config(model, edge_layers=split)) as server:
        async with SplitClient(
            EdgeConfig(allow_stock_edge_weights=True, model_dir=model, cloud_url=server.url, edge_layers=split)
        ) as client:
            result = await client.generate(PROMPT, 24, speculate="off")
    assert result.token_ids == expected
    assert len(result.steps) == 24  # one prefill step, then one round trip per further token
    assert all(s.query_tokens == 1 for s in result.steps[1:])


async def test_seeded_sampling_is_reproducible(make_checkpoint: Callable[..., Path]) -> None:
    """Sequentially (speculate off): under auto, drafting depends on measured timings; a seed fixes the law only."""
    model = make_checkpoint("llama")
    async with TrunkServer(cloud_config(model)) as server:
        async with SplitClient(
            EdgeConfig(allow_stock_edge_weights=True, model_dir=model, cloud_url=server.url)
        ) as client:
            a, b, c = [
                await client.generate(PROMPT, 16, SamplingParams(temperature=1.0, top_p=0.9, seed=s), speculate="off")
                for s in (7, 7, 8)
            ]
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


async def test_sampling_distribution_matches_local(make_checkpoint: Callable[..., Path]) -> None:
    """Chi-square goodness of fit of split samples against the local model's warped next-token law."""
    model = make_checkpoint("llama", vocab=16, logit_scale=5.0)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    temperature, top_p, n = 0.8, 0.9, 800
    with torch.no_grad():
        logits = local_model(model)(torch.tensor([prompt])).logits[:, -1]
    scores = TopPLogitsWarper(top_p)(None, TemperatureLogitsWarper(temperature)(None, logits))
    expected = scores.softmax(-1)[0]
    support = (expected > 0).nonzero().flatten().tolist()
    assert 3 <= len(support) < 16, "the test model must give a law that top-p actually trims"
    counts: Counter[int] = Counter()
    async with TrunkServer(cloud_config(model)) as server:
        async with SplitClient(
            EdgeConfig(allow_stock_edge_weights=True, model_dir=model, cloud_url=server.url)
        ) as client:
            for seed in range(n):
                params = SamplingParams(temperature=temperature, top_p=top_p, seed=seed)
                result = await client.generate(prompt, 1, params, stop_token_ids=())
                counts[result.token_ids[0]] += 1
    assert set(counts) <= set(support), "sampled a token that top-p removed"
    assert law_fit_pvalue(counts, expected, n) > 1e-3


async def test_prompt_larger_than_message_cap_is_chunked(make_checkpoint: Callable[..., Path]) -> None:
    model = make_checkpoint("llama")
    cap = 32 * 1024
    prompt = [int(x) for x in torch.randint(3, 96, (400,), generator=torch.Generator().manual_seed(0))]
    assert cap < 400 * 64 * 4  # the prompt's hidden states alone exceed one message
    expected = local_greedy(model, prompt, 12)
    async with TrunkServer(cloud_config(model, max_message_bytes=cap)) as server:
        async with SplitClient(
            EdgeConfig(allow_stock_edge_weights=True, model_dir=model, cloud_url=server.url)
        ) as client:
            result = await client.generate(prompt, 12)
    assert result.token_ids == expected
    prefill = [s for s in result.steps if s.kind == "prefill"]
    assert len(prefill) >= 4
    assert sum(s.query_tokens for s in prefill) == 400
    assert max(s.bytes_up for s in result.steps) <= cap


async def _generate_with_interruption(
    client: SplitClient, prompt: list[int], n: int, at: int, interrupt: Callable[[], object]
) -> list[int]:
    tokens: list[int] = []
    async for token in client.stream(prompt, n, speculate="off"):
        tokens.append(token)
        if len(tokens) == at:
            result = interrupt()
            if asyncio.iscoroutine(result):
                await result
    return tokens


async def test_ttl_expiry_mid_generation_recovers_identically(make_checkpoint: Callable[..., Path]) -> None:
    model = make_checkpoint("qwen2")
    expected = local_greedy(model, PROMPT, 20)
    async with TrunkServer(cloud_config(model, session_ttl_s=0.3, sweep_interval_s=0.05)) as server:
        async with SplitClient(
            EdgeConfig(allow_stock_edge_weights=True, model_dir=model, cloud_url=server.url)
        ) as client:
            first_session = client.session_id
            tokens = await _generate_with_interruption(client, PROMPT, 20, 7, lambda: asyncio.sleep(0.8))
            assert client.recoveries == 1
            assert client.session_id != first_session  # the expired session was really gone
            assert any(s.kind == "replay" for s in client.steps)
    assert tokens == expected


async def test_cloud_restart_mid_generation_recovers_identically(make_checkpoint: Callable[..., Path]) -> None:
    model = make_checkpoint("mistral")
    expected = local_greedy(model, PROMPT, 20)
    server = TrunkServer(cloud_config(model))
    await server.start()
    port = server.port
    servers = [server]

    async def restart() -> None:
        await servers[-1].stop()
        fresh = TrunkServer(dataclasses.replace(server.config, port=port))
        await fresh.start()
        servers.append(fresh)

    try:
        async with SplitClient(
            EdgeConfig(allow_stock_edge_weights=True, model_dir=model, cloud_url=server.url)
        ) as client:
            tokens = await _generate_with_interruption(client, PROMPT, 20, 9, restart)
            assert client.recoveries == 1
    finally:
        await servers[-1].stop()
    assert len(servers) == 2
    assert tokens == expected


async def test_tree_step_and_cache_command_ride_on_the_next_step(make_checkpoint: Callable[..., Path]) -> None:
    """A draft tree verified in one trip; keeping one branch costs no extra round trip."""
    model = make_checkpoint("llama")
    local = local_model(model)
    prefix, tree, parents = [5, 9, 17, 3], [20, 21, 30, 31, 22], [-1, 0, -1, 2, 1]

    def local_logits(tokens: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits: torch.Tensor = local(torch.tensor([tokens])).logits[0]  # (T, V)
            return logits

    async with TrunkServer(cloud_config(model)) as server:
        async with SplitClient(
            EdgeConfig(allow_stock_edge_weights=True, model_dir=model, cloud_url=server.url)
        ) as client:
            client.reset()
            await client.forward(prefix)
            logits = await client.forward(tree, parents)
            steps_before = len(client.steps)
            client.keep((2, 3))  # accept branch 30 -> 31
            after = await client.forward([40])
            assert len(client.steps) == steps_before + 1
            assert client.steps[-1].query_tokens == 1
    branch_a = local_logits([*prefix, 20, 21, 22])[len(prefix) - 1 :]
    branch_b = local_logits([*prefix, 30, 31, 40])
    torch.testing.assert_close(logits[[0, 1, 4]], branch_a[1:], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits[[2, 3]], branch_b[len(prefix) : len(prefix) + 2], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(after[0], branch_b[-1], rtol=1e-4, atol=1e-4)
