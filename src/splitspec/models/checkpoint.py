"""Read a local Hugging Face checkpoint directory, tensor by tensor.

A checkpoint directory holds ``config.json``, one ``model.safetensors`` or several shards listed
in ``model.safetensors.index.json``, and usually tokenizer files. :class:`Checkpoint` reads only
the tensors a role asks for (``safetensors.safe_open``), and records which names it read, so the
cloud can prove it never touched the embedding, the LM head or the edge layers.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from transformers import CONFIG_MAPPING, AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase
from transformers import __version__ as transformers_version

from splitspec.exceptions import CheckpointError

log = logging.getLogger(__name__)

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


def read_config(directory: Path) -> PretrainedConfig:
    """config.json as transformers reads it, after our own checks (so nothing prompts or downloads)."""
    path = directory / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path} must hold a JSON object")
    if "auto_map" in raw:
        raise CheckpointError(
            f"{directory} needs trust_remote_code (its config.json has an auto_map): splitspec runs no code "
            "shipped with a checkpoint"
        )
    model_type = raw.get("model_type")
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        raise CheckpointError(
            f"{path}: model_type {model_type!r} is not a model type transformers {transformers_version} knows"
        )
    try:
        config: PretrainedConfig = AutoConfig.from_pretrained(directory, local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise CheckpointError(f"{path} is not a valid {model_type} config: {str(exc).splitlines()[0]}") from None
    return config


def load_tokenizer(directory: str | Path) -> PreTrainedTokenizerBase:
    """The checkpoint's tokenizer from local files only, or a :class:`CheckpointError` saying why not."""
    path = Path(directory)
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path} is not a checkpoint directory: config.json is missing")
    read_config(path)  # a broken or remote-code config is named as such, not as a tokenizer problem
    try:
        tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(
            path, local_files_only=True, trust_remote_code=False
        )
    except (OSError, ValueError, TypeError, KeyError, json.JSONDecodeError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise CheckpointError(f"{path}: cannot load the tokenizer ({reason})") from None
    return tokenizer


GENERATION_FILE = "generation_config.json"


def read_generation_config(directory: str | Path) -> dict[str, Any]:
    """generation_config.json as a dict ({} when the checkpoint has none), or a CheckpointError if it is broken."""
    path = Path(directory) / GENERATION_FILE
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path} must hold a JSON object")
    return raw


def generation_stop_ids(directory: str | Path, config: PretrainedConfig) -> frozenset[int]:
    """Stop token ids: config.json's eos_token_id and generation_config.json's (instruct models keep theirs there)."""
    ids: set[int] = set()
    published = read_generation_config(directory).get("eos_token_id")
    sources: list[object] = [getattr(config, "eos_token_id", None), published]
    for value in sources:
        values = value if isinstance(value, list) else [value]
        ids.update(v for v in values if isinstance(v, int) and not isinstance(v, bool))
    return frozenset(ids)


