"""The trunk's KV memory budget: its default size and the bytes one cache entry costs."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import PretrainedConfig

log = logging.getLogger(__name__)

DEFAULT_BUDGET_FRACTION = 0.4  # --kv-budget-mb default: this share of the memory available at start-up


def kv_bytes_per_token(config: PretrainedConfig, trunk_layers: int, dtype: torch.dtype) -> int:
    """Theoretical KV size of one cache entry of the trunk: 2 x layers x kv heads x head dim x dtype bytes."""
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    return 2 * trunk_layers * kv_heads * head_dim * dtype.itemsize


def available_memory_bytes(device: torch.device, meminfo: Path = Path("/proc/meminfo")) -> int:
    """Memory free for new tensors on ``device``: the accelerator's free memory for CUDA, else the host's
    ``MemAvailable`` (Linux), falling back to its free physical pages."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    if meminfo.exists():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # the kernel reports kB
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))


def default_budget_bytes(devices: Sequence[torch.device], share: float = 1.0) -> int:
    """:data:`DEFAULT_BUDGET_FRACTION` of the memory available on the trunk's tightest device, times ``share``:
    less than 1 for a Ray replica that may share that memory with other replicas (docs/ray-serve.md)."""
    available = min(available_memory_bytes(d) for d in devices)
    fraction = DEFAULT_BUDGET_FRACTION * share
    budget = int(available * fraction)
    log.info(
        "KV budget %.0f MiB (%.3g %% of %.0f MiB available%s; set --kv-budget-mb to choose)",
        budget / 2**20,
        fraction * 100,
        available / 2**20,
        "" if share == 1 else f", {DEFAULT_BUDGET_FRACTION:.0%} x this replica's share {share:.3g}",
    )
    return budget
