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

import bitsandbytes as bnb
import pytest
import torch
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

from splitspec.cloud.config import CloudConfig
from splitspec.cloud.server import TrunkServer
from splitspec.edge import EdgeConfig, SplitClient
from splitspec.exceptions import TrunkMismatch
from tests.families import LAYERS, family_config

PROMPT = [5, 9, 17, 3, 44, 2, 8, 61, 30, 12, 7]
NEW_TOKENS = 10
LINEAR = {"nf4": bnb.nn.Linear4bit, "int8": bnb.nn.Linear8bitLt}


def bnb_config(quantize: str) -> BitsAndBytesConfig:
    """What a transformers user passes for the same quantization."""
    if quantize == "nf4":
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)
    return BitsAndBytesConfig(load_in_8bit=True)


def hf_greedy(model: torch.nn.Module, prompt: list[int], new_tokens: int) -> list[int]:
    with torch.no_grad():
        ids = torch.tensor([prompt])
        out = model.generate(  # type: ignore[operator]
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0
        )
    return list(out[0, len(prompt) :].tolist())


def save_checkpoint(directory: Path, family: str) -> Path:
    """The family's tiny checkpoint (tests/families.py) at hidden size 64, saved in bfloat16.

    bitsandbytes' CPU 4-bit kernels quantize in blocks of 64 inputs and pack 32 outputs at a time:
    narrower layers (the families' hidden size 32, head size 8) fail in transformers' own NF4 model too."""
    config = family_config(family, LAYERS)
    config.hidden_size, config.intermediate_size, config.head_dim = 64, 128, 16
    torch.manual_seed(11)
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval().save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in built:
            built[family] = save_checkpoint(tmp_path_factory.mktemp(family), family)
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
        assert trunk_linears and all(isinstance(m, LINEAR[quantize]) for m in trunk_linears)
        assert str(server.trunk_fingerprint).split(":")[1] == f"{quantize}(bfloat16)"
        async with SplitClient(dataclasses.replace(edge, cloud_url=server.url)) as client:
            assert isinstance(client.model.head.layers[0].mlp.up_proj, LINEAR[quantize])
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
                model_dir=target, cloud_url=server.url, edge_layers=(1, 1), allow_stock_edge_weights=True, quantize=expects
            )
            with pytest.raises(TrunkMismatch, match=f"the quantization differs .*{named.replace('(', '.')}"):
                async with SplitClient(edge) as client:
                    await client.generate(PROMPT, 1, speculate="off")
