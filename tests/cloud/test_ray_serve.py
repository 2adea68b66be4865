"""The trunk on Ray Serve (#15 item 4): two replicas behind Ray's HTTP proxy, WebSocket included.

Two generations run through the proxy; the replica serving one of them is killed mid-generation
(``ray.kill`` on its actor, named in the ``x-splitspec-replica`` upgrade header). That edge's
connection closes, it reconnects through the proxy, lands on a live replica and replays its
session: both outputs equal transformers' greedy output, and each other. Needs the ``cluster``
extra (``pip install 'splitspec[cluster]'``); skipped without Ray.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from splitspec.cloud.config import CloudConfig
from splitspec.cloud.ray_serve import (
    APP_NAME,
    REPLICA_HEADER,
    build_app,
    default_gpus_per_replica,
    refuse_running_serve,
    trunk_application,
)
from splitspec.demo import free_port
from splitspec.edge import EdgeConfig, SplitClient
from splitspec.exceptions import ConfigError
from tests.conftest import local_greedy

ray = pytest.importorskip("ray", reason="Ray is the optional 'cluster' extra: pip install 'splitspec[cluster]'")
serve = pytest.importorskip("ray.serve")
yaml = pytest.importorskip("yaml")  # a dependency of Ray's

pytestmark = pytest.mark.slow  # a Ray instance and two replica processes, each importing torch

PROMPT = [5, 9, 17, 3, 44, 2, 8, 12]
NEW_TOKENS = 24
KILL_AFTER = 6  # tokens generated before the replica goes
SERVE_CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "ray-serve.yaml"


@pytest.fixture(scope="module")
def proxy(make_checkpoint: Callable[..., Path]) -> Iterator[tuple[Path, str]]:
    """A local Ray instance serving the trunk with 2 replicas; yields (checkpoint, edge URL)."""
    model = make_checkpoint("llama")
    port = free_port()
    t0 = time.perf_counter()
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=100 * 2**20, logging_level=logging.WARNING)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        config = CloudConfig(model_dir=model, torch_threads=1, session_ttl_s=60.0)
        serve.run(trunk_application(config, replicas=2, cpus_per_replica=0.5), name=APP_NAME, route_prefix="/")
        logging.getLogger(__name__).info("2 replicas up in %.1f s", time.perf_counter() - t0)
        yield model, f"ws://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


async def _generate(client: SplitClient, on_token: Callable[[int], Any] | None = None) -> list[int]:
    out: list[int] = []
    async for token in client.stream(PROMPT, NEW_TOKENS, speculate="off"):
        out.append(token)
        if on_token is not None:
            on_token(len(out))
    return out


async def test_a_killed_replica_costs_a_replay_not_the_output(proxy: tuple[Path, str]) -> None:
    model, url = proxy
    expected = local_greedy(model, PROMPT, NEW_TOKENS)
    edge = EdgeConfig(allow_stock_edge_weights=True, model_dir=model, cloud_url=url, reconnect_timeout_s=60.0)
    async with SplitClient(edge) as victim, SplitClient(edge) as bystander:
        killed = victim.server_headers[REPLICA_HEADER]
        other = bystander.server_headers[REPLICA_HEADER]

        def kill(produced: int) -> None:
            if produced == KILL_AFTER:
                ray.kill(ray.get_actor(killed, namespace="serve"), no_restart=True)

        outputs = await asyncio.gather(_generate(victim, kill), _generate(bystander))
        replaced_by = victim.server_headers[REPLICA_HEADER]
    assert list(outputs) == [expected, expected]
    assert victim.recoveries >= 1
    assert replaced_by != killed
    if other != killed:  # the bystander's connection stayed on its replica the whole time
        assert bystander.recoveries == 0


def test_a_cluster_whose_serve_runs_is_refused(proxy: tuple[Path, str]) -> None:
    """Serve keeps the HTTP options it started with: serve_on_ray must not claim another port or TLS."""
    with pytest.raises(ConfigError, match="already runs"):
        refuse_running_serve(serve)


def test_the_serve_config_file_builds_the_trunk_application(
    make_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    """deploy/ray-serve.yaml is a valid Serve config whose builder makes the trunk deployment from its args."""
    from ray.serve.schema import ServeDeploySchema

    document = yaml.safe_load(SERVE_CONFIG.read_text())
    application = ServeDeploySchema.model_validate(document).applications[0]
    assert application.import_path == "splitspec.cloud.ray_serve:build_app"
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    model = make_checkpoint("llama")
    args = {**document["applications"][0]["args"], "model_dir": str(model), "token_file": str(token)}
    deployment = build_app(args)._bound_deployment
    assert deployment.num_replicas == args["replicas"]
    assert deployment.ray_actor_options["num_cpus"] == args["cpus_per_replica"]
    (config,) = deployment.init_args
    assert deployment.ray_actor_options["num_gpus"] == default_gpus_per_replica(config)  # commented out: the default
    assert (config.model_dir, config.edge_layers, config.auth_token) == (model, (2, 2), "s3cret")
    with pytest.raises(ConfigError, match="unknown trunk options"):
        build_app({**args, "prot": 1})
    with pytest.raises(ConfigError, match="model_dir"):
        build_app({"replicas": 2})
