"""The ``--quantize`` choices and help, importable without transformers (the CLI parser needs them)."""

QUANTIZE_CHOICES = ("nf4", "int8")  # bitsandbytes at load: see splitspec.models.quantization
QUANTIZE_HELP = (
    "quantize the weights this side loads, at load, with bitsandbytes: nf4 (4-bit NormalFloat, computing in the "
    "compute dtype) or int8 (LLM.int8()); the embedding and LM head stay unquantized. Edge and trunk must "
    "agree: the trunk fingerprint names the method, and the edge refuses a trunk quantized otherwise. A "
    "checkpoint published quantized (bitsandbytes 4/8-bit, compressed-tensors FP8, fp8) loads as published "
    "without this flag; GPTQ and AWQ are refused"
)
