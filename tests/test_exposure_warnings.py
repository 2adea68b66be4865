"""Start-up warnings when a deployment exposes what it should not: plaintext over a network, or no key.

The edge server holds prompts and answers in plain text, and the edge's hidden states are what the privacy story
protects: an HTTP server beyond loopback without a key, and hidden states (or a shared secret) sent to a remote
trunk over ws://, are said once at start-up, as the trunk server already says it serves anyone without a secret.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import pytest

from splitspec.edge import EdgeConfig
from splitspec.edge.runtime import EdgeRuntime
from splitspec.serve.config import ServeConfig
from splitspec.serve.server import warn_if_exposed


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


@pytest.mark.parametrize(
    ("host", "api_key", "expected"),
    [
        ("127.0.0.1", None, []),
        ("0.0.0.0", None, ["requires NO key", "plain HTTP"]),
        ("0.0.0.0", "sesame", ["plain HTTP"]),
    ],
)
def test_the_edge_server_says_when_it_is_open_to_the_network(
    make_checkpoint: Callable[..., Path],
    caplog: pytest.LogCaptureFixture,
    host: str,
    api_key: str | None,
    expected: list[str],
) -> None:
    edge = EdgeConfig(model_dir=make_checkpoint("llama"), cloud_url="ws://127.0.0.1:9", allow_stock_edge_weights=True)
    with caplog.at_level(logging.WARNING, logger="splitspec.serve.server"):
        warn_if_exposed(ServeConfig(edge=edge, served_model_name="m", host=host, api_key=api_key))
    said = _warnings(caplog)
    assert len(said) == len(expected)
    assert all(needle in line for needle, line in zip(expected, said, strict=True))


@pytest.mark.parametrize(
    ("url", "token", "expected"),
    [
        ("ws://127.0.0.1:8765", None, None),
        ("wss://trunk.example:8765", "sesame", None),
        ("ws://10.1.2.3:8765", None, "the hidden states travel unencrypted to 10.1.2.3"),
        ("ws://10.1.2.3:8765", "sesame", "the shared secret and the hidden states travel unencrypted"),
    ],
)
def test_the_edge_says_when_hidden_states_cross_a_network_in_the_clear(
    make_checkpoint: Callable[..., Path],
    caplog: pytest.LogCaptureFixture,
    url: str,
    token: str | None,
    expected: str | None,
) -> None:
    config = EdgeConfig(
        model_dir=make_checkpoint("llama"), cloud_url=url, auth_token=token, allow_stock_edge_weights=True
    )
    with caplog.at_level(logging.WARNING, logger="splitspec.edge.runtime"):
        EdgeRuntime(config)
    said = [line for line in _warnings(caplog) if "unencrypted" in line]
    assert len(said) == (0 if expected is None else 1)
    if expected is not None:
        assert expected in said[0]
