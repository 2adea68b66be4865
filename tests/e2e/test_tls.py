"""wss://: TLS between edge and cloud, verified against a CA; plaintext and unknown CAs refused."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from splitspec.cloud.config import CloudConfig
from splitspec.cloud.server import TrunkServer
from splitspec.edge import EdgeConfig, SplitClient
from splitspec.exceptions import ConfigError, TransportError
from tests.conftest import local_greedy
from tests.e2e.test_split_generate import PROMPT

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl not installed")


def self_signed(directory: Path, name: str = "cert") -> tuple[Path, Path]:
    """A throwaway certificate for 127.0.0.1 (it is its own CA)."""
    cert, key = directory / f"{name}.pem", directory / f"{name}.key"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    return cert, key


async def test_generation_over_tls_is_identical(make_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    model = make_checkpoint("llama")
    cert, key = self_signed(tmp_path)
    config = CloudConfig(model_dir=model, port=0, tls_cert_file=cert, tls_key_file=key, auth_token="s3cret")
    async with TrunkServer(config) as server:
        assert server.url.startswith("wss://")
        edge = EdgeConfig(
            allow_stock_edge_weights=True, model_dir=model, cloud_url=server.url, tls_ca_file=cert, auth_token="s3cret"
        )
        async with SplitClient(edge) as client:
            result = await client.generate(PROMPT, 12)
        other_ca, _ = self_signed(tmp_path, "other")
        with pytest.raises(
            TransportError, match="certificate verify failed"
        ):  # a certificate we were not told to trust
            async with SplitClient(
                EdgeConfig(allow_stock_edge_weights=True, model_dir=model, cloud_url=server.url, tls_ca_file=other_ca)
            ):
                pass
        with pytest.raises(TransportError, match="use wss:// instead of ws://"):  # plaintext against a TLS server
            async with SplitClient(
                EdgeConfig(
                    allow_stock_edge_weights=True, model_dir=model, cloud_url=server.url.replace("wss://", "ws://")
                )
            ):
                pass
    assert result.token_ids == local_greedy(model, PROMPT, 12)


async def test_wss_against_a_plain_server_says_why(make_checkpoint: Callable[..., Path]) -> None:
    model = make_checkpoint("llama")
    async with TrunkServer(CloudConfig(model_dir=model, port=0)) as server:
        edge = EdgeConfig(
            model_dir=model, cloud_url=server.url.replace("ws://", "wss://"), allow_stock_edge_weights=True
        )
        with pytest.raises(TransportError, match=r"TLS handshake failed .*use ws:// instead of wss://"):
            await SplitClient(edge).connect()


def test_tls_configuration_errors(make_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    model = make_checkpoint("llama")
    cert, _ = self_signed(tmp_path)
    with pytest.raises(ConfigError, match="both"):
        TrunkServer(CloudConfig(model_dir=model, port=0, tls_cert_file=cert))
    with pytest.raises(ConfigError, match="cannot load TLS certificate"):
        TrunkServer(CloudConfig(model_dir=model, port=0, tls_cert_file=cert, tls_key_file=tmp_path / "missing.key"))
