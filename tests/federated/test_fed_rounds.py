"""Rounds on loopback with real workers: reconnection off the round's path, idle-closed connections, K above
the vocabulary, greedy below GREEDY_BELOW, and the run's top-k applied to the target."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from splitspec.decoding.sampling import SamplingParams
from splitspec.federated.config import CoordinatorConfig
from splitspec.federated.coordinator import Coordinator
from splitspec.federated.link import WorkerLink
from splitspec.federated.lm import LoadedModel
from splitspec.federated.worker import FedWorker, WorkerConfig
from splitspec.protocol.fed import FedHello, FedScore, FedScores

K = 8
PROMPT = [0, 5, 17, 42, 8, 23]


def worker(loaded: LoadedModel, **overrides: object) -> FedWorker:
    return FedWorker(WorkerConfig(model_dir=Path("."), **{"port": 0, **overrides}), loaded)  # type: ignore[arg-type]


def config(*urls: str, **overrides: object) -> CoordinatorConfig:
    base: dict[str, object] = dict(
        draft_dir=Path("."), worker_urls=urls, top_k=K, gamma=3, round_timeout_s=10.0, rejoin_interval_s=0.0
    )
    base.update(overrides)
    return CoordinatorConfig(**base)  # type: ignore[arg-type]


async def generate(
    urls: list[str], draft: LoadedModel, params: SamplingParams, n: int = 10, **overrides: object
) -> list[int]:
    async with Coordinator(config(*urls, **overrides), draft) as coord:
        result = await coord.generate(PROMPT, n, params)
    assert all(w.status == "ok" for r in result.rounds for w in r.workers)
    return result.token_ids


async def test_a_worker_host_that_accepts_but_never_answers_costs_no_round(models: dict[str, LoadedModel]) -> None:
    """Worker B goes away and its port then accepts TCP but never answers the WebSocket upgrade. Reconnecting
    it used to be awaited before drafting: every round it was due took connect_timeout_s (2 s here) while the
    healthy worker idled. Now it reconnects in the background and the rounds go on at their own pace."""
    silent_writers: list[asyncio.StreamWriter] = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        silent_writers.append(writer)
        await reader.read()  # reads the upgrade request, answers nothing, until the peer goes

    async with worker(models["a"]) as wa:
        # B serves the same model as A: the aggregate is A's law whichever of them answers, so the output must be
        # the one A alone gives
        expected = await generate([wa.url], models["draft"], SamplingParams(temperature=0.0), n=12)
        wb = worker(models["a"])
        await wb.start()
        port_b = wb.port
        server: asyncio.Server | None = None
        async with Coordinator(config(wa.url, wb.url, connect_timeout_s=2.0), models["draft"]) as coord:
            tokens: list[int] = []
            async for token in coord.stream(PROMPT, 12, SamplingParams(), torch.Generator().manual_seed(0)):
                tokens.append(token)
                if len(coord.rounds) == 1 and server is None:
                    await wb.stop()
                    server = await asyncio.start_server(silent, "127.0.0.1", port_b)
            rounds = list(coord.rounds)
        assert server is not None
        for writer in silent_writers:
            writer.close()
        server.close()
        await server.wait_closed()
    assert tokens == expected
    assert silent_writers  # the coordinator did try to reconnect B
    assert len(rounds) >= 4
    assert rounds[1].workers[1].status == "dropped"
    assert all(r.workers[1].status in ("dropped", "down") for r in rounds[1:])
    assert all(r.workers[0].status == "ok" for r in rounds)
    slowest = max(r.round_ms for r in rounds[1:])
    assert slowest < 1000.0, [round(r.round_ms) for r in rounds]


async def test_connections_the_workers_closed_as_idle_are_reconnected(models: dict[str, LoadedModel]) -> None:
    """A worker closes a connection silent past its idle timeout (pings do not count). A coordinator idle
    that long failed its next round on every worker ("every worker failed this round")."""
    async with worker(models["a"], idle_timeout_s=0.5) as wa, worker(models["b"], idle_timeout_s=0.5) as wb:
        async with Coordinator(config(wa.url, wb.url), models["draft_like_a"]) as coord:
            first = await coord.generate(PROMPT, 8, SamplingParams(temperature=0.0))
            await asyncio.sleep(1.0)  # both workers close their connection meanwhile
            again = await coord.generate(PROMPT, 8, SamplingParams(temperature=0.0))
    assert again.token_ids == first.token_ids  # the first run was a fresh coordinator's
    assert [w.status for w in again.rounds[0].workers] == ["rejoined", "rejoined"]
    assert all(w.status == "ok" for r in again.rounds[1:] for w in r.workers)


async def test_a_fixed_k_above_the_vocabulary_means_every_token(models: dict[str, LoadedModel]) -> None:
    """K = 97 over a 96-token vocabulary was sent as is and refused by every worker (the CLI's default K of
    320 ended the run on any vocabulary under 320); a fixed K is capped at |V|."""
    vocab = models["a"].vocab_size
    assert vocab == 96
    assert config("ws://x", top_k=vocab + 1).k_cap(vocab) == vocab
    greedy = SamplingParams(temperature=0.0)
    async with worker(models["a"]) as wa, worker(models["b"]) as wb:
        capped = await generate([wa.url, wb.url], models["draft"], greedy, top_k=vocab + 1)
        exact = await generate([wa.url, wb.url], models["draft"], greedy, top_k=vocab)
    assert capped == exact


async def test_a_temperature_below_greedy_below_is_greedy_at_the_workers_too(
    models: dict[str, LoadedModel], monkeypatch: pytest.MonkeyPatch
) -> None:
    """SamplingParams(temperature=1e-6) is greedy, but the workers were asked for T = 1e-6: one-hot laws
    whose aggregate is a vote, not the T = 1 aggregate that T = 0 verifies against."""
    asked: list[float] = []
    real_score = FedWorker.score

    def recording(self: FedWorker, lm: object, request: FedScore) -> FedScores:
        asked.append(request.temperature)
        return real_score(self, lm, request)  # type: ignore[arg-type]

    monkeypatch.setattr(FedWorker, "score", recording)
    async with worker(models["a"]) as wa, worker(models["b"]) as wb:
        urls = [wa.url, wb.url]
        zero = await generate(urls, models["draft_like_a"], SamplingParams(temperature=0.0), n=14)
        tiny = await generate(urls, models["draft_like_a"], SamplingParams(temperature=1e-6), n=14)
    assert tiny == zero
    assert set(asked) == {1.0}


async def test_a_worker_asked_for_a_temperature_below_greedy_below_scores_at_one(
    models: dict[str, LoadedModel],
) -> None:
    async with worker(models["a"]) as w:
        link = WorkerLink(w.url, 1.0, config(w.url))
        loaded = models["a"]
        await link.connect(FedHello(loaded.vocab_size, loaded.tokenizer_fingerprint))
        at_zero, _, _ = await link.score(PROMPT, 3, 0.0)
        at_tiny, _, _ = await link.score(PROMPT, 3, 1e-6)
        await link.drop("test over")
    assert at_tiny.stream == at_zero.stream


async def test_the_runs_top_k_applies_to_the_target_law(models: dict[str, LoadedModel]) -> None:
    """top_k = 1 at T = 1: the draft is the draft's argmax and the target must be one-hot on the argmax of p̂,
    so the output is the greedy one. The draft law had the top-k, the target did not: tokens were drawn from
    nucleus(p̂), silently."""
    async with worker(models["a"]) as wa, worker(models["b"]) as wb:
        urls = [wa.url, wb.url]
        greedy = await generate(urls, models["draft"], SamplingParams(temperature=0.0), n=14)
        top1 = await generate(urls, models["draft"], SamplingParams(temperature=1.0, top_k=1, seed=3), n=14)
    assert top1 == greedy
