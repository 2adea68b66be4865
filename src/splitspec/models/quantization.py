"""Quantized weights, through transformers' own quantizers applied to the partial model a role loads.

Two ways in, both ending in a transformers ``HfQuantizer`` that the loader in
:mod:`splitspec.models.stack` drives the way ``from_pretrained`` does (``preprocess_model`` on the
meta skeleton, the state-dict loader with ``hf_quantizer``, then ``postprocess_model``); nothing
here quantizes a tensor itself:

* ``--quantize nf4`` / ``--quantize int8`` quantize an unquantized checkpoint at load with
  bitsandbytes (``BitsAndBytesConfig``: NF4 with the compute dtype, or LLM.int8());
* a checkpoint published quantized loads as published, from its ``config.json``
  ``quantization_config``: bitsandbytes 4-bit and 8-bit; compressed-tensors FP8 (kept in FP8 where
  torch's ``scaled_mm`` serves it, a CUDA GPU of compute capability 8.9 or more, dequantized
  everywhere else); transformers' fine-grained ``fp8`` (always dequantized: its matmul kernel is
  fetched from the Hub at run time, which splitspec never does). Anything else (GPTQ, AWQ, ...)
  is refused in one line naming what is supported.

:attr:`Quantization.method` is what the trunk fingerprint names (``nf4``, ``bnb_nf4``, ``ct_fp8``).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import BitsAndBytesConfig, CompressedTensorsConfig, FineGrainedFP8Config, PretrainedConfig
from transformers.quantizers.auto import get_hf_quantizer
from transformers.quantizers.base import HfQuantizer

from splitspec.exceptions import CheckpointError, ConfigError
from splitspec.models.quantize_choices import QUANTIZE_CHOICES

log = logging.getLogger(__name__)

SUPPORTED = (
    "splitspec loads checkpoints published in bitsandbytes 4-bit or 8-bit, compressed-tensors FP8 or "
    "transformers' fp8 format, and quantizes unquantized ones with --quantize nf4|int8"
)
_NO_WHEEL = " (their kernels, gptqmodel's, build CUDA code at install and want a torch outside splitspec's range)"


@dataclass(frozen=True)
class Quantization:
    """A transformers quantizer for one role's load, and the method it stands for."""

    quantizer: HfQuantizer
    method: str  # "nf4" / "int8" at load; "bnb_nf4", "bnb_fp4", "bnb_int8", "ct_fp8", "fp8" as published
    pre_quantized: bool  # True: the checkpoint stores quantized tensors


def published_method(config: PretrainedConfig) -> str | None:
    """The method a checkpoint was published quantized with (see :attr:`Quantization.method`), None if unquantized.

    Raises :class:`CheckpointError` for a method splitspec does not load (GPTQ, AWQ, ...)."""
    raw = _published_config(config)
    if raw is None:
        return None
    method = str(raw.get("quant_method", "")).lower()
    if method == "bitsandbytes" or raw.get("load_in_4bit") or raw.get("load_in_8bit"):
        if raw.get("load_in_4bit") or raw.get("_load_in_4bit"):
            return f"bnb_{raw.get('bnb_4bit_quant_type', 'fp4')}"
        return "bnb_int8"
    if method == "compressed-tensors":
        if not CompressedTensorsConfig.from_dict(dict(raw)).has_fp8_modules:
            raise CheckpointError(f"compressed-tensors checkpoints other than FP8 are not supported: {SUPPORTED}")
        return "ct_fp8"
    if method == "fp8":
        return "fp8"
    why = _NO_WHEEL if method in ("gptq", "awq") else ""
    name = method or "an unnamed method"
    raise CheckpointError(f"checkpoints quantized with {name} are not supported{why}: {SUPPORTED}")


def _published_config(config: PretrainedConfig) -> Mapping[str, Any] | None:
    raw = getattr(config, "quantization_config", None)
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        to_dict = getattr(raw, "to_dict", None)
        raw = to_dict() if callable(to_dict) else None
    if not isinstance(raw, Mapping):
        raise CheckpointError("config.json's quantization_config must be a JSON object")
    return raw


def _has_fp8_matmul(devices: Sequence[torch.device]) -> bool:
    """True when every device runs torch's FP8 ``scaled_mm`` (CUDA, compute capability 8.9 or more)."""
    return all(d.type == "cuda" and torch.cuda.get_device_capability(d) >= (8, 9) for d in devices)


