"""Read a local Hugging Face checkpoint directory, tensor by tensor.

A checkpoint directory holds ``config.json``, one ``model.safetensors`` or several shards listed
in ``model.safetensors.index.json``, and usually tokenizer files. :class:`Checkpoint` reads only
the tensors a role asks for (``safetensors.safe_open``), and records which names it read, so the
cloud can prove it never touched the embedding, the LM head or the edge layers.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, PretrainedConfig

from splitspec.exceptions import CheckpointError

log = logging.getLogger(__name__)

SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2")
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

# Config keys that say nothing about the computation; left out of the fingerprint.
_VOLATILE_KEYS = frozenset(
    {
        "_name_or_path",
        "transformers_version",
        "torch_dtype",
        "dtype",
        "architectures",
        "use_cache",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "_attn_implementation_autoset",
        "_attn_implementation_internal",
        "_experts_implementation_internal",
    }
)


def fingerprint(config: PretrainedConfig) -> str:
    """A stable hash of the architecture-relevant config fields (hex, 16 chars)."""
    items = {k: v for k, v in sorted(config.to_dict().items()) if k not in _VOLATILE_KEYS}
    blob = json.dumps(items, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


class Checkpoint:
    """A checkpoint directory: its config and lazy, selective access to its tensors."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        if not (self.directory / "config.json").is_file():
            raise CheckpointError(f"{self.directory} is not a checkpoint directory: config.json is missing")
        self.config: PretrainedConfig = AutoConfig.from_pretrained(self.directory, local_files_only=True)
        if self.config.model_type not in SUPPORTED_FAMILIES:
            raise CheckpointError(
                f"model type {self.config.model_type!r} is not supported; supported: {', '.join(SUPPORTED_FAMILIES)}"
            )
        self._files = self._tensor_files()
        self.read_names: set[str] = set()  # every tensor name read so far

    def _tensor_files(self) -> dict[str, Path]:
        index = self.directory / INDEX_FILE
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            return {name: self.directory / fname for name, fname in weight_map.items()}
        single = self.directory / SINGLE_FILE
        if single.is_file():
            with safe_open(str(single), framework="pt") as f:
                return {name: single for name in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
        raise CheckpointError(f"{self.directory} has neither {SINGLE_FILE} nor {INDEX_FILE}")

    @property
    def tensor_names(self) -> list[str]:
        return sorted(self._files)

    def has(self, name: str) -> bool:
        return name in self._files

    def read(self, names: list[str], dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Read exactly ``names`` (cast to ``dtype``), opening each shard once."""
        missing = [n for n in names if n not in self._files]
        if missing:
            raise CheckpointError(f"{self.directory} lacks tensors: {', '.join(missing[:5])}")
        by_file: dict[Path, list[str]] = {}
        for name in names:
            by_file.setdefault(self._files[name], []).append(name)
        out: dict[str, torch.Tensor] = {}
        for path, file_names in by_file.items():
            with safe_open(str(path), framework="pt") as f:
                for name in file_names:
                    out[name] = f.get_tensor(name).to(dtype)
        self.read_names.update(names)
        log.debug("read %d tensors from %s", len(names), self.directory)
        return out

    def read_prefix(self, prefix: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Read every tensor under ``prefix``, returned with the prefix stripped."""
        names = [n for n in self._files if n.startswith(prefix)]
        if not names:
            raise CheckpointError(f"{self.directory} has no tensors under {prefix!r}")
        return {n[len(prefix) :]: t for n, t in self.read(names, dtype).items()}
