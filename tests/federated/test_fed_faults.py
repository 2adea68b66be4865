"""Faults on loopback with real workers: a round that every worker failed waits for a rejoin (and fails in words
when none comes back in time), a generation after a cancelled one, and a worker that comes back with another model.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from splitspec.decoding.sampling import SamplingParams
from splitspec.exceptions import TransportError
from splitspec.federated.config import CoordinatorConfig
from splitspec.federated.coordinator import Coordinator
from splitspec.federated.link import WorkerLink
from splitspec.federated.lm import LoadedModel, load_model
from splitspec.federated.worker import FedWorker, WorkerConfig
from splitspec.protocol.fed import FedScores

K = 8
PROMPT = [0, 5, 17, 42, 8, 23]
GREEDY = SamplingParams(temperature=0.0)


def worker(loaded: LoadedModel, **overrides: object) -> FedWorker:
    return FedWorker(WorkerConfig(model_dir=Path("."), **{"port": 0, **overrides}), loaded)  # type: ignore[arg-type]


def config(*urls: str, **overrides: object) -> CoordinatorConfig:
    base: dict[str, object] = dict(
        draft_dir=Path("."), worker_urls=urls, top_k=K, gamma=3, round_timeout_s=10.0, rejoin_interval_s=0.0
    )
    base.update(overrides)
    return CoordinatorConfig(**base)  # type: ignore[arg-type]


async def test_a_round_whose_only_worker_failed_waits_for_it_to_rejoin(
    models: dict[str, LoadedModel], monkeypatch: pytest.MonkeyPatch
) -> None:
    """One worker, one transient fault on its third round: the generation ended with "every worker failed this
    round; cannot continue", although a failed worker is dropped for the round and rejoins by re-prefilling. The
    round now waits for the rejoin and is scored again with the same draft: the greedy output is the fault-free
    one, and the round's record shows the drop and the rejoin."""
    real_score = WorkerLink.score
    calls = 0

    async def flaky(
        self: WorkerLink, context: list[int], num_scored: int, temperature: float
    ) -> tuple[FedScores, int, int]:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise TransportError("connection reset (simulated, once)")
        return await real_score(self, context, num_scored, temperature)

    async with worker(models["a"]) as w:
        async with Coordinator(config(w.url), models["draft"]) as coord:
            expected = await coord.generate(PROMPT, 30, GREEDY)
        monkeypatch.setattr(WorkerLink, "score", flaky)
        async with Coordinator(config(w.url), models["draft"]) as coord:
            result = await coord.generate(PROMPT, 30, GREEDY)
    assert len(result.token_ids) == 30
    assert result.token_ids == expected.token_ids
    records = [r.workers[0] for r in result.rounds]
    assert [w.status for w in records[:3]] == ["ok", "ok", "rejoined"]
    assert records[2].error == "TransportError: connection reset (simulated, once)"
    assert all(w.status == "ok" and w.error is None for w in records[3:])
    assert calls == len(result.rounds) + 1  # the failed try, then every round once


async def test_a_round_no_worker_answers_fails_in_words_once_none_rejoined_in_time(
    models: dict[str, LoadedModel],
) -> None:
    """The only worker goes away for good: the round waits rejoin_wait_s() (0.1 + 0.5 s here) for it, then the
    generation fails, saying so."""
    w = worker(models["a"])
    await w.start()
    tokens: list[int] = []
    stopped: list[float] = []

    async def run(coord: Coordinator) -> None:
        async for token in coord.stream(PROMPT, 30, GREEDY, torch.Generator()):
            tokens.append(token)
            if len(coord.rounds) == 1 and not stopped:
                await w.stop()
                stopped.append(time.monotonic())

    async with Coordinator(config(w.url, connect_timeout_s=0.5, rejoin_interval_s=0.1), models["draft"]) as coord:
        with pytest.raises(TransportError, match=r"^every worker failed this round and none rejoined within 0\.6 s"):
            await run(coord)
        waited = time.monotonic() - stopped[0]
    assert tokens
    assert 0.6 <= waited < 5.0


