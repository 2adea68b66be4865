"""The send-noise defence at serving time: on a real trunk server, noise on means noisy, and replayable."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from splitspec.cloud.config import CloudConfig
from splitspec.cloud.server import TrunkServer
from splitspec.edge import EdgeConfig, SplitClient
from splitspec.edge.provenance import send_noise
from splitspec.exceptions import ConfigError
from splitspec.models.split import SplitPlan
from splitspec.privacy.record import EDGE_RECORD
from splitspec.privacy.weights import edge_fingerprint

PROMPT = [5, 9, 17, 3, 44, 2, 8, 61, 30, 12, 7]


def with_noise(src: Path, dst: Path, scale: float, key: str = "ab" * 32) -> Path:
    """A copy of ``src`` whose divergence record (published weights, so stock) asks for send noise."""
    shutil.copytree(src, dst)
    fp = edge_fingerprint(dst, SplitPlan(6, 2, 2))
    record = {"head": 2, "tail": 2, "fingerprint_sha256": fp, "published_fingerprint_sha256": fp}
    (dst / EDGE_RECORD).write_text(json.dumps(record | {"send_noise_scale": scale, "send_noise_key": key}))
    return dst


async def test_send_noise_is_applied_and_repeats_for_a_replayed_prefix(
    make_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    model = make_checkpoint("llama")
    noisy_dir = with_noise(model, tmp_path / "noisy", 1.0)
    quiet_dir = with_noise(model, tmp_path / "quiet", 0.0)
    logits: dict[str, list[torch.Tensor]] = {}
    async with TrunkServer(CloudConfig(model_dir=model, port=0)) as server:
        for name, directory in (("noisy", noisy_dir), ("quiet", quiet_dir)):
            config = EdgeConfig(allow_stock_edge_weights=True, model_dir=directory, cloud_url=server.url)
            async with SplitClient(config) as client:
                first = await client.forward(PROMPT)
                client.reset()
                again = await client.forward(PROMPT)
                logits[name] = [first, again]
    torch.testing.assert_close(logits["noisy"][0], logits["noisy"][1])  # same prefix, same noise
    torch.testing.assert_close(logits["quiet"][0], logits["quiet"][1])
    assert not torch.allclose(logits["noisy"][0], logits["quiet"][0], atol=1e-3)  # the noise reached the trunk


def test_send_noise_record_is_validated(make_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    model = make_checkpoint("llama")
    assert send_noise(model).scale == 0.0  # no record: no noise
    assert send_noise(with_noise(model, tmp_path / "ok", 0.5)).scale == 0.5
    with pytest.raises(ConfigError, match="send_noise_key"):
        send_noise(with_noise(model, tmp_path / "short", 0.5, key="ab"))
    with pytest.raises(ConfigError, match="send_noise_scale"):
        send_noise(with_noise(model, tmp_path / "neg", -1.0))
    with pytest.raises(ConfigError, match="not a valid divergence record"):
        send_noise(with_noise(model, tmp_path / "hex", 0.5, key="zz"))
