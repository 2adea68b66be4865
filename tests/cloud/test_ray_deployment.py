"""The trunk's Ray Serve deployment options, read off the application without starting Ray: the GPUs each
replica reserves and the share of the default KV budget each one takes."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from splitspec.cloud import budget, ray_serve
from splitspec.cloud.cli import register
from splitspec.cloud.config import CloudConfig
from splitspec.cloud.ray_serve import build_app, trunk_application
from splitspec.exceptions import ConfigError

pytest.importorskip("ray.serve", reason="Ray is the optional 'cluster' extra: pip install 'splitspec[cluster]'")


def deployment(config: CloudConfig, replicas: int, **options: Any) -> tuple[dict[str, Any], CloudConfig]:
    """The replicas' ray_actor_options and the config each is built with."""
    bound = trunk_application(config, replicas, **options)._bound_deployment
    assert bound.num_replicas == replicas
    (replica_config,) = bound.init_args
    return bound.ray_actor_options, replica_config


@pytest.mark.parametrize(
    ("fields", "gpus"),
    [
        ({"device": "cpu"}, 0),
        ({"device": "cuda"}, 1),
        ({"device": "cuda:0"}, 1),
        ({"devices": ("cuda:0", "cuda:1")}, 2),
        ({"devices": ("cpu", "cuda:0")}, 1),
    ],
)
def test_a_cuda_trunks_replicas_reserve_their_gpus(
    fields: dict[str, Any], gpus: int, make_checkpoint: Callable[..., Path]
) -> None:
    """Replicas reserved no GPU: Ray leaves CUDA_VISIBLE_DEVICES alone for a zero-GPU actor, so every replica of
    a node ran on its cuda:0 (and each budgeted 40 % of that one GPU's free memory for its KV caches)."""
    config = CloudConfig(model_dir=make_checkpoint("llama"), **fields)
    options, _ = deployment(config, 2)
    assert options == {"num_cpus": 1.0, "num_gpus": gpus}


def test_device_auto_reserves_a_gpu_where_this_machine_has_one(
    make_checkpoint: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    config = CloudConfig(model_dir=make_checkpoint("llama"))
    for has_cuda, gpus in ((True, 1), (False, 0)):
        monkeypatch.setattr(torch.cuda, "is_available", lambda has=has_cuda: has)
        assert deployment(config, 2)[0]["num_gpus"] == gpus


def test_an_explicit_gpu_count_is_reserved_and_a_cuda_index_must_be_visible(
    make_checkpoint: Callable[..., Path],
) -> None:
    model = make_checkpoint("llama")
    options, _ = deployment(CloudConfig(model_dir=model, device="cuda"), 4, gpus_per_replica=0.5, cpus_per_replica=2)
    assert options == {"num_cpus": 2, "num_gpus": 0.5}
    with pytest.raises(ConfigError, match="sees only the GPUs Ray reserves for it"):
        trunk_application(CloudConfig(model_dir=model, device="cuda:1"), 2)  # Ray's GPU is the replica's cuda:0
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="--ray-gpus-per-replica must be a finite number"):
            trunk_application(CloudConfig(model_dir=model), 2, gpus_per_replica=bad)
    with pytest.raises(ConfigError, match="--ray-cpus-per-replica must be a finite number"):
        trunk_application(CloudConfig(model_dir=model), 2, cpus_per_replica=float("nan"))


@pytest.mark.parametrize(
    ("fields", "replicas", "gpus", "share"),
    [
        ({"device": "cpu"}, 1, None, 1.0),  # one replica: the whole default
        ({"device": "cpu"}, 4, None, 0.25),  # Ray does not divide a host's memory: all 4 may share one
        ({"device": "cpu", "kv_budget_mb": 512.0}, 4, None, 1.0),  # an explicit budget is each replica's own
        ({"device": "cuda"}, 4, None, 1.0),  # a GPU of its own
        ({"device": "cuda"}, 4, 0.5, 0.5),  # two replicas on each GPU
        ({"device": "cuda"}, 4, 0.0, 0.25),  # no GPU reserved: all may share one
    ],
)
def test_replicas_that_may_share_memory_share_the_default_kv_budget(
    fields: dict[str, Any], replicas: int, gpus: float | None, share: float, make_checkpoint: Callable[..., Path]
) -> None:
    """Each replica's default KV budget was 40 % of the memory free at its start: N replicas on one host or GPU
    budgeted N x 40 % of it."""
    config = CloudConfig(model_dir=make_checkpoint("llama"), **fields)
    _, replica_config = deployment(config, replicas, gpus_per_replica=gpus)
    assert replica_config.kv_budget_share == share


def test_the_default_budget_takes_its_share(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(budget, "available_memory_bytes", lambda device: 1000 * 2**20)
    cpu = torch.device("cpu")
    assert budget.default_budget_bytes([cpu]) == 400 * 2**20
    assert budget.default_budget_bytes([cpu], 0.25) == 100 * 2**20


def test_build_app_takes_gpus_per_replica(make_checkpoint: Callable[..., Path]) -> None:
    args = {"model_dir": str(make_checkpoint("llama")), "device": "cuda", "replicas": 3, "gpus_per_replica": 0.5}
    bound = build_app(args)._bound_deployment
    assert bound.ray_actor_options == {"num_cpus": 1.0, "num_gpus": 0.5}
    assert bound.init_args[0].kv_budget_share == 0.5
    with pytest.raises(ConfigError, match="unknown trunk options"):  # trunk_application's to set
        build_app({**args, "kv_budget_share": 1.0})


def test_the_cli_passes_gpus_per_replica(make_checkpoint: Callable[..., Path], monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(ray_serve, "serve_on_ray", lambda config, replicas, **options: calls.append(options))
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    model = str(make_checkpoint("llama"))
    args = parser.parse_args(["cloud", "serve", "--model", model, "--ray-replicas", "2", "--ray-gpus-per-replica", "1"])
    assert args.run(args) == 0
    assert calls == [{"address": None, "cpus_per_replica": 1.0, "gpus_per_replica": 1.0}]
    args = parser.parse_args(["cloud", "serve", "--model", model, "--ray-gpus-per-replica", "1"])
    with pytest.raises(ConfigError, match="--ray-gpus-per-replica needs --ray-replicas"):
        args.run(args)