class Checkpoint:
    """A checkpoint directory: its config and lazy, selective access to its tensors."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        if not (self.directory / "config.json").is_file():
            raise CheckpointError(f"{self.directory} is not a checkpoint directory: config.json is missing")
        self.config = read_config(self.directory)
        self._files = self._tensor_files()
        self.read_names: set[str] = set()  # every tensor name read so far

    def _tensor_files(self) -> dict[str, Path]:
        # the single file first, as transformers looks: a folder saved again may keep a stale index beside it
        single = self.directory / SINGLE_FILE
        if single.is_file():
            try:
                with safe_open(str(single), framework="pt") as f:
                    return {name: single for name in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
            except SafetensorError as exc:
                raise CheckpointError(f"{single} is not a readable safetensors file ({exc})") from None
        index = self.directory / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                return {str(name): self.directory / str(fname) for name, fname in weight_map.items()}
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
                raise CheckpointError(f"{index} is not a valid safetensors index ({exc!r})") from None
        raise CheckpointError(f"{self.directory} has neither {SINGLE_FILE} nor {INDEX_FILE}")

    @property
    def tensor_names(self) -> list[str]:
        return sorted(self._files)

    def has(self, name: str) -> bool:
        return name in self._files

    def file_of(self, name: str) -> Path:
        """The safetensors file holding tensor ``name``."""
        if name not in self._files:
            raise CheckpointError(f"{self.directory} lacks tensor {name}")
        return self._files[name]

    @property
    def tensor_files(self) -> list[Path]:
        """Every safetensors file of the checkpoint, sorted (the index file not included)."""
        return sorted(set(self._files.values()))

    def read(
        self, names: list[str], dtype: torch.dtype | None = None, device: torch.device | None = None
    ) -> dict[str, torch.Tensor]:
        """Read exactly ``names`` (cast to ``dtype``, or as stored) straight onto ``device`` (default CPU).

        Each shard is opened once."""
        missing = [n for n in names if n not in self._files]
        if missing:
            raise CheckpointError(f"{self.directory} lacks tensors: {', '.join(missing[:5])}")
        by_file: dict[Path, list[str]] = {}
        for name in names:
            by_file.setdefault(self._files[name], []).append(name)
        out: dict[str, torch.Tensor] = {}
        for path, file_names in by_file.items():
            try:
                with safe_open(str(path), framework="pt", device=str(device or "cpu")) as f:
                    for name in file_names:
                        tensor = f.get_tensor(name)
                        out[name] = tensor if dtype is None else tensor.to(dtype)
            except (SafetensorError, OSError) as exc:
                raise CheckpointError(f"{path} is not a readable safetensors file ({exc})") from None
        self.read_names.update(names)
        log.debug("read %d tensors from %s", len(names), self.directory)
        return out

    @contextlib.contextmanager
    def open_slices(self, names: list[str], device: torch.device, pread: bool = False) -> Iterator[dict[str, Any]]:
        """Lazy handles on exactly ``names`` (safetensors slices), each read straight onto ``device`` when indexed.

        transformers' loader takes these the way ``from_pretrained`` hands it its own: one tensor is
        materialized at a time, as it is converted (and quantized), so a role's load never holds more
        than one unconverted tensor beside what it keeps. The files stay open until the block ends.

        On the host, a tensor read through the file's memory map is a view of it (nothing copied;
        the pages count in this process's RSS once touched, and stay mapped while any tensor of the
        file lives). ``pread`` reads each one into its own buffer instead: for tensors that are
        temporaries (quantized or dequantized at load), so the pages they were read from are not
        kept mapped by the norms that stay."""
        missing = [n for n in names if n not in self._files]
        if missing:
            raise CheckpointError(f"{self.directory} lacks tensors: {', '.join(missing[:5])}")
        by_file: dict[Path, list[str]] = {}
        for name in names:
            by_file.setdefault(self._files[name], []).append(name)
        with contextlib.ExitStack() as files:
            out: dict[str, Any] = {}
            for path, file_names in by_file.items():
                try:
                    how = {"backend": "pread"} if pread else {}  # default: the memory map
                    f = files.enter_context(safe_open(str(path), framework="pt", device=str(device), **how))
                    out.update((name, f.get_slice(name)) for name in file_names)
                except (SafetensorError, OSError) as exc:
                    raise CheckpointError(f"{path} is not a readable safetensors file ({exc})") from None
            self.read_names.update(names)
            log.debug("opened %d tensors of %s for %s", len(names), self.directory, device)
            yield out


def hash_tensors(digest: hashlib._Hash, ckpt: Checkpoint, names: list[str]) -> None:
    """Feed ``digest`` each tensor's name, shape and float32 bytes, in the order given (one tensor read at a time)."""
    for name in names:
        t = ckpt.read([name], torch.float32)[name].contiguous()
        digest.update(name.encode())
        digest.update(str(tuple(t.shape)).encode())
        digest.update(t.numpy().tobytes())
