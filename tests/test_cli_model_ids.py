"""``--model org/name[@revision]`` through the real command: read from the local Hugging Face cache only.

The cache is laid out by hand in a temp dir (tests/hub_cache.py: ``refs/``, ``snapshots/``,
``blobs/``), ``HF_HUB_OFFLINE`` is unset and the Hub endpoint points at a closed local port, so a
command that tried the network would fail with a connection error instead of what is asserted.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from splitspec.models.checkpoint import INDEX_FILE
from splitspec.models.trunk_fingerprint import CACHE_FILE
from tests.commands import run_commands
from tests.hub_cache import COMMIT, add_to_cache

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # subprocesses of the real command

CLOSED = "ws://127.0.0.1:9"  # nothing listens there: an edge that got as far as connecting fails on it


def offline_env(**hf: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}  # HF_HUB_OFFLINE among them
    return {**env, "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_DISABLE_TELEMETRY": "1", **hf}


def generate(model: str) -> list[str]:
    return ["generate", "--model", model, "--cloud", CLOSED, "--prompt", "to be", "--allow-stock-edge-weights"]


def last_line(stderr: str) -> str:
    """The error a command ended with (a loaded edge warns about stock weights first)."""
    assert "Traceback" not in stderr, stderr
    return [line for line in stderr.splitlines() if line.strip()][-1]


def one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert "Traceback" not in stderr, stderr
    assert len(lines) == 1, stderr
    return lines[0]


def test_model_ids_resolve_from_the_cache_and_missing_ones_exit_2(
    make_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    cache = tmp_path / "hub"
    snapshot = add_to_cache(cache, "org/tiny", make_checkpoint("llama"))
    add_to_cache(cache, "org/pinned", make_checkpoint("qwen2"), commit="f" * 40, ref=None)  # no refs: by commit only
    sharded = add_to_cache(cache, "org/sharded", make_checkpoint("llama", sharded=True))
    shards = sorted(set(json.loads((sharded / INDEX_FILE).read_text())["weight_map"].values()))
    (sharded / shards[-1]).unlink()
    demo = ["demo", "--model", "org/tiny", "--prompt", "to be or not", "--max-new-tokens", "6", "--rtt-ms", "0"]
    cases = [
        ["--log-level", "INFO", *demo, "--device", "cpu"],  # edge and trunk child from the cached snapshot
        ["--log-level", "WARNING", *generate(f"org/pinned@{'f' * 40}")],
        ["--log-level", "WARNING", *generate("org/missing")],
        ["--log-level", "WARNING", *generate("org/tiny@v2")],
        ["--log-level", "WARNING", "cloud", "serve", "--model", "org/sharded", "--port", "0"],
    ]
    ran, pinned, missing, no_revision, partial = run_commands(cases, env=offline_env(HF_HUB_CACHE=str(cache)))

    assert ran.returncode == 0, ran.stderr
    assert "tok/s" in ran.stdout
    assert f"INFO splitspec: --model org/tiny: the cached snapshot {snapshot}\n" in ran.stderr
    repo = cache / "models--org--tiny"
    assert (repo / f".splitspec-trunk-fingerprint.{COMMIT}.json").is_file()  # beside snapshots/, one per snapshot
    assert not [p.name for p in snapshot.iterdir() if p.name.startswith(".splitspec")]
    assert {p.name for p in repo.iterdir()} == {
        "blobs",
        "refs",
        "snapshots",
        f".splitspec-trunk-fingerprint.{COMMIT}.json",
    }

    assert pinned.returncode == 2, pinned.stderr  # resolved and loaded: it failed only at connecting
    assert "TransportError: cannot connect to ws://127.0.0.1:9" in last_line(pinned.stderr)

    line = one_line(missing.stderr)
    assert missing.returncode == 2
    expected = "ModelNotFound: org/missing: no such directory, and no snapshot of org/missing in the Hugging Face"
    assert f"{expected} cache {cache} (set by HF_HUB_CACHE or HF_HOME)" in line
    assert "`hf download org/missing`" in line
    assert "huggingface-cli download org/missing" in line

    line = one_line(no_revision.stderr)
    assert no_revision.returncode == 2
    assert "no snapshot of org/tiny at revision v2" in line
    assert "`hf download org/tiny --revision v2`" in line

    line = one_line(partial.stderr)
    assert partial.returncode == 2
    assert f"lacks 1 of the {len(shards)} shards its index names ({shards[-1]})" in line


def test_hf_home_locates_the_cache_as_huggingface_hub_does(
    make_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    """Without HF_HUB_CACHE the cache is HF_HOME/hub; a model directory given as a path is used as it is."""
    add_to_cache(tmp_path / "home" / "hub", "org/tiny", make_checkpoint("llama"))
    local = tmp_path / "org" / "tiny-copy"
    shutil.copytree(make_checkpoint("llama"), local)
    found, path = run_commands(
        [["--log-level", "WARNING", *generate("org/tiny")], ["--log-level", "WARNING", *generate(str(local))]],
        env=offline_env(HF_HOME=str(tmp_path / "home")),
    )
    for out in (found, path):
        assert out.returncode == 2, out.stderr
        assert "TransportError: cannot connect" in last_line(out.stderr)  # loaded; only the trunk was unreachable
    assert (local / CACHE_FILE).is_file()  # a plain directory keeps its fingerprint cache inside
