"""Reports name files relative to a root when they lie inside it, never by this machine's absolute path."""

from __future__ import annotations

from pathlib import Path

import pytest

from splitspec.paths import display_path


def test_inside_the_root_is_relative(tmp_path: Path) -> None:
    assert display_path(tmp_path / "models" / "base", tmp_path) == "models/base"


def test_outside_the_root_is_shown_as_given(tmp_path: Path) -> None:
    other = tmp_path.parent / "elsewhere"
    assert display_path(other, tmp_path / "repo") == str(other)


def test_default_root_is_the_working_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert display_path(tmp_path / "out" / "report.json") == "out/report.json"