def unused_tensors(quantizer: HfQuantizer | None, names: Collection[str]) -> set[str]:
    """The checkpoint tensors among ``names`` that a load through ``quantizer`` leaves unread: a dequantized fp8
    checkpoint's static activation scales (``<linear>.input_scale``, one per FP8 linear: its dequantized
    projections compute in the compute dtype, activations unquantized), as transformers' dequantizing load
    leaves them unused (its own ``activation_scale`` name is dropped by its weight converter already)."""
    config = getattr(quantizer, "quantization_config", None)
    if getattr(config, "quant_method", None) != "fp8" or not getattr(config, "dequantize", False):
        return set()
    present = set(names)
    return {n for n in present if n.endswith(".input_scale") and f"{n.removesuffix('input_scale')}weight" in present}


def dequantized_at_load(method: str, devices: Sequence[torch.device]) -> bool:
    """Whether a checkpoint published quantized with ``method`` loads dequantized on ``devices`` (plain float
    weights, computing as an unquantized checkpoint does): transformers' ``fp8`` always, compressed-tensors FP8
    where torch's FP8 ``scaled_mm`` does not serve every device."""
    if method == "fp8":
        return True
    return method == "ct_fp8" and not _has_fp8_matmul(devices)


def plan_quantization(
    config: PretrainedConfig, quantize: str | None, dtype: torch.dtype, devices: Sequence[torch.device]
) -> tuple[Quantization | None, PretrainedConfig]:
    """The quantizer a role loads with (None: plain weights) and the config to build its skeleton from.

    ``quantize`` is ``--quantize`` (None, "nf4" or "int8"); ``config`` is never mutated.
    """
    published = published_method(config)
    if published is not None and quantize is not None:
        raise ConfigError(
            f"--quantize {quantize}: the checkpoint is already quantized ({published}); it loads as published "
            "without --quantize"
        )
    if published is None and quantize is None:
        return None, config
    args: Any
    if quantize == "nf4":
        args = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype)
    elif quantize == "int8":
        args = BitsAndBytesConfig(load_in_8bit=True)
    elif quantize is not None:
        raise ConfigError(f"--quantize {quantize!r} is not one of {', '.join(QUANTIZE_CHOICES)}")
    elif published == "ct_fp8":
        keep = not dequantized_at_load(published, devices)
        args = CompressedTensorsConfig(dequantize=not keep, use_optimized_inference=keep)
        log.info("compressed-tensors FP8 checkpoint: %s", "kept in FP8 (scaled_mm)" if keep else "dequantized at load")
    elif published == "fp8":
        # its kernel comes from the Hub: dequantize, never download (keeping the checkpoint's own skip list,
        # which these loading attributes would otherwise overwrite)
        skip = (_published_config(config) or {}).get("modules_to_not_convert")
        args = FineGrainedFP8Config(dequantize=True, modules_to_not_convert=skip)
        log.info("fp8 checkpoint: dequantized at load (its matmul kernel would need a download)")
        if str((_published_config(config) or {}).get("activation_scheme", "")).lower() == "static":
            log.info("fp8 checkpoint: its static activation scales are not applied (activations stay in %s)", dtype)
    else:
        args = None  # bitsandbytes as published: the checkpoint's own config says it all
    config = copy.deepcopy(config)
    device_map = {"": str(devices[0])}
    try:
        quantizer, config, _ = get_hf_quantizer(config, args, device_map, weights_only=True, user_agent={})
    except (ImportError, ValueError, RuntimeError) as exc:
        what = f"--quantize {quantize}" if quantize is not None else f"the {published} checkpoint"
        raise ConfigError(f"{what} cannot load here: {str(exc).splitlines()[0]}") from None
    if quantizer is None:
        raise CheckpointError(f"transformers has no quantizer for this checkpoint's quantization_config: {SUPPORTED}")
    method = quantize or published or ""  # one of the two is set (both None returned above)
    if method.endswith("int8") and dtype != torch.float16:
        # bitsandbytes logs this at every int8 matmul of every step; said once here instead
        logging.getLogger("bitsandbytes.autograd._functions").setLevel(logging.ERROR)
        log.info("int8: bitsandbytes casts each quantized layer's %s input to float16 for its int8 matmul", dtype)
    return Quantization(quantizer, method, pre_quantized=published is not None), config


def quantized_dtype_label(method: str | None, stored: str) -> str:
    """The fingerprint's dtype field: the stored dtypes, wrapped in the method when quantized ("nf4(bfloat16)")."""
    return stored if method is None else f"{method}({stored})"
