"""``--dtype auto``: the checkpoint's own dtype on an accelerator, float32 for a half type on a CPU
without native matrix instructions for it, and a pinned dtype as given."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from splitspec.exceptions import ConfigError
from splitspec.models import precision
from splitspec.models.checkpoint import Checkpoint
from splitspec.models.loading import resolve_dtype
from splitspec.models.precision import auto_dtype, cpu_capabilities, resolve_compute_dtype

CPU, CUDA, MPS = torch.device("cpu"), torch.device("cuda", 0), torch.device("mps")
BARE_CPU = {"avx2": True, "avx512_f": True, "avx512_bf16": False, "avx512_fp16": False, "amx_bf16": False}


@pytest.mark.parametrize(
    ("stored", "device", "caps", "expected"),
    [
        (torch.float16, CUDA, {}, torch.float16),  # accelerators: the checkpoint's own, whatever it is
        (torch.bfloat16, CUDA, {}, torch.bfloat16),
        (torch.float16, MPS, {}, torch.float16),
        (torch.float32, CPU, BARE_CPU, torch.float32),
        (torch.float16, CPU, BARE_CPU, torch.float32),  # no native half-precision matmul: float32
        (torch.bfloat16, CPU, BARE_CPU, torch.float32),
        (torch.bfloat16, CPU, {**BARE_CPU, "avx512_bf16": True}, torch.bfloat16),
        (torch.bfloat16, CPU, {**BARE_CPU, "amx_bf16": True}, torch.bfloat16),
        (torch.float16, CPU, {**BARE_CPU, "avx512_bf16": True}, torch.float32),  # bf16 units do not serve fp16
        (torch.float16, CPU, {**BARE_CPU, "avx512_fp16": True}, torch.float16),
        (torch.float16, CPU, {**BARE_CPU, "amx_fp16": True}, torch.float16),
        (torch.float16, CPU, {}, torch.float32),  # a torch that cannot tell: float32 (and the log says why)
    ],
)
def test_auto_rule(stored: torch.dtype, device: torch.device, caps: dict[str, object], expected: torch.dtype) -> None:
    dtype, why = auto_dtype(stored, device, caps)
    assert dtype == expected, why


@pytest.mark.skipif(not hasattr(torch.cpu, "get_capabilities"), reason="torch < 2.10 has no CPU detector")
def test_this_cpus_flags_come_from_torch() -> None:
    caps = cpu_capabilities()
    assert caps == torch.cpu.get_capabilities()
    flags = "avx512_fp16" in caps and "amx_fp16" in caps
    assert flags, sorted(caps)  # torch 2.13 reports both: the float16 rule reads real flags


def test_pinned_dtypes_are_kept_and_bad_names_refused() -> None:
    for name, dtype in (("float32", torch.float32), ("float16", torch.float16), ("bfloat16", torch.bfloat16)):
        assert resolve_compute_dtype(name, torch.float16, CPU) == dtype
    with pytest.raises(ConfigError, match="auto, float32, bfloat16, float16"):
        resolve_compute_dtype("float64", torch.float16, CPU)


def test_the_shipped_float16_model_computes_in_float32_on_this_cpu(caplog: pytest.LogCaptureFixture) -> None:
    """The demo base model is float16; this machine's CPU has no AVX512-FP16 nor AMX-FP16."""
    import splitspec

    base = Checkpoint(Path(splitspec.__file__).parent / "assets" / "models" / "base")
    assert base.config.dtype == torch.float16
    if precision.native_cpu_flags(torch.float16, cpu_capabilities()):
        pytest.skip("this CPU computes float16 natively")
    precision._log_choice.cache_clear()
    with caplog.at_level(logging.INFO, logger="splitspec.models.precision"):
        assert resolve_dtype(base, "auto", CPU, "edge") == (torch.float32, "float32")
        assert resolve_dtype(base, "auto", CPU, "edge") == (torch.float32, "float32")
        assert resolve_dtype(base, "float16", CPU, "edge") == (torch.float16, "float16")  # pinned: as given
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "dtype auto: the float16 edge checkpoint computes in float32 on cpu (this CPU has no AMX-FP16 or AVX512-FP16)"
    ]  # once, however many times it is resolved


def test_a_float32_checkpoint_stays_float32(make_checkpoint: Callable[..., Path]) -> None:
    ckpt = Checkpoint(make_checkpoint("llama"))
    assert resolve_dtype(ckpt, "auto", CPU) == (torch.float32, "float32")


def test_a_quantized_role_computes_in_the_published_dtype_on_any_cpu(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """`--quantize` on the shipped float16 model: its quantized layers and its unquantized parts load in float16,
    so under auto both ends compute in it, even on a CPU whose plain float16 weights would go to float32."""
    import splitspec

    base = Checkpoint(Path(splitspec.__file__).parent / "assets" / "models" / "base")
    monkeypatch.setattr(precision, "cpu_capabilities", lambda: BARE_CPU)  # no native half matrix instructions
    precision._log_choice.cache_clear()
    assert resolve_dtype(base, "auto", CPU, "trunk") == (torch.float32, "float32")  # plain weights: upcast
    with caplog.at_level(logging.INFO, logger="splitspec.models.loading"):
        assert resolve_dtype(base, "auto", CPU, "trunk", quantize="int8") == (torch.float16, "float16")
    assert "trunk: quantized, computes in the checkpoint's own float16" in [r.getMessage() for r in caplog.records]
    assert resolve_dtype(base, "float32", CPU, "trunk", quantize="int8") == (torch.float32, "float32")  # pinned
