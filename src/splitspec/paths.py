"""How reports name files: relative to a root (the working directory by default) when inside it.

Committed results must not carry one machine's absolute paths. A model the Hugging Face Hub
client downloaded (``.../models--org--name/snapshots/<commit>/...``, wherever the cache lies) is
named by its Hub id and revision, ``org/name@<commit[:12]>``; another path below the home
directory as ``~/...``; any other path outside the root as given, since no relative form would be
truer.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

__all__ = ["display_path"]

_HF_REPO = re.compile(r"models--(?P<id>[^/]+)")  # the Hub cache's folder of one model repository
_HF_COMMIT = re.compile(r"[0-9a-f]{40}")  # a snapshot folder: the revision's full commit hash
SHORT_COMMIT = 12  # hex digits of a snapshot's commit in its display name


def _hub_snapshot(parts: tuple[str, ...]) -> str | None:
    """``org/name@<commit>[/sub/path]`` for a path inside a Hub cache snapshot, else None."""
    for i in range(len(parts) - 2):
        repo = _HF_REPO.fullmatch(parts[i])
        if repo is not None and parts[i + 1] == "snapshots" and _HF_COMMIT.fullmatch(parts[i + 2]):
            name = repo["id"].replace("--", "/")
            return "/".join((f"{name}@{parts[i + 2][:SHORT_COMMIT]}", *parts[i + 3 :]))
    return None


def display_path(path: str | Path, root: Path | None = None) -> str:
    """``path`` relative to ``root`` (default: the working directory) when it lies below it; else a
    Hub cache snapshot as ``org/name@<commit>[/sub]``, a path below the home directory as ``~/...``,
    or ``path`` as given."""
    # not resolved: a snapshot's files are links into the cache's blobs, which name no model
    hub = _hub_snapshot(Path(os.path.abspath(path)).parts)
    if hub is not None:
        return hub
    resolved = Path(path).resolve()
    base = (root if root is not None else Path.cwd()).resolve()
    if resolved.is_relative_to(base):
        return str(resolved.relative_to(base))
    try:
        home = Path.home().resolve()
    except RuntimeError:  # no home directory to tell
        return str(path)
    if resolved.is_relative_to(home):
        return str(Path("~") / resolved.relative_to(home))
    return str(path)
