"""Model ids (models/hub.py) in-process: what counts as an id, the shard check, where side files go.

The lookup in a real cache through the command line, with the Hub unreachable, is in
tests/test_cli_model_ids.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from splitspec.exceptions import CheckpointError
from splitspec.models import hub
from splitspec.models.checkpoint import INDEX_FILE
from tests.hub_cache import COMMIT, add_to_cache


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Qwen/Qwen3-8B", ("Qwen/Qwen3-8B", None)),
        ("org/name@main", ("org/name", "main")),
        (f"org/name@{COMMIT}", ("org/name", COMMIT)),
        ("org/name@", None),  # an empty revision is a typo, not the default branch
        ("gpt2", None),  # only org/name: a bare word is a directory
        ("/abs/path/model", None),
        ("a/b/c", None),
        ("./model", None),
        ("org/na me", None),  # not a valid repo name
        ("org/..", None),
    ],
)
def test_what_is_a_model_id(text: str, expected: tuple[str, str | None] | None) -> None:
    assert hub._repo_id(text) == expected


def test_an_existing_path_stays_a_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "org" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert hub.resolve_model("org/name") == Path("org/name")  # shaped like an id, but it is here
    assert hub.resolve_model(str(tmp_path / "missing")) == tmp_path / "missing"  # the loader names what lacks


def test_a_snapshot_missing_shards_is_refused_naming_them(make_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    snapshot = add_to_cache(tmp_path / "hub", "org/sharded", make_checkpoint("llama", sharded=True))
    shards = sorted(set(json.loads((snapshot / INDEX_FILE).read_text())["weight_map"].values()))
    assert len(shards) > 3
    hub.check_shards(snapshot, "org/sharded")  # complete: accepted
    (snapshot / shards[1]).unlink()  # never linked: the download stopped before it
    blob = (snapshot / shards[2]).resolve()
    blob.unlink()  # a dangling link: its blob is gone
    with pytest.raises(CheckpointError) as info:
        hub.check_shards(snapshot, "org/sharded")
    message = str(info.value)
    assert f"lacks 2 of the {len(shards)} shards" in message
    assert shards[1] in message
    assert shards[2] in message
    assert shards[0] not in message


def test_side_files_stay_out_of_snapshot_folders(make_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    snapshot = add_to_cache(tmp_path / "hub", "org/name", make_checkpoint("llama"))
    repo = tmp_path / "hub" / "models--org--name"
    assert hub.snapshot_repo(snapshot) == (repo, COMMIT)
    assert hub.side_file(snapshot, ".splitspec-x.json") == repo / f".splitspec-x.{COMMIT}.json"
    assert hub.model_label(snapshot) == "org/name"
    plain = make_checkpoint("llama")
    assert hub.snapshot_repo(plain) is None
    assert hub.side_file(plain, ".splitspec-x.json") == plain / ".splitspec-x.json"
    assert hub.model_label(plain) == plain.resolve().name
