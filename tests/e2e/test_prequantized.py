"""Checkpoints published quantized load as published, split over loopback, and match transformers on them.

Each checkpoint is made by the quantization library's own save path (tests/quantized.py):
bitsandbytes 4-bit and 8-bit through transformers' ``save_pretrained`` of a quantized model,
compressed-tensors FP8 through compressed-tensors' compressor, transformers' fine-grained fp8
through its own ``Fp8Quantize`` operation (transformers quantizes to fp8 only on a GPU). A trunk
server and an edge load it without ``--quantize``; greedy output must equal ``generate`` of transformers'
``from_pretrained`` of the same directory, token for token. The trunk fingerprint hashes the
stored (quantized) tensors and names the method; ``--quantize`` on such a checkpoint and a GPTQ
or AWQ config are refused in one line.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from bitsandbytes.nn.modules import Linear4bit, Linear8bitLt
from transformers import AutoModelForCausalLM, CompressedTensorsConfig

from splitspec.cloud.config import CloudConfig
from splitspec.cloud.server import TrunkServer
from splitspec.edge import EdgeConfig, SplitClient
from splitspec.exceptions import CheckpointError, ConfigError
from splitspec.models.checkpoint import Checkpoint
from splitspec.models.loading import load_trunk
from splitspec.models.split import SplitPlan
from splitspec.models.trunk_fingerprint import trunk_fingerprint
from tests.quantized import hf_greedy, save_bnb, save_ct_fp8, save_fp8, save_plain

PROMPT = [5, 9, 17, 3, 44, 2, 8, 61, 30, 12, 7]
NEW_TOKENS = 10
PLAN = SplitPlan(4, 1, 1)


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_plain(tmp_path_factory.mktemp("plain"), "llama3")


@pytest.fixture(scope="module")
def published(plain: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    built: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in built:
            target = tmp_path_factory.mktemp(kind)
            save = {"ct_fp8": save_ct_fp8, "fp8": save_fp8}.get(kind)
            built[kind] = save(plain, target) if save is not None else save_bnb(plain, target, kind)
        return built[kind]

    return get


def transformers_model(directory: Path, kind: str) -> torch.nn.Module:
    """transformers' own load of the published checkpoint, as a user of it writes it."""
    if kind == "ct_fp8":  # on a CPU: dequantized at load, as splitspec does there
        return AutoModelForCausalLM.from_pretrained(
            directory, quantization_config=CompressedTensorsConfig(dequantize=True)
        )
    return AutoModelForCausalLM.from_pretrained(directory)


STORED = {  # what the trunk fingerprint's dtype field says: the method around the stored dtypes
    "nf4": "bnb_nf4(bfloat16+float32+uint8)",
    "int8": "bnb_int8(bfloat16+float32+int8+uint8)",
    "ct_fp8": "ct_fp8(bfloat16+float8_e4m3fn)",
    "fp8": "fp8(bfloat16+float32+float8_e4m3fn)",
}


@pytest.mark.parametrize("kind", ["nf4", "int8", "ct_fp8", "fp8"])
async def test_a_published_quantized_checkpoint_splits_and_matches_transformers(
    published: Callable[[str], Path], plain: Path, kind: str
) -> None:
    directory = published(kind)
    assert "quantization_config" in json.loads((directory / "config.json").read_text())
    expected = hf_greedy(transformers_model(directory, kind).eval(), PROMPT, NEW_TOKENS)  # type: ignore[arg-type]
    assert len(set(expected)) > 2, "degenerate reference output: the test would prove little"
    # bfloat16 pinned, as published: under auto a CPU without native bfloat16 computes dequantized FP8 in float32
    edge = EdgeConfig(model_dir=directory, cloud_url="", edge_layers=(1, 1), allow_stock_edge_weights=True,
                      dtype="bfloat16")  # fmt: skip
    async with TrunkServer(CloudConfig(model_dir=directory, edge_layers=(1, 1), port=0, dtype="bfloat16")) as server:
        layer: Any = server.trunk.layers[0]
        if kind == "nf4":
            assert isinstance(layer.mlp.up_proj, Linear4bit)
        elif kind == "int8":
            assert isinstance(layer.mlp.up_proj, Linear8bitLt)
        else:  # dequantized on a CPU: FP8 weights times their per-channel (ct_fp8) or per-block (fp8) scales
            assert type(layer.mlp.up_proj) is torch.nn.Linear
            assert layer.mlp.up_proj.weight.dtype == torch.bfloat16
        assert server.trunk_fingerprint.dtype == STORED[kind]
        async with SplitClient(dataclasses.replace(edge, cloud_url=server.url)) as client:
            assert type(client.model.lm_head) is torch.nn.Linear  # left unquantized, as published
            assert client.model.lm_head.weight.dtype == torch.bfloat16
            off = await client.generate(PROMPT, NEW_TOKENS, speculate="off")
    assert off.token_ids == expected
    assert trunk_fingerprint(Checkpoint(directory), PLAN).digest != trunk_fingerprint(Checkpoint(plain), PLAN).digest


async def test_quantize_on_a_published_quantized_checkpoint_is_refused(published: Callable[[str], Path]) -> None:
    with pytest.raises(ConfigError, match=r"--quantize int8: the checkpoint is already quantized \(bnb_nf4\)"):
        load_trunk(Checkpoint(published("nf4")), PLAN, quantize="int8")


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_gptq_and_awq_get_a_one_line_refusal_naming_what_is_supported(plain: Path, tmp_path: Path, method: str) -> None:
    directory = tmp_path / method
    shutil.copytree(plain, directory)
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": method, "bits": 4, "group_size": 128}
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError) as refused:
        load_trunk(Checkpoint(directory), PLAN)
    message = str(refused.value)
    assert "\n" not in message
    assert f"checkpoints quantized with {method} are not supported" in message
    assert "bitsandbytes 4-bit or 8-bit, compressed-tensors FP8" in message
    assert "--quantize nf4|int8" in message
    with pytest.raises(CheckpointError, match=f"quantized with {method}"):
        trunk_fingerprint(Checkpoint(directory), PLAN)
