"""The edge engine: many sequences through one runtime, one engine and one trunk server on loopback.

Each claim is checked against the same request run alone (or the local whole model): batching the
edge's head and tail across sequences, multiplexing their steps over shared connections, and
recovering one sequence must change nobody's output.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from splitspec.cloud.config import CloudConfig
from splitspec.cloud.server import TrunkServer
from splitspec.decoding.loop import SpecStep
from splitspec.decoding.sampling import SamplingParams
from splitspec.edge import EdgeConfig, SplitClient
from splitspec.edge.engine import EdgeEngine
from splitspec.edge.runtime import EdgeRuntime
from splitspec.edge.sequence import EdgeSequence
from splitspec.protocol.messages import Message, Step
from splitspec.transport.client import Exchange
from tests.conftest import local_model


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    max_new_tokens: int
    speculate: str
    params: SamplingParams


def _requests() -> list[Request]:
    """16 different requests: prompt lengths 3-1,000, every speculation mode (greedy), and sampled ones."""
    rng = random.Random(7)
    modes = ["off", "ngram", "prompt-lookup", "draft", "mix", "auto"]
    requests = []
    for i in range(16):
        length = 1000 if i == 5 else rng.choice([3, 9, 17, 40, 90])
        pattern = rng.choices(range(3, 96), k=6)
        prompt = (pattern * (length // 6 + 1))[:length] if i % 3 == 0 else rng.choices(range(3, 96), k=length)
        sampled = i % 4 == 3
        params = SamplingParams(temperature=0.8, top_p=0.9, seed=100 + i) if sampled else SamplingParams()
        # a sampled speculative run draws as many numbers as its drafts need, and the adaptive controller
        # sizes drafts from measured times: only its law is the same run to run, not its draws
        mode = "off" if sampled else modes[i % len(modes)]
        requests.append(Request(prompt, rng.choice([8, 16, 24]), mode, params))
    return requests


async def _run(client: SplitClient, request: Request) -> list[int]:
    result = await client.generate(request.prompt, request.max_new_tokens, request.params, speculate=request.speculate)
    return result.token_ids


@pytest.fixture
def models(make_checkpoint: Callable[..., Path]) -> tuple[Path, Path]:
    return make_checkpoint("llama"), make_checkpoint("llama", layers=2, seed=99)


@pytest.mark.parametrize("compute_on", ["loop", "threads"])  # a CPU's default: forwards on the event loop
async def test_sixteen_mixed_sequences_through_one_engine_equal_each_run_alone(
    models: tuple[Path, Path], compute_on: str
) -> None:
    model, draft = models
    requests = _requests()
    cloud = CloudConfig(model_dir=model, port=0, max_sessions_per_connection=4, compute_on=compute_on)
    async with TrunkServer(cloud) as server:
        config = EdgeConfig(
            allow_stock_edge_weights=True,
            model_dir=model,
            cloud_url=server.url,
            draft_model_dir=draft,
            compute_on=compute_on,
        )
        runtime = EdgeRuntime(config)
        alone = []
        for request in requests:  # each alone: an engine of its own, nothing else running
            async with SplitClient(config, runtime=runtime) as client:
                alone.append(await _run(client, request))
        engine = EdgeEngine(runtime)
        clients = [SplitClient(config, engine=engine) for _ in requests]
        try:
            for client in clients:
                await client.connect()
            together = await asyncio.gather(*(_run(c, r) for c, r in zip(clients, requests, strict=True)))
            connections = len(engine.link.connections)
            steps = [step for client in clients for step in client.steps]
        finally:
            for client in clients:
                await client.close()
            await engine.close()
    assert together == alone
    assert engine.threaded == (compute_on == "threads")
    assert engine.draft_executor.threaded == engine.threaded
    assert server.batcher is not None
    assert server.batcher.threaded == engine.threaded
    assert connections == 4  # 16 sessions multiplexed, 4 per connection
    batched = max(engine.head_batches.snapshot()), max(engine.tail_batches.snapshot())
    assert min(batched) >= 4, batched  # rows of several sequences really shared forwards
    # each step's edge time holds its wait for the head's and the tail's batches; some waited
    assert all(0.0 <= step.edge_queue_ms <= step.edge_ms for step in steps)
    assert any(step.edge_queue_ms > 0.0 for step in steps)
    # and the trunk reports each step's wait for its batches, which is part of the network time
    assert all(0.0 <= step.cloud_queue_ms <= step.network_ms for step in steps)
    assert any(step.cloud_queue_ms > 0.0 for step in steps)
    assert any(request.params.temperature > 0 for request in requests)  # sampled requests were among them


async def test_one_evicted_session_replays_alone(models: tuple[Path, Path]) -> None:
    model, _ = models
    rng = random.Random(3)
    prompts = [rng.choices(range(3, 96), k=20) for _ in range(4)]
    async with TrunkServer(CloudConfig(model_dir=model, port=0)) as server:
        config = EdgeConfig(allow_stock_edge_weights=True, model_dir=model, cloud_url=server.url)
        runtime = EdgeRuntime(config)
        alone = []
        for prompt in prompts:
            async with SplitClient(config, runtime=runtime) as client:
                alone.append((await client.generate(prompt, 24, speculate="off")).token_ids)
        engine = EdgeEngine(runtime)
        clients = [SplitClient(config, engine=engine) for _ in prompts]
        victim = clients[1]

        async def evict_midway() -> None:
            while len(victim.steps) < 6:
                await asyncio.sleep(0.001)
            assert victim.session_id is not None
            server.sessions.close(victim.session_id, "evicted by the test")

        try:
            for client in clients:
                await client.connect()
            results = await asyncio.gather(
                *(c.generate(p, 24, speculate="off") for c, p in zip(clients, prompts, strict=True)), evict_midway()
            )
        finally:
            for client in clients:
                await client.close()
            await engine.close()
    generated = [r.token_ids for r in results[:4]]  # type: ignore[union-attr]
    recoveries = [r.recoveries for r in results[:4]]  # type: ignore[union-attr]
    assert generated == alone
    assert recoveries == [0, 1, 0, 0]
    assert [s.kind for s in victim.steps].count("replay") == 1


@pytest.mark.parametrize("speculate", ["off", "prompt-lookup", "ngram"])
async def test_logprobs_equal_the_local_models_log_softmax(models: tuple[Path, Path], speculate: str) -> None:
    model, _ = models
    prompt = [5, 9, 17, 3, 44, 2, 8, 5, 9, 17, 3, 61, 30, 12, 7, 5, 9, 17, 3, 44]
    async with TrunkServer(CloudConfig(model_dir=model, port=0)) as server:
        config = EdgeConfig(allow_stock_edge_weights=True, model_dir=model, cloud_url=server.url)
        async with SplitClient(config) as client:
            trace: list[SpecStep] = []
            emitted = [
                e
                async for e in client.stream_tokens(
                    prompt, 32, SamplingParams(), speculate=speculate, trace=trace, logprobs=5
                )
            ]
    tokens = [e.token for e in emitted]
    with torch.no_grad():
        logits = local_model(model)(torch.tensor([prompt + tokens])).logits[0].float()  # (T, V)
    expected = torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : -1]  # row i scores tokens[i]
    got = torch.tensor([e.logprob for e in emitted])
    torch.testing.assert_close(got, expected[torch.arange(len(tokens)), torch.tensor(tokens)], atol=1e-4, rtol=0)
    for e, row in zip(emitted, expected, strict=True):
        top_ids = [t for t, _ in e.top]
        assert top_ids[0] == e.token  # greedy: the chosen token is the most likely
        torch.testing.assert_close(torch.tensor([lp for _, lp in e.top]), row[top_ids], atol=1e-4, rtol=0)
        assert len(e.top) == 5
    if speculate != "off":
        assert any(step.accepted > 0 for step in trace)  # drafts were accepted: rows came from verification


async def test_a_cancelled_generation_disturbs_nobody(models: tuple[Path, Path]) -> None:
    """A client that goes away mid-step (its task cancelled while the workers may be computing its row)
    leaves the other sequences' outputs unchanged, and its own sequence generates correctly again."""
    model, _ = models
    rng = random.Random(11)
    prompts = [rng.choices(range(3, 96), k=30) for _ in range(4)]
    async with TrunkServer(CloudConfig(model_dir=model, port=0)) as server:
        config = EdgeConfig(allow_stock_edge_weights=True, model_dir=model, cloud_url=server.url)
        runtime = EdgeRuntime(config)
        alone = []
        for prompt in prompts:
            async with SplitClient(config, runtime=runtime) as client:
                alone.append((await client.generate(prompt, 20, speculate="off")).token_ids)
        engine = EdgeEngine(runtime)
        clients = [SplitClient(config, engine=engine) for _ in prompts]
        try:
            for client in clients:
                await client.connect()
            tasks = [
                asyncio.ensure_future(c.generate(p, 20, speculate="off")) for c, p in zip(clients, prompts, strict=True)
            ]
            while len(clients[0].steps) < 5:
                await asyncio.sleep(0.001)
            tasks[0].cancel()
            others = await asyncio.gather(*tasks[1:])
            with pytest.raises(asyncio.CancelledError):
                await tasks[0]
            again = await clients[0].generate(prompts[0], 20, speculate="off")
        finally:
            for client in clients:
                await client.close()
            await engine.close()
    assert [r.token_ids for r in others] == alone[1:]
    assert [r.recoveries for r in others] == [0, 0, 0]
    assert again.token_ids == alone[0]


