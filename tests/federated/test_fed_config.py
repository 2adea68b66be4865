"""What the coordinator's and the worker's configurations refuse up front, rather than a worker refusing every
round of the generation (or a timeout never firing)."""

from __future__ import annotations

from pathlib import Path

import pytest

from splitspec.decoding.sampling import SamplingParams
from splitspec.exceptions import ConfigError
from splitspec.federated.config import CoordinatorConfig
from splitspec.federated.coordinator import Coordinator
from splitspec.federated.lm import LoadedModel
from splitspec.federated.worker import FedWorker, WorkerConfig

PROMPT = [0, 5, 17, 42, 8, 23]
NAN = float("nan")
INF = float("inf")


def config(*urls: str, **overrides: object) -> CoordinatorConfig:
    base: dict[str, object] = dict(
        draft_dir=Path("."), worker_urls=urls or ("ws://127.0.0.1:9",), top_k=8, gamma=3, rejoin_interval_s=0.0
    )
    base.update(overrides)
    return CoordinatorConfig(**base)  # type: ignore[arg-type]


async def test_a_temperature_above_the_workers_limit_is_refused_before_any_round(
    models: dict[str, LoadedModel],
) -> None:
    """Workers refuse a FedScore above T = 100; the coordinator sent T = 150 and every worker failed the round."""
    async with FedWorker(WorkerConfig(model_dir=Path("."), port=0), models["a"]) as w:
        async with Coordinator(config(w.url), models["draft"]) as coord:
            with pytest.raises(ConfigError, match="--temperature must be at most 100"):
                await coord.generate(PROMPT, 4, SamplingParams(temperature=150.0, seed=1))
            assert coord.rounds == []
            result = await coord.generate(PROMPT, 4, SamplingParams(temperature=100.0, seed=1))  # the limit itself
    assert len(result.token_ids) == 4


def test_gamma_is_refused_when_its_rounds_score_more_positions_than_a_worker_does() -> None:
    """A worker scores at most 64 positions a request (a round's γ + 1): --gamma 64 failed every full round."""
    assert config(gamma=63).gamma == 63
    for gamma in (64, 200, -1):
        with pytest.raises(ConfigError, match=r"--gamma must be in \[0, 63\]"):
            config(gamma=gamma)


async def test_the_largest_gamma_accepted_is_one_a_worker_scores(models: dict[str, LoadedModel]) -> None:
    async with FedWorker(WorkerConfig(model_dir=Path("."), port=0), models["a"]) as w:
        async with Coordinator(config(w.url, gamma=63), models["draft_like_a"]) as coord:
            result = await coord.generate(PROMPT, 70, SamplingParams(temperature=0.0))
    assert len(result.token_ids) == 70
    assert result.rounds[0].drafted == 63
    assert all(w.status == "ok" for r in result.rounds for w in r.workers)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("round_timeout_s", NAN),  # asyncio.timeout(nan) never fires: a hung worker blocked the run for ever
        ("round_timeout_s", INF),
        ("connect_timeout_s", NAN),
        ("connect_timeout_s", INF),
        ("rejoin_interval_s", NAN),
        ("rejoin_interval_s", INF),
        ("rejoin_interval_s", -5.0),
    ],
)
def test_the_coordinators_times_must_be_finite(field: str, value: float) -> None:
    with pytest.raises(ConfigError, match="finite"):
        config(**{field: value})


@pytest.mark.parametrize(
    ("field", "value"),
    [("weights", (NAN,)), ("weights", (INF,)), ("target_epsilon", NAN), ("quant_budget", NAN), ("quant_budget", INF)],
)
def test_the_coordinators_other_numbers_must_be_finite(field: str, value: object) -> None:
    overrides: dict[str, object] = {field: value}
    if field == "target_epsilon":
        overrides["top_k"] = None
    with pytest.raises(ConfigError):
        config(**overrides)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("handshake_timeout_s", NAN),
        ("handshake_timeout_s", INF),
        ("handshake_timeout_s", 0.0),
        ("idle_timeout_s", NAN),
        ("idle_timeout_s", INF),
        ("idle_timeout_s", -1.0),
        ("delay_s", NAN),
        ("delay_s", INF),
        ("delay_s", -1.0),
    ],
)
def test_the_workers_times_must_be_finite(field: str, value: float) -> None:
    with pytest.raises(ConfigError, match="finite"):
        WorkerConfig(model_dir=Path("."), **{field: value})  # type: ignore[arg-type]


def test_a_quant_budget_with_a_float_codec_is_refused() -> None:
    """--prob-codec float16 sends raw floats: a --quant-budget beside it was accepted and ignored."""
    for codec in ("float16", "float32"):
        assert config(prob_codec=codec).quant_budget > 0  # the default budget is no choice of the user's
        with pytest.raises(ConfigError, match="--quant-budget applies to the quantized codec"):
            config(prob_codec=codec, quant_budget=0.2)
    assert config(prob_codec="quantized", quant_budget=0.2).quant_budget == 0.2
