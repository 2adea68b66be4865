"""Model ids on the command line: ``--model org/name[@revision]`` from the local Hugging Face cache only.

:func:`resolve_model` turns what a user typed into a checkpoint directory. A path that exists stays
that path. Otherwise text shaped like a Hub repo id (``org/name``, optionally ``@revision``: a
branch, tag or commit) is looked up with ``huggingface_hub.snapshot_download(...,
local_files_only=True)``, in the cache huggingface_hub itself uses (``HF_HUB_CACHE``, else
``HF_HOME/hub``, else ``~/.cache/huggingface/hub``). Nothing is ever downloaded: a model that is
not there raises :class:`~splitspec.exceptions.ModelNotFound`, saying where it looked and how to
fetch it on a connected machine. A snapshot whose ``model.safetensors.index.json`` names shard
files that are absent (an interrupted download) is refused up front, naming them.

A snapshot folder is a farm of symlinks into the repo's ``blobs/``, shared by the revisions that
have the same files, so splitspec writes nothing into it: :func:`side_file` puts a file about a
checkpoint (the trunk fingerprint cache) beside the repo's ``snapshots/`` folder instead, one per
snapshot, where Hugging Face's own cache tools (``hf cache scan``) do not look.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from huggingface_hub import constants, snapshot_download
from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError
from huggingface_hub.utils._validators import validate_repo_id  # not re-exported by name in its stubs

from splitspec.exceptions import CheckpointError, ModelNotFound
from splitspec.models.checkpoint import INDEX_FILE

__all__ = ["model_label", "resolve_model", "side_file", "snapshot_repo"]

log = logging.getLogger(__name__)


def _repo_id(text: str) -> tuple[str, str | None] | None:
    """``org/name[@revision]`` -> (repo id, revision or None); None when ``text`` is not shaped like one."""
    repo_id, at, revision = text.partition("@")
    if repo_id.count("/") != 1 or (at and not revision):
        return None
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        return None
    return repo_id, revision or None


def resolve_model(text: str) -> Path:
    """The checkpoint directory ``text`` names: an existing path, else a cached Hub snapshot (never downloaded)."""
    path = Path(text).expanduser()
    parsed = _repo_id(text)
    if path.exists() or parsed is None:
        return path  # a path, existing or not: the checkpoint loader says what it lacks
    repo_id, revision = parsed
    cache = Path(constants.HF_HUB_CACHE)
    fetch = f"hf download {repo_id}" + (f" --revision {revision}" if revision else "")
    try:
        folder = snapshot_download(repo_id, revision=revision, local_files_only=True)
    except LocalEntryNotFoundError as exc:
        incomplete = getattr(exc, "snapshot_path", None)
        if incomplete is not None:  # huggingface_hub knows the tree: some of its files never arrived
            raise CheckpointError(
                f"{text}: the cached snapshot {incomplete} is incomplete ({str(exc).splitlines()[0]}); "
                f"on a connected machine run `{fetch}` (or `huggingface-cli download {repo_id}`) to complete it"
            ) from None
        raise ModelNotFound(
            f"{text}: no such directory, and no snapshot of {repo_id}"
            f"{f' at revision {revision}' if revision else ''} in the Hugging Face cache {cache} (set by "
            f"HF_HUB_CACHE or HF_HOME); nothing is downloaded here: on a connected machine run `{fetch}` "
            f"(or `huggingface-cli download {repo_id}`) and copy its cache folder models--"
            f"{repo_id.replace('/', '--')} into {cache}, or pass the checkpoint's directory"
        ) from None
    snapshot = Path(str(folder))
    check_shards(snapshot, text)
    log.debug("model %s: the cached snapshot %s", text, snapshot)  # the command logs it at INFO
    return snapshot


def check_shards(snapshot: Path, name: str) -> None:
    """Refuse a snapshot whose shard index names files it lacks (a dangling symlink counts as absent)."""
    index = snapshot / INDEX_FILE
    if not index.is_file():
        return
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{name}: {index} is not a valid shard index ({exc})") from None
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise CheckpointError(f"{name}: {index} has no weight_map of tensor names to file names")
    shards = sorted(set(weight_map.values()))
    missing = [f for f in shards if not (snapshot / f).is_file()]
    if missing:
        raise CheckpointError(
            f"{name}: the cached snapshot {snapshot} lacks {len(missing)} of the {len(shards)} shards its index "
            f"names ({', '.join(missing)}): the download was interrupted; complete it on a connected machine"
        )


def snapshot_repo(directory: Path) -> tuple[Path, str] | None:
    """(the repo's cache folder ``models--org--name``, the snapshot's name) when ``directory`` is a cached
    snapshot (``.../models--org--name/snapshots/<commit>``), else None."""
    directory = directory.absolute()
    snapshots = directory.parent
    if snapshots.name == "snapshots" and snapshots.parent.name.startswith("models--"):
        return snapshots.parent, directory.name
    return None


def side_file(directory: Path, name: str) -> Path:
    """Where splitspec keeps its file ``name`` about the checkpoint in ``directory``: inside it, or for a
    cached snapshot beside the repo's ``snapshots/`` folder as ``name`` with the snapshot's name added."""
    repo = snapshot_repo(directory)
    if repo is None:
        return directory / name
    folder, snapshot = repo
    stem, dot, ext = name.rpartition(".")
    return folder / (f"{stem}.{snapshot}{dot}{ext}" if stem else f"{name}.{snapshot}")


def model_label(directory: Path) -> str:
    """A checkpoint's name for people: ``org/name`` for a cached snapshot, else its directory's name."""
    repo = snapshot_repo(directory)
    if repo is None:
        return directory.resolve().name
    return repo[0].name.removeprefix("models--").replace("--", "/", 1)
