"""The edge's linear layers and LM head prepacked for oneDNN (``EdgeConfig.prepack``): where auto
applies, what "on" refuses, and split output identical to the whole model's either way."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from torch import nn

from splitspec.cloud.config import CloudConfig
from splitspec.cloud.server import TrunkServer
from splitspec.decoding.drafters import DraftModel
from splitspec.decoding.sampling import SamplingParams
from splitspec.edge import EdgeConfig, SplitClient
from splitspec.edge.runtime import EdgeRuntime
from splitspec.exceptions import ConfigError
from splitspec.models.prepack import PackedLinear
from tests.conftest import local_greedy
from tests.e2e.test_split_generate import PROMPT


def _linears(runtime: EdgeRuntime) -> tuple[int, int]:
    """(plain nn.Linear, PackedLinear) modules in the edge's layers and LM head."""
    model = runtime.model
    modules = [*model.head.modules(), *model.tail.modules(), model.lm_head]
    return sum(isinstance(m, nn.Linear) for m in modules), sum(isinstance(m, PackedLinear) for m in modules)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
async def test_prepacked_edge_equals_the_whole_model(make_checkpoint: Callable[..., Path], family: str) -> None:
    model = make_checkpoint(family)
    async with TrunkServer(CloudConfig(model_dir=model, port=0, dtype="float32")) as server:
        outputs = {}
        for prepack in ("on", "auto", "off"):
            config = EdgeConfig(
                allow_stock_edge_weights=True, model_dir=model, cloud_url=server.url, dtype="float32", prepack=prepack
            )
            runtime = EdgeRuntime(config)
            plain, packed = _linears(runtime)
            if prepack == "on":
                assert plain == 0
                assert packed == 2 * 2 * 7 + 1  # 2 + 2 layers of q, k, v, o, gate, up, down; the LM head
            elif prepack == "auto":  # the shapes measured faster packed on this CPU: all of a shape, or none
                assert plain + packed == 2 * 2 * 7 + 1
                by_shape: dict[tuple[int, int, bool], set[bool]] = {}
                for m in [*runtime.model.head.modules(), *runtime.model.tail.modules()]:
                    if isinstance(m, nn.Linear | PackedLinear):
                        shape = (m.in_features, m.out_features, m.bias is not None)
                        by_shape.setdefault(shape, set()).add(isinstance(m, PackedLinear))
                assert all(len(kinds) == 1 for kinds in by_shape.values()), by_shape
            else:
                assert packed == 0
            async with SplitClient(config, runtime=runtime) as client:
                outputs[prepack] = (await client.generate(PROMPT, 24, speculate="ngram")).token_ids
    assert outputs["on"] == outputs["auto"] == outputs["off"] == local_greedy(model, PROMPT, 24)


def test_prepack_on_refuses_what_it_cannot_pack(make_checkpoint: Callable[..., Path]) -> None:
    model = make_checkpoint("llama")
    config = EdgeConfig(
        allow_stock_edge_weights=True, model_dir=model, cloud_url="ws://unused", dtype="bfloat16", prepack="on"
    )
    with pytest.raises(ConfigError, match=r"float32 weights, the edge computes in torch\.bfloat16"):
        EdgeRuntime(config)
    with pytest.raises(ConfigError, match="prepack must be one of auto, on, off"):
        EdgeConfig(model_dir=model, cloud_url="ws://unused", prepack="always")


async def test_the_draft_model_is_prepacked_by_the_same_rule(make_checkpoint: Callable[..., Path]) -> None:
    """The draft model the runtime loads gets the edge's prepack choice; its trees and the split's speculative
    output are the same packed or not."""
    model = make_checkpoint("llama")
    draft = make_checkpoint("llama", layers=2, seed=99)
    async with TrunkServer(CloudConfig(model_dir=model, port=0, dtype="float32")) as server:
        outputs, trees = {}, {}
        for prepack in ("on", "off"):
            config = EdgeConfig(
                allow_stock_edge_weights=True,
                model_dir=model,
                cloud_url=server.url,
                dtype="float32",
                prepack=prepack,
                draft_model_dir=draft,
            )
            runtime = EdgeRuntime(config)
            assert runtime.draft_model is not None
            modules = [*runtime.draft_model.layers.modules(), runtime.draft_model.lm_head]
            packed = sum(isinstance(m, PackedLinear) for m in modules)
            assert packed == (2 * 7 + 1 if prepack == "on" else 0)  # 2 layers of 7 linears; the LM head
            assert sum(isinstance(m, nn.Linear) for m in modules) == (0 if prepack == "on" else 2 * 7 + 1)
            proposal = DraftModel(runtime.draft_model, SamplingParams()).propose(PROMPT, 12)
            trees[prepack] = (proposal.tokens, proposal.parents)
            async with SplitClient(config, runtime=runtime) as client:
                outputs[prepack] = (await client.generate(PROMPT, 24, speculate="draft")).token_ids
    assert trees["on"] == trees["off"]
    assert outputs["on"] == outputs["off"] == local_greedy(model, PROMPT, 24)