async def test_a_burst_of_sequences_opens_its_connections_together(models: tuple[Path, Path]) -> None:
    """16 sequences connecting at once share 4 connections opened at the same time, and open their
    sessions concurrently (each answered by its request id)."""
    model, _ = models
    async with TrunkServer(CloudConfig(model_dir=model, port=0)) as server:
        config = EdgeConfig(allow_stock_edge_weights=True, model_dir=model, cloud_url=server.url)
        engine = EdgeEngine(EdgeRuntime(config))
        clients = [SplitClient(config, engine=engine) for _ in range(16)]
        try:
            await asyncio.gather(*(client.connect() for client in clients))
            connections = [len(c.sessions) for c in engine.link.connections]
            sessions = {client.session_id for client in clients}
            results = await asyncio.gather(*(c.generate([5, 9, 17, 3], 4, speculate="off") for c in clients))
        finally:
            for client in clients:
                await client.close()
            await engine.close()
    assert connections == [4, 4, 4, 4]
    assert len(sessions) == 16
    assert len({tuple(r.token_ids) for r in results}) == 1  # the same prompt, the same greedy tokens


async def test_prefills_arriving_together_share_forwards(models: tuple[Path, Path]) -> None:
    """Big steps (prefills) of several sequences are cut into chunks that run in one forward, and each
    sequence gets the logits it gets alone."""
    model, _ = models
    rng = random.Random(5)
    prompts = [rng.choices(range(3, 96), k=200) for _ in range(6)]
    async with TrunkServer(CloudConfig(model_dir=model, port=0)) as server:
        config = EdgeConfig(allow_stock_edge_weights=True, model_dir=model, cloud_url=server.url)
        runtime = EdgeRuntime(config)
        alone = []
        for prompt in prompts:
            async with SplitClient(config, runtime=runtime) as client:
                alone.append(await client.forward(prompt))
        engine = EdgeEngine(runtime)
        # the trunk answers prefills one after another: hold each reply until all have come, so that the
        # tail's steps arrive together, as they do when the trunk batches them (without it, whether two
        # replies queue behind a tail chunk is up to the machine's timing)
        replies_in = asyncio.Barrier(len(prompts))
        send_step = engine._send_step

        async def send_step_then_wait(sequence: EdgeSequence, step: Step) -> tuple[Message, Exchange]:
            reply = await send_step(sequence, step)
            await replies_in.wait()
            return reply

        engine._send_step = send_step_then_wait  # type: ignore[method-assign]
        clients = [SplitClient(config, engine=engine) for _ in prompts]
        try:
            await asyncio.gather(*(client.connect() for client in clients))
            together = await asyncio.gather(*(c.forward(p) for c, p in zip(clients, prompts, strict=True)))
        finally:
            for client in clients:
                await client.close()
            await engine.close()
    for got, want in zip(together, alone, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert max(engine.head_batches.snapshot()) >= 2  # prefill chunks of several sequences in one forward
    assert max(engine.tail_batches.snapshot()) >= 2
