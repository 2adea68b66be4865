"""The compute dtype per device: ``--dtype auto`` (the default), or one the user pins.

``auto`` computes in the checkpoint's own dtype (config.json's ``dtype``) on an accelerator. On a
CPU a half-precision checkpoint computes in float32 unless the CPU has native matrix instructions
for that type: AMX-BF16 or AVX512-BF16 for bfloat16, AMX-FP16 or AVX512-FP16 for float16. Without
them oneDNN emulates the half type and is slower than float32 (the shipped float16 base model:
9-token steps 1.8x slower on this project's CPUs), and float16 has exact argmax ties where a
speculative and a one-token step may pick different tokens. The CPU's instructions are read from
torch's own detector (:func:`torch.cpu.get_capabilities`). Each choice is logged once (INFO).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping

import torch

from splitspec.exceptions import ConfigError
from splitspec.models.dtype_choices import AUTO, DTYPE_CHOICES

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# CPU capability flags (torch.cpu.get_capabilities' names) that compute each half type natively
NATIVE_CPU_FLAGS: dict[torch.dtype, tuple[str, ...]] = {
    torch.bfloat16: ("amx_bf16", "avx512_bf16"),
    torch.float16: ("amx_fp16", "avx512_fp16"),
}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float16`` -> ``"float16"``."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """Map "float32" / "bfloat16" / "float16" to a torch dtype, with a clear error."""
    if name not in _DTYPES:
        raise ConfigError(f"dtype {name!r} is not one of {', '.join(DTYPE_CHOICES)}")
    return _DTYPES[name]


def cpu_capabilities() -> Mapping[str, object]:
    """What torch's CPU detector reports (instruction-set flags by name); empty where this torch has none."""
    detect = getattr(torch.cpu, "get_capabilities", None)  # torch >= 2.10
    if detect is None:
        return {}
    caps: Mapping[str, object] = detect()
    return caps


def native_cpu_flags(dtype: torch.dtype, capabilities: Mapping[str, object]) -> tuple[str, ...]:
    """The flags among ``capabilities`` that give this CPU native matrix instructions for ``dtype``."""
    return tuple(flag for flag in NATIVE_CPU_FLAGS.get(dtype, ()) if capabilities.get(flag) is True)


def auto_dtype(
    stored: torch.dtype, device: torch.device, capabilities: Mapping[str, object] | None = None
) -> tuple[torch.dtype, str]:
    """The dtype ``auto`` computes a ``stored``-dtype checkpoint in on ``device``, and why (for the log).

    ``capabilities`` defaults to this machine's CPU (:func:`cpu_capabilities`).
    """
    if device.type != "cpu":
        return stored, f"the checkpoint's own on {device.type}"
    if stored not in NATIVE_CPU_FLAGS:
        return stored, "the checkpoint's own"
    caps = cpu_capabilities() if capabilities is None else capabilities
    wanted = " or ".join(f.upper().replace("_", "-") for f in NATIVE_CPU_FLAGS[stored])
    native = native_cpu_flags(stored, caps)
    if native:
        return stored, f"the checkpoint's own: this CPU has {', '.join(f.upper().replace('_', '-') for f in native)}"
    if not caps:
        return torch.float32, f"torch {torch.__version__} cannot tell whether this CPU has {wanted}"
    return torch.float32, f"this CPU has no {wanted}"


def resolve_compute_dtype(name: str, stored: torch.dtype, device: torch.device, what: str = "model") -> torch.dtype:
    """``name`` (one of :data:`DTYPE_CHOICES`) as a torch dtype for a ``stored``-dtype ``what`` on ``device``.

    A pinned name is returned as is; ``auto`` follows :func:`auto_dtype` and logs its choice once.
    """
    if name != AUTO:
        return dtype_from_name(name)
    dtype, why = auto_dtype(stored, device)
    _log_choice(what, dtype_name(stored), str(device), dtype_name(dtype), why)
    return dtype


@functools.cache
def _log_choice(what: str, stored: str, device: str, chosen: str, why: str) -> None:
    """Log one auto choice, once per process (every client of a server resolves the same)."""
    log.info("dtype auto: the %s %s checkpoint computes in %s on %s (%s)", stored, what, chosen, device, why)
