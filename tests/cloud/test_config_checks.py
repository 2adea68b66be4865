"""The trunk's checks that need no model, made before any model loads, on the plain server and on Ray."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest

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
