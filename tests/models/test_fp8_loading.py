"""FP8 checkpoints dequantized at load (transformers' fine-grained ``fp8``; compressed-tensors FP8 on a CPU) have
plain float weights: they compute in any pinned dtype, follow ``--dtype auto``'s rule for plain weights on a CPU,
and load with static activation scales (``input_scale``) that the dequantized projections do not use."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, FineGrainedFP8Config

from splitspec.models import precision
from splitspec.models.checkpoint import Checkpoint
from splitspec.models.kv_cache import KVCache
from splitspec.models.loading import load_edge, load_full, load_trunk, resolve_dtype
from splitspec.models.masks import chain
from splitspec.models.split import SplitPlan
from tests.families import LAYERS
from tests.quantized import save_ct_fp8, save_fp8, save_plain

PROMPT = torch.tensor([5, 9, 17, 3, 44, 2, 8, 61, 30, 12, 7])
PLAN = SplitPlan(LAYERS, 1, 1)
CPU = torch.device("cpu")
BARE_CPU = {"avx2": True, "avx512_f": True, "avx512_bf16": False, "avx512_fp16": False, "amx_bf16": False}


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_plain(tmp_path_factory.mktemp("plain"), "llama3")  # bfloat16, as FP8 checkpoints' other tensors


@pytest.fixture(scope="module")
def fp8(plain: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_fp8(plain, tmp_path_factory.mktemp("fp8"))


def split_logits(directory: Path, dtype: torch.dtype | None) -> torch.Tensor:
    """Edge head -> trunk -> edge tail over the prompt, each piece loaded on its own: logits (q, V) float32."""
    edge = load_edge(Checkpoint(directory), PLAN, dtype)
    trunk = load_trunk(Checkpoint(directory), PLAN, dtype)
    if dtype is not None:
        for piece in (edge, trunk):
            assert {p.dtype for p in piece.parameters()} == {dtype}  # norms, embedding and LM head too
    q = len(PROMPT)
    positions, parents = torch.arange(q), torch.tensor(chain(q))
    hidden = edge.run_head(PROMPT, positions, parents, KVCache())
    hidden = trunk(hidden, positions, parents, KVCache())
    return edge.run_tail(hidden, positions, parents, KVCache())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_bfloat16_fp8_checkpoint_computes_in_a_pinned_dtype(fp8: Path, dtype: torch.dtype) -> None:
    """Its dequantized projections came out in the pinned dtype, its norms, embedding and LM head in bfloat16:
    the first step failed ("expected m1 and m2 to have the same dtype"), and so does transformers' own load."""
    got = split_logits(fp8, dtype)
    hf = AutoModelForCausalLM.from_pretrained(
        fp8, dtype=torch.float32, quantization_config=FineGrainedFP8Config(dequantize=True)
    )
    with torch.no_grad():  # transformers' float32 load, its bfloat16 leftovers cast by hand
        reference = hf.float().eval()(PROMPT[None]).logits[0]
    if dtype == torch.float32:
        torch.testing.assert_close(got, reference)
        whole = load_full(Checkpoint(fp8), dtype)
        q = len(PROMPT)
        torch.testing.assert_close(got, whole(PROMPT, torch.arange(q), torch.tensor(chain(q)), KVCache()))
    else:
        torch.testing.assert_close(got, reference, rtol=0, atol=0.05)


def test_auto_applies_the_plain_cpu_rule_to_dequantized_fp8(
    fp8: Path, plain: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dequantized FP8 checkpoint's weights are plain nn.Linear: on a CPU without native bfloat16 matrix
    instructions it computes in float32 under auto, as a plain bfloat16 checkpoint does (it computed in bfloat16)."""
    ct_fp8 = save_ct_fp8(plain, tmp_path / "ct-fp8")
    monkeypatch.setattr(precision, "cpu_capabilities", lambda: BARE_CPU)
    for directory in (fp8, ct_fp8, plain):
        assert resolve_dtype(Checkpoint(directory), "auto", CPU, "trunk") == (torch.float32, "float32")
    monkeypatch.setattr(precision, "cpu_capabilities", lambda: {**BARE_CPU, "amx_bf16": True})
    for directory in (fp8, ct_fp8, plain):
        assert resolve_dtype(Checkpoint(directory), "auto", CPU, "trunk") == (torch.bfloat16, "bfloat16")


def test_static_activation_scales_are_left_out(fp8: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """``activation_scheme: static`` stores an ``input_scale`` per FP8 linear; dequantized projections do not use
    them (nor does transformers' dequantizing load): the checkpoint was refused as not matching its config."""
    static = shutil.copytree(fp8, tmp_path / "static")
    tensors = load_file(static / "model.safetensors")
    scales = [name for name in tensors if name.endswith(".weight_scale_inv")]
    assert scales
    for name in scales:
        tensors[name.replace(".weight_scale_inv", ".input_scale")] = torch.tensor(0.01)
    save_file(tensors, static / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((static / "config.json").read_text())
    config["quantization_config"]["activation_scheme"] = "static"
    (static / "config.json").write_text(json.dumps(config))
    with caplog.at_level(logging.INFO, logger="splitspec.models.quantization"):
        got = split_logits(static, None)
    assert "fp8 checkpoint: its static activation scales are not applied" in caplog.text
    torch.testing.assert_close(got, split_logits(fp8, None), rtol=0, atol=0)
