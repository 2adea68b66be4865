"""Quantized trunks on a CUDA GPU (scripts/gpu_check.sh runs these with ``--device cuda``).

The CPU runs of the same properties are tests/e2e/test_quantized.py and test_prequantized.py;
here each test is skipped unless ``--device`` names a CUDA device:

* NF4 (bitsandbytes' CUDA kernels): trunk and edge quantized at load, every tensor read straight
  onto the GPU; greedy output equals transformers' own NF4 model on the GPU, token for token;
* compressed-tensors FP8 on a GPU with FP8 matmuls (compute capability >= 8.9): the trunk keeps
  its weights in FP8 (``scaled_mm``), and greedy output equals transformers' model loaded with
  ``use_optimized_inference=True``;
* transformers' fine-grained ``fp8`` checkpoint (quantized and saved by transformers on the GPU):
  dequantized at load, since its matmul kernel would be a download, and equal to transformers'
  own dequantized load.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, CompressedTensorsConfig, FineGrainedFP8Config, PreTrainedModel

from splitspec.cloud.config import CloudConfig
from splitspec.cloud.server import TrunkServer
from splitspec.edge import EdgeConfig, SplitClient
from tests.quantized import bnb_config, save_ct_fp8, save_plain

PROMPT = [5, 9, 17, 3, 44, 2, 8, 61, 30, 12, 7]
NEW_TOKENS = 10


@pytest.fixture
def cuda(device: str) -> str:
    if not device.startswith("cuda"):
        pytest.skip("a CUDA check: run with --device cuda (scripts/gpu_check.sh); the CPU runs are test_quantized.py")
    return device


def greedy_on(model: PreTrainedModel, device: str) -> list[int]:
    with torch.no_grad():
        ids = torch.tensor([PROMPT], device=device)
        out = model.generate(  # type: ignore[operator]
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
        )
    return list(out[0, len(PROMPT) :].tolist())


async def split_greedy(directory: Path, device: str, quantize: str | None = None) -> tuple[list[int], Any]:
    """Greedy split output over a loopback trunk server on ``device``, and the server's trunk."""
    cloud = CloudConfig(model_dir=directory, edge_layers=(1, 1), port=0, device=device, quantize=quantize)
    edge = EdgeConfig(
        model_dir=directory, cloud_url="", edge_layers=(1, 1), device=device, allow_stock_edge_weights=True,
        quantize=quantize,
    )  # fmt: skip
    async with TrunkServer(cloud) as server:
        async with SplitClient(dataclasses.replace(edge, cloud_url=server.url)) as client:
            out = await client.generate(PROMPT, NEW_TOKENS, speculate="off")
        return out.token_ids, server.trunk


async def test_nf4_trunk_and_edge_on_cuda_equal_transformers(cuda: str, tmp_path: Path) -> None:
    from bitsandbytes.nn.modules import Linear4bit

    plain = save_plain(tmp_path / "plain", "llama3")
    hf = AutoModelForCausalLM.from_pretrained(
        plain, quantization_config=bnb_config("nf4"), dtype=torch.bfloat16, device_map={"": cuda}
    )
    expected = greedy_on(hf.eval(), cuda)
    got, trunk = await split_greedy(plain, cuda, "nf4")
    assert got == expected
    layer: Any = trunk.layers[0]
    assert isinstance(layer.mlp.up_proj, Linear4bit)
    assert layer.mlp.up_proj.weight.device.type == "cuda"


async def test_ct_fp8_trunk_kept_in_fp8_on_cuda_equals_transformers(cuda: str, tmp_path: Path) -> None:
    if torch.cuda.get_device_capability(torch.device(cuda)) < (8, 9):
        pytest.skip("FP8 matmuls need compute capability 8.9 or more: dequantized here, as on a CPU")
    directory = save_ct_fp8(save_plain(tmp_path / "plain", "llama3"), tmp_path / "ct-fp8")
    hf = AutoModelForCausalLM.from_pretrained(
        directory, quantization_config=CompressedTensorsConfig(use_optimized_inference=True), device_map={"": cuda}
    )
    expected = greedy_on(hf.eval(), cuda)
    got, trunk = await split_greedy(directory, cuda)
    assert got == expected
    layer: Any = trunk.layers[0]
    assert layer.mlp.up_proj.weight.dtype == torch.float8_e4m3fn
    assert layer.mlp.up_proj.weight.device.type == "cuda"


async def test_fine_grained_fp8_checkpoint_loads_dequantized_on_cuda(cuda: str, tmp_path: Path) -> None:
    plain = save_plain(tmp_path / "plain", "llama3", hidden=256)
    quantized = AutoModelForCausalLM.from_pretrained(
        plain, quantization_config=FineGrainedFP8Config(), dtype=torch.bfloat16, device_map={"": cuda}
    )
    quantized.save_pretrained(tmp_path / "fp8")  # transformers' own fp8 checkpoint format
    hf = AutoModelForCausalLM.from_pretrained(
        tmp_path / "fp8", quantization_config=FineGrainedFP8Config(dequantize=True), device_map={"": cuda}
    )
    expected = greedy_on(hf.eval(), cuda)
    got, trunk = await split_greedy(tmp_path / "fp8", cuda)
    assert got == expected
    layer: Any = trunk.layers[0]
    assert layer.mlp.up_proj.weight.dtype == torch.bfloat16  # dequantized at load
