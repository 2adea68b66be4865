"""Provenance of measurements and the compressed JSON-lines results file."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

import splitspec
from splitspec.run_info import (
    cpu_seconds,
    git_commit,
    read_jsonl_gz,
    resident_bytes,
    run_environment,
    write_jsonl_gz,
)


def test_jsonl_gz_round_trip_is_stamped_and_reproducible(tmp_path: Path) -> None:
    records: list[dict[str, Any]] = [{"run_id": "a", "tok_s": 1.5}, {"run_id": "b", "steps": [{"kind": "decode"}]}]
    first, second = tmp_path / "one" / "runs.jsonl.gz", tmp_path / "two.jsonl.gz"
    assert write_jsonl_gz(first, records, commit="abc", splitspec="9.9") == 2
    write_jsonl_gz(second, records, commit="abc", splitspec="9.9")
    assert first.read_bytes()[:2] == b"\x1f\x8b"  # gzip
    assert first.read_bytes() == second.read_bytes()  # no timestamp or name in the header
    assert list(read_jsonl_gz(first)) == [{**r, "commit": "abc", "splitspec": "9.9"} for r in records]


def test_git_commit_of_a_checkout_and_outside_one(tmp_path: Path) -> None:
    assert git_commit(tmp_path) == "unknown"
    repo = tmp_path / "repo"
    repo.mkdir()
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    (repo / "f").write_text("1")
    subprocess.run([*git, "add", "f"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "x"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    assert git_commit(repo) == head
    (repo / "f").write_text("2")
    assert git_commit(repo) == f"{head}+dirty"


def test_run_environment_names_commit_and_versions() -> None:
    env = run_environment()
    assert env["splitspec"] == splitspec.__version__
    assert env["commit"] == git_commit()
    assert {"torch", "transformers", "python", "started_utc"} <= set(env)


def test_resident_bytes_of_this_process_and_of_a_pid() -> None:
    here = resident_bytes()
    assert here > 1024 * 1024  # a Python process with torch imported holds megabytes
    assert abs(resident_bytes(os.getpid()) - here) < 64 * 1024 * 1024  # the same process, read twice
    with pytest.raises(FileNotFoundError):
        resident_bytes(2**31 - 1)  # no such process


def test_cpu_seconds_grow_with_the_work_a_process_does() -> None:
    before = cpu_seconds()
    deadline = time.process_time() + 0.3
    while time.process_time() < deadline:  # burn 0.3 s of CPU
        pass
    spent = cpu_seconds(os.getpid()) - before
    assert 0.2 <= spent < 5.0  # the kernel counts in clock ticks (10 ms)
    with pytest.raises(FileNotFoundError):
        cpu_seconds(2**31 - 1)  # no such process


def test_an_untracked_code_file_marks_the_commit_dirty(tmp_path: Path) -> None:
    """A run of a new script not yet added to git used to be recorded at a clean commit."""
    repo = tmp_path / "repo"
    (repo / "src" / "pkg").mkdir(parents=True)
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    (repo / "src" / "pkg" / "a.py").write_text("1")
    (repo / ".gitignore").write_text("scratch/\n*.ignored.py\n")
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "x"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    (repo / "notes.txt").write_text("not code")  # untracked, but neither code nor under a code folder
    (repo / "top.py").write_text("")  # a .py file outside src/, benchmarks/ and scripts/
    (repo / "benchmarks").mkdir()
    (repo / "benchmarks" / "data.json").write_text("{}")
    (repo / "scripts" / "scratch").mkdir(parents=True)
    (repo / "scripts" / "scratch" / "x.py").write_text("")  # ignored by .gitignore
    (repo / "scripts" / "old.ignored.py").write_text("")
    assert git_commit(repo) == head
    assert git_commit(repo / "src") == head
    new = repo / "benchmarks" / "deep" / "new_bench.py"  # in a new folder: status would show only "benchmarks/"
    new.parent.mkdir()
    new.write_text("")
    assert git_commit(repo) == f"{head}+dirty"
    assert git_commit(repo / "src") == f"{head}+dirty"  # from a subfolder, too
    new.unlink()
    (repo / "src" / "pkg" / "b.py").write_text("")
    assert git_commit(repo) == f"{head}+dirty"
