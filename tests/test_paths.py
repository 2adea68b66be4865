"""Reports name files relative to a root when they lie inside it, never by this machine's absolute path."""

from __future__ import annotations

from pathlib import Path

import pytest

from splitspec.paths import display_path


def test_inside_the_root_is_relative(tmp_path: Path) -> None:
    assert display_path(tmp_path / "models" / "base", tmp_path) == "models/base"


def test_outside_the_root_is_shown_as_given(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # a temporary folder below the home one would show as ~/...
    other = tmp_path.parent / "elsewhere"
    assert display_path(other, tmp_path / "repo") == str(other)


def test_default_root_is_the_working_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert display_path(tmp_path / "out" / "report.json") == "out/report.json"


SHA = "0123456789abcdef0123456789abcdef01234567"


def test_a_hub_cache_snapshot_is_named_by_its_id_and_commit(tmp_path: Path) -> None:
    """A model given by Hub id used to be written as ~/.cache/huggingface/hub/... with the home path in full."""
    hub = tmp_path / ".cache" / "huggingface" / "hub"
    snapshot = hub / "models--Qwen--Qwen2.5-0.5B" / "snapshots" / SHA
    blob = hub / "models--Qwen--Qwen2.5-0.5B" / "blobs" / "abc"
    snapshot.mkdir(parents=True)
    blob.parent.mkdir()
    blob.write_text("{}")
    (snapshot / "config.json").symlink_to(blob)  # as the Hub client lays a snapshot out
    root = tmp_path / "repo"
    assert display_path(snapshot, root) == "Qwen/Qwen2.5-0.5B@0123456789ab"
    assert display_path(str(snapshot) + "/", root) == "Qwen/Qwen2.5-0.5B@0123456789ab"
    assert display_path(snapshot / "config.json", root) == "Qwen/Qwen2.5-0.5B@0123456789ab/config.json"
    assert display_path(hub / "models--gpt2" / "snapshots" / SHA / "onnx" / "m.onnx", root) == (
        "gpt2@0123456789ab/onnx/m.onnx"
    )
    assert display_path(hub / "models--gpt2" / "snapshots" / "main", root).endswith("snapshots/main")  # not a commit


def test_below_the_home_directory_is_shown_from_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "home" / "someone"
    monkeypatch.setenv("HOME", str(home))
    assert display_path(home / "models" / "base", tmp_path / "repo") == "~/models/base"
    assert display_path(home / "repo" / "models" / "base", home / "repo") == "models/base"  # the root first
    assert display_path(tmp_path / "elsewhere", home) == str(tmp_path / "elsewhere")
