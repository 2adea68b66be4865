"""Split inference on a device (``--device``, default cpu; scripts/gpu_check.sh passes cuda).

Every test here runs the same code on the CPU in CI and on an accelerator when one is lent:
greedy split output equals transformers' ``generate`` of the whole model on the same device, in
float32 and bfloat16, sequential and speculative, for two families; a trunk split over two
devices gives the same tokens; on an accelerator, its float32 tokens equal the CPU's.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from splitspec.cloud.config import CloudConfig
from splitspec.cloud.server import TrunkServer
from splitspec.decoding.sampling import SamplingParams
from splitspec.devices import resolve_device
from splitspec.edge import EdgeConfig, SplitClient
from splitspec.models.precision import dtype_from_name
from tests.conftest import local_greedy

PROMPT = [5, 9, 17, 3, 44, 2, 8, 5, 9, 17, 3, 61, 30, 12, 7, 5, 9]


async def split_generate(
    model: Path,
    device: str,
    dtype: str = "float32",
    speculate: str = "off",
    draft: Path | None = None,
    cloud_devices: tuple[str, ...] = (),
    new_tokens: int = 24,
    params: SamplingParams | None = None,
) -> list[int]:
    cloud = CloudConfig(model_dir=model, port=0, dtype=dtype, device=device, devices=cloud_devices)
    async with TrunkServer(cloud) as server:
        edge = EdgeConfig(
            allow_stock_edge_weights=True,
            model_dir=model,
            cloud_url=server.url,
            dtype=dtype,
            device=device,
            draft_model_dir=draft,
        )
        async with SplitClient(edge) as client:
            assert client.model.device.type == torch.device(device).type
            result = await client.generate(PROMPT, new_tokens, params, speculate=speculate)
    return result.token_ids


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("speculate", ["off", "draft", "mix"])
async def test_greedy_split_on_device_equals_hf_generate(
    make_checkpoint: Callable[..., Path], device: str, family: str, dtype: str, speculate: str
) -> None:
    model = make_checkpoint(family, logit_scale=4.0)  # clear argmax margins: bf16 rounding cannot flip them
    draft = make_checkpoint(family, layers=2, seed=99)
    expected = local_greedy(model, PROMPT, 24, dtype_from_name(dtype), device)
    assert await split_generate(model, device, dtype, speculate, draft) == expected


async def test_trunk_split_over_two_devices_keeps_greedy_identity(
    make_checkpoint: Callable[..., Path], device: str
) -> None:
    """The trunk's 4 layers on two devices (on a CPU machine: cpu,cpu; with an accelerator: it, then cpu)."""
    model = make_checkpoint("llama", layers=8)
    devices = ("cpu", "cpu") if device == "cpu" else (device, "cpu")
    cloud = CloudConfig(model_dir=model, port=0, devices=devices)
    async with TrunkServer(cloud) as server:
        placed = server.trunk.devices
        assert placed == [resolve_device(devices[0])] * 2 + [torch.device("cpu")] * 2
        # every trunk layer's weights sit on its own device
        for layer, where in zip(server.trunk.layers, placed, strict=True):
            assert {p.device for p in layer.parameters()} == {where}
        if placed[0].type == "cuda":  # a stack on CUDA takes cuDNN out of sdpa (a plan per new step shape)
            assert not torch.backends.cuda.cudnn_sdp_enabled()
    draft = make_checkpoint("llama", layers=2, seed=99)
    expected = local_greedy(model, PROMPT, 24, device=device)
    # sequential, and speculative (tree steps and keep_last on caches spread over both devices)
    assert await split_generate(model, device, cloud_devices=devices) == expected
    assert await split_generate(model, device, speculate="mix", draft=draft, cloud_devices=devices) == expected


async def test_sampling_draws_on_the_device(make_checkpoint: Callable[..., Path], device: str) -> None:
    """Sampling draws on the device with a generator there: same seed, same tokens; speculative
    sampling with a draft model (its own generator on the device) runs to the end."""
    model = make_checkpoint("llama")
    draft = make_checkpoint("llama", layers=2, seed=99)
    runs = [await split_generate(model, device, params=SamplingParams(1.0, 0.9, seed)) for seed in (7, 7, 8)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]
    # draft lengths follow measured step times, so speculative runs differ in randomness used:
    # the check here is that every draw happens where its tensors are
    spec = await split_generate(model, device, speculate="draft", draft=draft, params=SamplingParams(1.0, 0.9, 3))
    assert len(spec) == 24
    assert all(0 <= t < 96 for t in spec)


async def test_accelerator_float32_tokens_equal_cpu_tokens(make_checkpoint: Callable[..., Path], device: str) -> None:
    if device == "cpu":
        pytest.skip("compares an accelerator with the CPU: run with --device cuda")
    for family in ("llama", "qwen2"):
        model = make_checkpoint(family, logit_scale=4.0)
        on_device = await split_generate(model, device, new_tokens=32)
        on_cpu = await split_generate(model, "cpu", new_tokens=32)
        assert on_device == on_cpu, family
