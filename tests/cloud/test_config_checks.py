"""The trunk's checks that need no model, made before any model loads, on the plain server and on Ray."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest

from splitspec.cloud import server as server_module
from splitspec.cloud.cli import register
from splitspec.cloud.config import CloudConfig, check_config
from splitspec.cloud.ray_serve import trunk_application
from splitspec.exceptions import ConfigError

BAD = {
    "session limits must be at least 1": {"max_sessions": -10},
    "--session-ttl must be positive": {"session_ttl_s": 0.0},
    "--handshake-timeout must be positive": {"handshake_timeout_s": 0.0},
    "--batch-gather must be between 0 and 10": {"batch_gather": -1.0},
    "--wire-codecs must name one or more of": {"wire_codecs": ("int4",)},
    "TLS needs both a certificate and a key file": {"tls_cert_file": Path("cert.pem")},
}


@pytest.mark.parametrize("needle", list(BAD))
def test_the_ray_application_refuses_what_the_plain_server_refuses(
    needle: str, make_checkpoint: Callable[..., Path]
) -> None:
    """On Ray, --max-sessions -10 used to end in Serve's pydantic ValidationError traceback, and a zero session TTL
    or a missing checkpoint in a failure inside every replica: now each is one ConfigError before Ray starts."""
    config = dataclasses.replace(CloudConfig(model_dir=make_checkpoint("llama")), **BAD[needle])  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=needle):
        check_config(config)
    with pytest.raises(ConfigError, match=needle):
        trunk_application(config, replicas=2)


def test_a_missing_checkpoint_is_refused_before_ray_starts(tmp_path: Path) -> None:
    config = CloudConfig(model_dir=tmp_path / "no" / "model")
    with pytest.raises(ConfigError, match=r"config\.json is missing"):
        trunk_application(config, replicas=1)


def test_a_good_config_passes(make_checkpoint: Callable[..., Path]) -> None:
    check_config(CloudConfig(model_dir=make_checkpoint("llama")))


NAN, INF = float("nan"), float("inf")
# (what the refusal says, the fields that used to pass the checks and fail later, or never)
UNCHECKED: list[tuple[str, dict[str, object]]] = [
    ("--session-ttl must be positive and finite", {"session_ttl_s": INF}),  # 'Infinity' in every Welcome
    ("--session-ttl must be positive and finite", {"session_ttl_s": NAN}),  # no sweep, NaN idle timeout
    ("--handshake-timeout must be positive and finite", {"handshake_timeout_s": NAN}),
    ("--prepack must be one of auto, on, off", {"prepack": "bogus"}),  # refused only in each replica
    ("--compute-on must be one of auto, loop, threads", {"compute_on": "bogus"}),
    ("--dtype must be one of", {"dtype": "float64"}),
    ("--quantize must be one of", {"quantize": "int4"}),
    ("--compile must be one of", {"compile": "fastest", "batching": False}),
    ("compute_workers must be at least 1", {"compute_workers": 0}),  # ThreadPoolExecutor's ValueError
    ("max_query_tokens must be at least 1", {"max_query_tokens": 0}),  # every step refused
    ("max_unauthenticated must be at least 1", {"max_unauthenticated": 0}),  # every connection refused
    ("the TTL sweep interval must be positive and finite", {"sweep_interval_s": -1.0}),
    ("the TTL sweep interval must be positive and finite", {"sweep_interval_s": 0.0}),  # was taken as unset
    ("--evict-idle must be a finite number of seconds >= 0", {"evict_idle_s": NAN}),  # never evicts
    ("--evict-idle must be a finite number of seconds >= 0", {"evict_idle_s": -1.0}),
    (r"\(--kv-budget-mb\) must be positive and finite", {"kv_budget_mb": NAN}),  # int() raised after the load
    (r"\(--kv-budget-mb\) must be positive and finite", {"kv_budget_mb": INF}),
    ("--batch-gather must be between 0 and 10", {"batch_gather": NAN}),
    ("default KV budget's share must be in", {"kv_budget_share": 0.0}),
    ("--threads must be at least 1", {"torch_threads": 0}),
    ("--port must be between 0 and 65535", {"port": 70000}),
    # an option the chosen compute path never reads (it was accepted and ignored)
    (
        "--max-batch-steps, --batch-gather only applies with the batching path",
        {"batching": False, "max_batch_steps": 8, "batch_gather": 1.0},
    ),
    ("--prefill-chunk only applies with the batching path", {"batching": False, "prefill_chunk_tokens": 64}),
    ("--compute-on only applies with the batching path", {"batching": False, "compute_on": "threads"}),
    ("compute_workers only applies with --no-batching", {"compute_workers": 2}),
]


@pytest.mark.parametrize(
    ("needle", "fields"), UNCHECKED, ids=[",".join(f"{k}={v}" for k, v in f.items()) for _, f in UNCHECKED]
)
def test_every_number_is_finite_and_in_range_and_every_choice_allowed(
    needle: str, fields: dict[str, object], make_checkpoint: Callable[..., Path]
) -> None:
    """Each of these used to pass check_config, then broke the server after its model loaded (on Ray: in every
    replica, though trunk_application promises one ConfigError before any starts), or silently (an infinite
    session TTL refused by every edge, a NaN one that disabled the TTL sweep)."""
    config = dataclasses.replace(CloudConfig(model_dir=make_checkpoint("llama")), **fields)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=needle):
        check_config(config)
    with pytest.raises(ConfigError, match=needle):
        trunk_application(config, replicas=2)


def test_the_cli_refuses_a_nan_evict_idle(
    make_checkpoint: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """argparse's float() takes "nan": `cloud serve --evict-idle nan` used to serve with eviction disabled."""

    async def serve_once(server: object, name: str) -> None:  # a server that got this far would have served
        pass

    monkeypatch.setattr(server_module, "run_until_signalled", serve_once)
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["cloud", "serve", "--model", str(make_checkpoint("llama")), "--evict-idle", "nan"])
    with pytest.raises(ConfigError, match="--evict-idle must be a finite number"):
        args.run(args)
