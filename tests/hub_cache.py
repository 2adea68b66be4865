"""A Hugging Face cache laid out by hand, as ``hf download`` leaves one: blobs, snapshot symlinks, refs."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"  # a snapshot's name is its commit hash


def add_to_cache(cache: Path, repo_id: str, checkpoint: Path, commit: str = COMMIT, ref: str | None = "main") -> Path:
    """Put ``checkpoint``'s files in ``cache`` as revision ``commit`` of ``repo_id`` (``ref`` pointing at it).

    Returns the snapshot folder: ``models--org--name/snapshots/<commit>``, each file a relative
    symlink into ``models--org--name/blobs/<sha256>``, as huggingface_hub writes them.
    """
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True)
    for source in sorted(checkpoint.iterdir()):
        if not source.is_file() or source.name.startswith("."):
            continue
        blob = repo / "blobs" / hashlib.sha256(source.read_bytes()).hexdigest()
        if not blob.exists():
            shutil.copyfile(source, blob)
        (snapshot / source.name).symlink_to(Path("..", "..", "blobs", blob.name))
    if ref is not None:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot
