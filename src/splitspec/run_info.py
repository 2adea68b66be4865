"""Where a measurement came from, and one compact file for a benchmark's runs.

Every benchmark result records :func:`run_environment`: the git commit it ran at (with a flag if
the working tree had uncommitted changes or new code files), the splitspec version and the versions of the
libraries that set the figures, the machine, and the start time. Per-run records go into one
gzip-compressed JSON-lines file per benchmark (:func:`write_jsonl_gz`) instead of one file per
run, so a re-run rewrites one file, not hundreds, and each line carries the commit and version.
:func:`resident_bytes` reads what a process holds in memory, for the benchmarks that watch it.
"""

from __future__ import annotations

import gzip
import json
import os
import platform
import subprocess
from collections.abc import Iterable, Iterator, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from splitspec import __version__

__all__ = ["git_commit", "read_jsonl_gz", "resident_bytes", "run_environment", "write_jsonl_gz"]

_REPO = Path(__file__).resolve().parents[2]  # the checkout, when installed from source (src/ layout)


def _git(*args: str, cwd: Path) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


# where a Python file not yet added to git still shapes a run: the package, the benchmarks and the scripts
# (pathspecs from the top of the checkout; ``*`` matches across ``/``: every .py file below each folder, but not
# the .gitignore'd ones)
_CODE_PATHSPECS = (":(top)src/*.py", ":(top)benchmarks/*.py", ":(top)scripts/*.py")


def git_commit(cwd: Path | None = None) -> str:
    """The commit checked out at ``cwd`` (default: this package's repository), ``+dirty`` if the
    tracked files differ from it or an untracked ``.py`` file lies under ``src/``, ``benchmarks/`` or
    ``scripts/`` (a run of a script not yet added), or ``"unknown"`` outside a git checkout (an installed wheel)."""
    if cwd is None and not (_REPO / "src" / "splitspec").is_dir():
        return "unknown"  # an installed copy: the enclosing directories are not this package's repository
    where = cwd or _REPO
    commit = _git("rev-parse", "HEAD", cwd=where)
    if not commit:
        return "unknown"
    dirty = _git("status", "--porcelain", "--untracked-files=no", cwd=where) or _git(
        "ls-files", "--others", "--exclude-standard", "--full-name", "--", *_CODE_PATHSPECS, cwd=where
    )
    return f"{commit}+dirty" if dirty else commit


def run_environment() -> dict[str, Any]:
    """Provenance of a measurement: commit, versions, machine and start time (UTC)."""
    import torch
    import transformers

    return {
        "commit": git_commit(),
        "splitspec": __version__,
        "started_utc": datetime.now(UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }


def resident_bytes(pid: int | str = "self") -> int:
    """Resident memory of process ``pid`` (default: this one), bytes, from Linux's ``/proc/PID/status``."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024  # the kernel reports kB
    raise RuntimeError(f"no VmRSS in /proc/{pid}/status")


def cpu_seconds(pid: int | str = "self") -> float:
    """CPU time process ``pid`` (default: this one) has used, user and system, seconds, from ``/proc/PID/stat``:
    a benchmark reads it before and after a load to tell how many cores each of its processes kept busy."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()  # the name may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime: fields 14 and 15


def write_jsonl_gz(path: Path, records: Iterable[Mapping[str, Any]], **stamp: Any) -> int:
    """Write ``records`` to ``path`` as gzip-compressed JSON lines, each updated with ``stamp``
    (e.g. ``commit=..., splitspec=...``); returns the number of lines. The gzip header carries no
    timestamp, so the same records give the same bytes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, filename="") as gz:
        for record in records:
            line = json.dumps({**record, **stamp}, separators=(",", ":"), sort_keys=True)
            gz.write(line.encode() + b"\n")
            n += 1
    return n


def read_jsonl_gz(path: Path) -> Iterator[dict[str, Any]]:
    """The records of a file written by :func:`write_jsonl_gz`, in order."""
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)
