"""Quantized trunk and edge, split over loopback: greedy output equals the same quantized model in transformers.

Tiny random checkpoints of two families, published in bfloat16. With ``--quantize nf4`` or ``int8``
on both sides (bitsandbytes at load, on the CPU), the split's greedy output must equal, token for
token, ``generate`` of the whole model that ``from_pretrained(quantization_config=BitsAndBytesConfig)``
builds: the same quantizer and the same kernels, so any drift (a layer left unquantized, another
compute dtype, a misplaced scale) shows. The trunk's layers are checked to be bitsandbytes' own,
its fingerprint to name the method, and an edge that expects another quantization to be refused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from bitsandbytes.nn.modules import Linear4bit, Linear8bitLt
from transformers import AutoModelForCausalLM

from splitspec.cloud.config import CloudConfig
from splitspec.cloud.server import TrunkServer
from splitspec.edge import EdgeConfig, SplitClient
from splitspec.exceptions import TrunkMismatch
from tests.families import LAYERS
from tests.quantized import bnb_config, hf_greedy, save_plain

PROMPT = [5, 9, 17, 3, 44, 2, 8, 61, 30, 12, 7]
NEW_TOKENS = 10
LINEAR = {"nf4": Linear4bit, "int8": Linear8bitLt}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in built:
            built[family] = save_plain(tmp_path_factory.mktemp(family), family)
        return built[family]

    return get


@pytest.mark.parametrize("quantize", ["nf4", "int8"])
@pytest.mark.parametrize("family", ["llama3", "qwen2"])
async def test_quantized_split_greedy_equals_the_quantized_transformers_model(
    checkpoints: Callable[[str], Path], family: str, quantize: str
) -> None:
    target = checkpoints(family)
    hf = AutoModelForCausalLM.from_pretrained(target, quantization_config=bnb_config(quantize), dtype=torch.bfloat16)
    assert isinstance(hf.model.layers[0].mlp.up_proj, LINEAR[quantize])
    expected = hf_greedy(hf.eval(), PROMPT, NEW_TOKENS)
    assert len(set(expected)) > 2, "degenerate reference output: the test would prove little"
    plain = hf_greedy(AutoModelForCausalLM.from_pretrained(target).eval(), PROMPT, NEW_TOKENS)
    edge = EdgeConfig(
        model_dir=target, cloud_url="", edge_layers=(1, 1), allow_stock_edge_weights=True, quantize=quantize
    )
    cloud = CloudConfig(model_dir=target, edge_layers=(1, 1), port=0, quantize=quantize)
    async with TrunkServer(cloud) as server:
        trunk_linears = [m for layer in server.trunk.layers for m in layer.modules() if isinstance(m, torch.nn.Linear)]
        assert trunk_linears
        assert all(isinstance(m, LINEAR[quantize]) for m in trunk_linears)
        assert str(server.trunk_fingerprint).split(":")[1] == f"{quantize}(bfloat16)"
        async with SplitClient(dataclasses.replace(edge, cloud_url=server.url)) as client:
            head_layer: Any = client.model.head.layers[0]
            assert isinstance(head_layer.mlp.up_proj, LINEAR[quantize])
            assert not isinstance(client.model.lm_head, LINEAR[quantize])  # kept as stored, as transformers does
            off = await client.generate(PROMPT, NEW_TOKENS, speculate="off")
    assert off.token_ids == expected
    if quantize == "nf4":  # 4 bits move a random tiny model's argmax: the comparison is not a vacuous one
        assert plain != expected


async def test_an_edge_expecting_another_quantization_is_refused_naming_the_method(
    checkpoints: Callable[[str], Path],
) -> None:
    target = checkpoints("llama3")
    cloud = CloudConfig(model_dir=target, edge_layers=(1, 1), port=0, quantize="nf4")
    async with TrunkServer(cloud) as server:
        for expects, named in (("int8", "int8; cloud: nf4"), (None, "none; cloud: nf4")):
            edge = EdgeConfig(
                model_dir=target,
                cloud_url=server.url,
                edge_layers=(1, 1),
                allow_stock_edge_weights=True,
                quantize=expects,
            )
            with pytest.raises(TrunkMismatch, match=f"the quantization differs .*{named.replace('(', '.')}"):
                async with SplitClient(edge) as client:
                    await client.generate(PROMPT, 1, speculate="off")


def test_the_fingerprint_of_a_trunk_quantized_at_load_names_the_method_over_the_stored_digest(
    checkpoints: Callable[[str], Path],
) -> None:
    from splitspec.models.checkpoint import Checkpoint
    from splitspec.models.split import SplitPlan
    from splitspec.models.trunk_fingerprint import trunk_fingerprint

    ckpt, plan = Checkpoint(checkpoints("qwen2")), SplitPlan(LAYERS, 1, 1)
    stored = trunk_fingerprint(ckpt, plan)
    for method in ("nf4", "int8"):
        quantized = trunk_fingerprint(ckpt, plan, method)  # the cached stored hash, the method around it
        assert str(quantized) == f"1-{LAYERS - 1}:{method}(bfloat16):{stored.digest}"
        assert quantized.quantization == method
    assert trunk_fingerprint(ckpt, plan) == stored  # the cache holds the stored form, not the last method asked


async def test_a_quantized_float32_trunk_is_not_prepacked(checkpoints: Callable[[str], Path]) -> None:
    """--prepack swaps float32 nn.Linear weights for oneDNN's: never bitsandbytes' quantized ones."""
    from splitspec.exceptions import ConfigError

    target = checkpoints("llama3")
    cloud = CloudConfig(model_dir=target, edge_layers=(1, 1), port=0, quantize="int8", dtype="float32")
    with pytest.raises(ConfigError, match="--prepack on: it applies to float32 weights, the trunk's are quantized"):
        TrunkServer(dataclasses.replace(cloud, prepack="on"))
    async with TrunkServer(cloud) as server:  # prepack auto: a batching float32 CPU trunk, left as loaded
        assert all(isinstance(layer.mlp.up_proj, Linear8bitLt) for layer in server.trunk.layers)  # type: ignore[union-attr]
