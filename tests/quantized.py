"""Tiny checkpoints for the quantization tests, made with the quantization libraries' own save paths.

* :func:`save_plain`: a family's tiny random checkpoint (tests/families.py) at hidden size 64, in
  bfloat16. bitsandbytes' CPU 4-bit kernels quantize in blocks of 64 inputs and pack 32 outputs
  at a time: narrower layers (the families' hidden size 32, head size 8) fail in transformers'
  own NF4 model too.
* :func:`save_bnb`: that checkpoint quantized by transformers with bitsandbytes, then
  ``save_pretrained`` (how bitsandbytes checkpoints are published).
* :func:`save_ct_fp8`: that checkpoint in compressed-tensors FP8 (per-channel FP8 weights, the
  format of the FP8 checkpoints made for vLLM), through compressed-tensors' own
  ``apply_quantization_config``, ``calculate_qparams`` and ``ModelCompressor``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, PreTrainedModel

from tests.families import LAYERS, family_config


def bnb_config(quantize: str) -> BitsAndBytesConfig:
    """What a transformers user passes for ``--quantize nf4`` / ``int8``."""
    if quantize == "nf4":
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)
    if quantize == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    raise ValueError(quantize)


def hf_greedy(model: PreTrainedModel, prompt: list[int], new_tokens: int) -> list[int]:
    """transformers' own greedy ``generate`` of a whole model."""
    with torch.no_grad():
        ids = torch.tensor([prompt])
        out = model.generate(  # type: ignore[operator]
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0
        )
    return list(out[0, len(prompt) :].tolist())


def save_plain(directory: Path, family: str, seed: int = 11, hidden: int = 64) -> Path:
    """``hidden`` 256 suits transformers' fp8 (blocks of 128x128 weights); 64 the rest."""
    config = family_config(family, LAYERS)
    config.hidden_size, config.intermediate_size, config.head_dim = hidden, 2 * hidden, hidden // 4
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval().save_pretrained(directory)
    return directory


def save_bnb(plain: Path, directory: Path, quantize: str) -> Path:
    model = AutoModelForCausalLM.from_pretrained(plain, quantization_config=bnb_config(quantize), dtype=torch.bfloat16)
    model.save_pretrained(directory)
    return directory


def save_ct_fp8(plain: Path, directory: Path) -> Path:
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    model = AutoModelForCausalLM.from_pretrained(plain, dtype=torch.bfloat16).eval()
    weights = QuantizationArgs(num_bits=8, type="float", strategy="channel", symmetric=True, dynamic=False)
    scheme = QuantizationScheme(targets=["Linear"], weights=weights)
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "weight_scale"):  # the weight's own per-channel range: no calibration data needed
                w = module.weight
                scale, _ = calculate_qparams(w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True), weights)
                module.weight_scale.copy_(scale)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="float-quantized")
    compressor.compress_model(model)
    model.save_pretrained(directory)
    compressor.update_config(str(directory))
    return directory


def save_fp8(plain: Path, directory: Path) -> Path:
    """That checkpoint in transformers' fine-grained ``fp8`` format (FP8 weights in 32x32 blocks, each with
    its float32 ``weight_scale_inv``), quantized by transformers' own ``Fp8Quantize`` operation.

    transformers only quantizes to fp8 at load on a GPU (``from_pretrained`` refuses on a CPU), so
    the tensors its operation returns are written with safetensors and the config it would save."""
    import json

    from safetensors.torch import save_file
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize
    from transformers.quantizers.auto import AutoHfQuantizer

    config = FineGrainedFP8Config(weight_block_size=(32, 32), modules_to_not_convert=["lm_head"])
    quantize = Fp8Quantize(AutoHfQuantizer.from_config(config, pre_quantized=False))
    model = AutoModelForCausalLM.from_pretrained(plain, dtype=torch.bfloat16).eval()
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        linear = ".layers." in name and name.endswith("_proj.weight")
        tensors.update(quantize.convert({name: tensor}) if linear else {name: tensor})  # type: ignore[arg-type]
    model.config.save_pretrained(directory)
    save_file({k: v.contiguous() for k, v in tensors.items()}, directory / "model.safetensors", {"format": "pt"})
    raw = json.loads((directory / "config.json").read_text())
    raw["quantization_config"] = config.to_dict()
    (directory / "config.json").write_text(json.dumps(raw))
    return directory
