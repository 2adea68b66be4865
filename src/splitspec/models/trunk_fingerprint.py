"""The content fingerprint of a checkpoint's trunk, computed from its safetensors and cached beside it.

Edge and cloud each compute it from their own copy of the checkpoint, the same way: blake2b-128
over every trunk tensor (the names :func:`~splitspec.models.loading.trunk_tensor_names` gives, in
sorted order) fed as ``name NUL dtype NUL shape NUL`` and then the tensor's stored bytes. Sharding,
file names and tensor order inside the files do not matter; any changed weight, dtype, shape or
layer does.

It covers what the trunk serves. A checkpoint published quantized is hashed as stored (packed
weights, scales and quantization state are trunk tensors like any other) and its dtype field names
the method: ``bnb_nf4(bfloat16+float32+uint8)``. A trunk quantized at load (``--quantize``) is
hashed from the tensors it quantizes and names its method the same way: ``nf4(bfloat16)``.

Hashing reads every trunk byte once, so the result is cached in ``CACHE_FILE`` in the checkpoint
directory (for a snapshot of the Hugging Face cache, a symlink farm shared by revisions, beside its
``snapshots/`` folder instead: :func:`splitspec.models.hub.side_file`), keyed by the layer range and
the size and modification time of the tensor files holding trunk tensors (a restart does not rehash;
a sharded checkpoint's other shards need not be there). A directory we
cannot write to only costs the rehash at the next start; within one process the result is also
kept in memory.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from splitspec.exceptions import CheckpointError
from splitspec.models.checkpoint import INDEX_FILE, Checkpoint
from splitspec.models.hub import side_file
from splitspec.models.loading import trunk_tensor_names
from splitspec.models.quantization import published_method, quantized_dtype_label
from splitspec.models.split import SplitPlan
from splitspec.protocol.trunk_fingerprint import TrunkFingerprint

log = logging.getLogger(__name__)

CACHE_FILE = ".splitspec-trunk-fingerprint.json"
_CACHE_FORMAT = 1
FileStats = tuple[tuple[str, int, int], ...]  # (file name, size in bytes, mtime in ns) per tensor file


def trunk_fingerprint(ckpt: Checkpoint, plan: SplitPlan, quantize: str | None = None) -> TrunkFingerprint:
    """The fingerprint of ``plan``'s trunk layers in ``ckpt`` served quantized at load with ``quantize`` (None:
    as stored), its dtype field naming the quantization method if any."""
    stored = _stored_fingerprint(ckpt, plan)
    method = quantize if quantize is not None else published_method(ckpt.config)
    dtype = quantized_dtype_label(method, stored.dtype)
    return TrunkFingerprint(stored.layer_start, stored.layer_end, dtype, stored.digest)


def _stored_fingerprint(ckpt: Checkpoint, plan: SplitPlan) -> TrunkFingerprint:
    """The fingerprint of the trunk tensors as stored: from the cache when their files are unchanged."""
    stats = _file_stats(ckpt, plan)
    key = f"{plan.trunk_layers.start}-{plan.trunk_layers.stop}"
    cache = _read_cache(ckpt.directory)
    entry = cache.get(key)
    if isinstance(entry, dict) and entry.get("files") == [list(s) for s in stats]:
        with contextlib.suppress(ValueError, TypeError):
            return TrunkFingerprint.parse(entry["fingerprint"])
    fingerprint = _hash_trunk(ckpt.directory.resolve(), plan, stats)
    cache[key] = {"files": [list(s) for s in stats], "fingerprint": str(fingerprint)}
    _write_cache(ckpt.directory, cache)
    return fingerprint


def _file_stats(ckpt: Checkpoint, plan: SplitPlan) -> FileStats:
    """Size and mtime of the files holding ``plan``'s trunk tensors (and of the index naming them): a sharded
    checkpoint's other shards (the embedding's, the edge layers') may be absent or change without touching it."""
    files = sorted({ckpt.file_of(name) for name in trunk_tensor_names(ckpt, plan)})
    index = ckpt.directory / INDEX_FILE
    if index.is_file():
        files.append(index)
    stats = []
    for path in files:
        try:
            st = path.stat()
        except OSError as exc:
            raise CheckpointError(f"{path}, which holds trunk tensors, cannot be read ({exc.strerror})") from None
        stats.append((path.name, st.st_size, st.st_mtime_ns))
    return tuple(stats)


@functools.lru_cache(maxsize=16)
def _hash_trunk(directory: Path, plan: SplitPlan, stats: FileStats) -> TrunkFingerprint:
    """Hash the trunk tensors' names, dtypes, shapes and bytes (``stats`` keys the in-memory cache)."""
    ckpt = Checkpoint(directory)
    names = trunk_tensor_names(ckpt, plan)
    digest = hashlib.blake2b(digest_size=16)
    dtypes: set[str] = set()
    with contextlib.ExitStack() as files:
        opened: dict[Path, Any] = {}
        for name in names:  # sorted: the order is canonical whatever the sharding
            path = ckpt.file_of(name)
            try:
                if path not in opened:
                    opened[path] = files.enter_context(safe_open(str(path), framework="pt"))
                tensor = opened[path].get_tensor(name).contiguous()
            except (SafetensorError, OSError) as exc:
                raise CheckpointError(f"{path} is not a readable safetensors file ({exc})") from None
            dtype = str(tensor.dtype).removeprefix("torch.")
            dtypes.add(dtype)
            digest.update(f"{name}\0{dtype}\0{tuple(tensor.shape)}\0".encode())
            digest.update(tensor.reshape(-1).view(torch.uint8).numpy().data)
    fingerprint = TrunkFingerprint(
        plan.trunk_layers.start, plan.trunk_layers.stop, "+".join(sorted(dtypes)), digest.hexdigest()
    )
    log.info("trunk fingerprint of %s (%s, %d tensors): %s", directory, fingerprint.layers, len(names), fingerprint)
    return fingerprint


def _read_cache(directory: Path) -> dict[str, Any]:
    path = side_file(directory, CACHE_FILE)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        log.warning("ignoring the unreadable trunk fingerprint cache %s (%s)", path, exc)
        return {}
    if not isinstance(raw, dict) or raw.get("format") != _CACHE_FORMAT or not isinstance(raw.get("entries"), dict):
        return {}
    entries: dict[str, Any] = raw["entries"]
    return entries


def _write_cache(directory: Path, entries: dict[str, Any]) -> None:
    """Write the cache atomically; a read-only directory is logged, not an error."""
    path = side_file(directory, CACHE_FILE)
    tmp: str | None = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=CACHE_FILE, dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump({"format": _CACHE_FORMAT, "entries": entries}, f, indent=1)
        os.replace(tmp, path)
    except OSError as exc:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        log.info("cannot cache the trunk fingerprint in %s (%s): it is recomputed at the next start", path, exc)