async def test_a_generation_after_a_cancelled_one_goes_on(models: dict[str, LoadedModel]) -> None:
    """A generation cancelled while a worker computes leaves its reply unread: the next generation's first
    exchange reads it, refuses its round number and drops the worker, its only one. That ended the generation
    ("every worker failed this round"); the worker now rejoins within the round."""
    async with worker(models["a"], delay_s=0.3) as w:
        async with Coordinator(config(w.url), models["draft_like_a"]) as coord:
            fresh = await coord.generate(PROMPT, 6, GREEDY)
            link = coord.links[0]
            sent = link.seq
            task = asyncio.create_task(coord.generate(PROMPT, 6, GREEDY))
            while link.seq == sent:  # the request is on its way; the worker answers 0.3 s later
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            again = await coord.generate(PROMPT, 6, GREEDY)
    assert again.token_ids == fresh.token_ids
    first = again.rounds[0].workers[0]
    assert first.status == "rejoined"
    assert first.error is not None
    assert first.error.startswith("BadTensor: reply for round")


async def test_a_worker_that_comes_back_with_another_model_is_refused(
    models: dict[str, LoadedModel], caplog: pytest.LogCaptureFixture
) -> None:
    """Worker B restarts on its port serving another model (same tokenizer): its weight was set for the first
    one, and its rejoin was accepted silently. The rejoin is refused (logged as an error); B stays out."""
    caplog.set_level(logging.INFO, logger="splitspec.federated")
    async with worker(models["a"]) as wa:
        wb = worker(models["b"])
        await wb.start()
        port_b = wb.port
        other: FedWorker | None = None
        async with Coordinator(config(wa.url, wb.url), models["draft"]) as coord:
            async for _ in coord.stream(PROMPT, 30, GREEDY, torch.Generator()):
                if len(coord.rounds) == 2 and other is None:
                    await wb.stop()
                    other = worker(models["a"], port=port_b)  # models["a"] is not models["b"]
                    await other.start()
            rounds = list(coord.rounds)
        assert other is not None
        served = other.rounds_served
        await other.stop()
    assert models["a"].model_fingerprint != models["b"].model_fingerprint
    statuses = [r.workers[1].status for r in rounds]
    assert statuses[:2] == ["ok", "ok"]
    assert all(s in ("dropped", "down") for s in statuses[2:]), statuses
    assert served == 0
    refusals = [r for r in caplog.records if "came back with another model" in r.getMessage()]
    assert refusals
    assert all(r.levelno == logging.ERROR for r in refusals)


async def test_an_end_of_turn_id_from_the_generation_config_ends_the_answer(models: dict[str, LoadedModel]) -> None:
    """An instruct model's end of turn (<|eot_id|>, <|im_end|>) is in generation_config.json's eos_token_id, not the
    tokenizer's eos: the coordinator ran on past it to the length limit."""
    async with worker(models["a"]) as w:
        async with Coordinator(config(w.url), models["draft"]) as coord:
            plain = (await coord.generate(PROMPT, 20, GREEDY)).token_ids
        end = plain[5]  # treated as an end of turn below
        assert end not in plain[:5]
        instruct = dataclasses.replace(models["draft"], generation_stops=frozenset({end}))
        assert end in instruct.stop_ids
        async with Coordinator(config(w.url), instruct) as coord:
            stopped = (await coord.generate(PROMPT, 20, GREEDY)).token_ids
    assert stopped == plain[:6]  # the first end-of-turn token ends it, included as an eos is


def test_a_drafters_stop_ids_include_its_generation_config(
    make_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    model = tmp_path / "instruct"
    shutil.copytree(make_checkpoint("llama", layers=1, logit_scale=6.0), model)
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 7]}))
    loaded = load_model(model)
    assert loaded.stop_ids == {1, 7}
