"""``--dtype auto`` over a real split: the shipped float16 model computes in float32 on this CPU, where
speculative and one-token greedy output agree; an auto edge follows the trunk's dtype, a pinned one
that differs is refused at the handshake."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from splitspec.cloud.config import CloudConfig
from splitspec.cloud.server import TrunkServer
from splitspec.demo import SHOWCASE, embedded_model
from splitspec.edge import EdgeConfig, SplitClient
from splitspec.exceptions import HandshakeMismatch
from splitspec.models import precision
from splitspec.models.checkpoint import load_tokenizer

PROMPT = [5, 9, 17, 3, 44, 2, 8, 5, 9, 17, 3, 61, 30, 12, 7, 5, 9]
SPECULATIVE = ("ngram", "draft", "auto")


@pytest.mark.skipif(
    bool(precision.native_cpu_flags(torch.float16, precision.cpu_capabilities())),
    reason="this CPU computes float16 natively: auto keeps it",
)
async def test_the_shipped_float16_model_runs_in_float32_and_speculation_is_exact(
    caplog: pytest.LogCaptureFixture,
) -> None:
    base, draft = embedded_model("base"), embedded_model("draft")
    tokenizer = load_tokenizer(base)
    precision._log_choice.cache_clear()
    outputs: dict[str, dict[str, list[int]]] = {}
    with caplog.at_level(logging.INFO, logger="splitspec"):
        async with TrunkServer(CloudConfig(model_dir=base, port=0, device="cpu")) as server:
            assert server.dtype == torch.float32
            config = EdgeConfig(
                allow_stock_edge_weights=True, model_dir=base, cloud_url=server.url, draft_model_dir=draft, device="cpu"
            )
            client = SplitClient(config)
            assert client.hello.dtype == "auto"  # before the handshake: the trunk's, whatever it is
            async with client:
                assert client.hello.dtype == "float32"  # the trunk's, pinned for later connections
                assert client.dtype == torch.float32
                assert client.model.dtype == torch.float32
                assert client.draft_model is not None
                assert client.draft_model.dtype == torch.float32
                for label, text in SHOWCASE:
                    ids = tokenizer.encode(text)
                    outputs[label] = {
                        mode: (await client.generate(ids, 72, speculate=mode)).token_ids
                        for mode in ("off", *SPECULATIVE)
                    }
    chosen = [r.getMessage() for r in caplog.records if r.getMessage().startswith("dtype auto")]
    assert sorted(chosen) == sorted(
        f"dtype auto: the float16 {what} checkpoint computes in float32 on cpu (this CPU has no AMX-FP16 or "
        "AVX512-FP16)"
        for what in ("trunk", "edge", "draft")
    ), chosen
    for label, by_mode in outputs.items():
        assert len(by_mode["off"]) == 72, label
        for mode in SPECULATIVE:
            assert by_mode[mode] == by_mode["off"], (label, mode)


async def test_an_auto_edge_follows_the_trunks_pinned_dtype(make_checkpoint: Callable[..., Path]) -> None:
    """A float32 checkpoint: the trunk pinned to bfloat16, an auto edge (which loaded float32) reloads in it."""
    model = make_checkpoint("llama")
    async with TrunkServer(CloudConfig(model_dir=model, port=0, dtype="bfloat16")) as server:
        auto = SplitClient(EdgeConfig(allow_stock_edge_weights=True, model_dir=model, cloud_url=server.url))
        assert auto.model.dtype == torch.float32  # what auto gives on its own device, before the handshake
        async with auto:
            assert auto.dtype == torch.bfloat16
            assert auto.model.dtype == torch.bfloat16
            assert auto.hello.dtype == "bfloat16"  # pinned: a trunk restarted in another dtype is refused
            followed = await auto.generate(PROMPT, 16, speculate="off")
        pinned_config = EdgeConfig(
            allow_stock_edge_weights=True, model_dir=model, cloud_url=server.url, dtype="bfloat16"
        )
        async with SplitClient(pinned_config) as pinned:
            assert pinned.hello.dtype == "bfloat16"
            assert (await pinned.generate(PROMPT, 16, speculate="off")).token_ids == followed.token_ids
        mismatched = EdgeConfig(allow_stock_edge_weights=True, model_dir=model, cloud_url=server.url, dtype="float32")
        with pytest.raises(HandshakeMismatch, match="dtype: edge expects 'float32', trunk is 'bfloat16'"):
            async with SplitClient(mismatched):
                pass
        loaded = SplitClient(mismatched).model  # float32, loaded before any handshake
        given = SplitClient(
            EdgeConfig(allow_stock_edge_weights=True, model_dir=model, cloud_url=server.url), edge=loaded
        )
        async with given:
            assert given.model is not loaded  # its runtime loaded the layers again in bfloat16
            assert given.model.dtype == torch.bfloat16
            assert loaded.dtype == torch.float32  # what the caller passed is left as it was
            assert (await given.generate(PROMPT, 16, speculate="off")).token_ids == followed.token_ids


async def test_a_compiled_auto_edge_compiles_again_in_the_trunks_dtype(
    make_checkpoint: Callable[..., Path], compile_backend: str
) -> None:
    model = make_checkpoint("llama")
    async with TrunkServer(CloudConfig(model_dir=model, port=0, dtype="bfloat16")) as server:
        edge = EdgeConfig(allow_stock_edge_weights=True, model_dir=model, cloud_url=server.url)
        async with SplitClient(edge) as plain:
            expected = (await plain.generate(PROMPT, 16, speculate="off")).token_ids
        compiled = SplitClient(
            dataclasses.replace(edge, compile="auto", compile_backend=compile_backend, max_cache_tokens=64)
        )
        loaded = compiled.model
        async with compiled:
            assert compiled.model is not loaded  # reloaded in bfloat16, then compiled for it
            assert compiled.model.dtype == torch.bfloat16
            head, tail = compiled.model.head.fixed_decode, compiled.model.tail.fixed_decode
            assert head is not None
            assert tail is not None
            assert (await compiled.generate(PROMPT, 16, speculate="off")).token_ids == expected
            assert (head.steps, tail.steps) == (2 + 15, 2 + 15)  # the decode steps took the compiled path
    torch.compiler.reset()  # what dynamo cached here must not count as reused in another test's graph counts
