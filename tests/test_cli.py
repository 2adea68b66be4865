"""The command line, as a user runs it: real processes on loopback."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from splitspec.demo import free_port
from splitspec.models import trunk_fingerprint as tf
from splitspec.models.checkpoint import Checkpoint
from splitspec.models.split import SplitPlan
from tests.commands import run_commands
from tests.conftest import local_greedy

CLI = [sys.executable, "-m", "splitspec.cli"]
pytestmark = pytest.mark.slow  # every test here runs the command in a subprocess


def wait_for_port(port: int, proc: subprocess.Popen[str], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited early: {proc.stderr.read() if proc.stderr else ''}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"nothing listening on {port}")


@contextmanager
def cloud_server(model: Path, token_file: Path) -> Iterator[tuple[int, subprocess.Popen[str]]]:
    """``splitspec cloud serve`` of ``model``, stopped with SIGTERM on leaving."""
    port = free_port()
    proc = subprocess.Popen(
        [*CLI, "cloud", "serve", "--model", str(model), "--port", str(port), "--token-file", str(token_file)],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for_port(port, proc)
        yield port, proc
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


@pytest.fixture
def cloud(
    make_checkpoint: Callable[..., Path], tmp_path: Path
) -> Iterator[tuple[Path, int, Path, subprocess.Popen[str]]]:
    """A server of the test's own: the test may stop it and read its log."""
    model = make_checkpoint("llama")
    token_file = tmp_path / "token"
    token_file.write_text("hunter2\n")
    with cloud_server(model, token_file) as (port, proc):
        yield model, port, token_file, proc


@pytest.fixture(scope="module")
def shared_cloud(
    make_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Path, int, Path]]:
    """One server for the tests that only connect to it (each opens sessions of its own)."""
    model = make_checkpoint("llama")
    token_file = tmp_path_factory.mktemp("shared-cloud") / "token"
    token_file.write_text("hunter2\n")
    with cloud_server(model, token_file) as (port, _):
        yield model, port, token_file


def edge_args(command: str, model: Path, port: int, *extra: str) -> list[str]:
    """The arguments of a ``splitspec generate`` / ``chat`` against the fixture's server."""
    return [command, "--model", str(model), "--cloud", f"ws://127.0.0.1:{port}", *extra]


def test_generate_json_matches_local_greedy(cloud: tuple[Path, int, Path, subprocess.Popen[str]]) -> None:
    model, port, token_file, proc = cloud
    prompt = "to be or not to be"
    common = ["--prompt", prompt, "--max-new-tokens", "8", "--token-file", str(token_file)]
    common.append("--allow-stock-edge-weights")
    out, plain = run_commands(
        [edge_args("generate", model, port, *common, "--json"), edge_args("generate", model, port, *common)],
        timeout=300,
    )
    assert out.returncode == plain.returncode == 0, out.stderr + plain.stderr
    result = json.loads(out.stdout)
    ids = AutoTokenizer.from_pretrained(model).encode(prompt)
    assert result["token_ids"] == local_greedy(model, ids, 8)
    assert isinstance(result["text"], str)
    step = result["steps"][-1]
    # --speculate auto (the default) may verify several tokens per step: hidden states are 64 floats each
    assert step["query_tokens"] >= 1
    assert step["bytes_up"] > 64 * 4 * step["query_tokens"]
    assert step["cloud_ms"] > 0
    assert "STOCK public edge weights" in out.stderr  # allowed, but never silently
    assert plain.stdout.strip() == result["text"].strip()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    log = proc.stderr.read() if proc.stderr else ""
    opened = [line.split("session ")[1].split()[0] for line in log.splitlines() if "opened (" in line]
    closed = [line.split("session ")[1].split()[0] for line in log.splitlines() if "closed (" in line]
    assert len(opened) == 2
    assert sorted(opened) == sorted(closed)


def test_generate_over_the_int8_and_bf16_wires(shared_cloud: tuple[Path, int, Path]) -> None:
    """``--wire-codec`` reaches the Hello: the prefill's hidden states shrink to the codec's bytes per token."""
    model, port, token_file = shared_cloud
    common = ["--prompt", "to be or not to be " * 8, "--max-new-tokens", "2", "--token-file", str(token_file)]
    common += ["--allow-stock-edge-weights", "--speculate", "off", "--json"]
    runs = run_commands(
        [edge_args("generate", model, port, *common, "--wire-codec", c) for c in ("raw", "bf16", "int8")]
    )
    assert all(r.returncode == 0 for r in runs), [r.stderr for r in runs]
    prefill = [json.loads(r.stdout)["steps"][0] for r in runs]
    q = prefill[0]["query_tokens"]
    assert [p["query_tokens"] for p in prefill] == [q] * 3
    # H = 64 float32: raw 256 bytes per token, bf16 128, int8 64 + 8 scales + 8 outliers: 104
    saved = [prefill[0]["bytes_up"] - p["bytes_up"] for p in prefill[1:]]
    assert abs(saved[0] - q * 128) < 200  # the headers differ by a few bytes
    assert abs(saved[1] - q * 152) < 400  # int8 describes three more tensors


def test_generate_errors_are_clear(shared_cloud: tuple[Path, int, Path], tmp_path: Path) -> None:
    model, port, token_file = shared_cloud
    wrong = tmp_path / "wrong"
    wrong.write_text("nope")
    base = edge_args("generate", model, port, "--prompt", "to be", "--allow-stock-edge-weights")
    pin = str(tf.trunk_fingerprint(Checkpoint(model), SplitPlan(6, 2, 2)))
    other = pin[:-4] + "0000"  # a trunk other than the one served
    cases = {  # what stderr must say; the commands run at once, each its own process (tests/commands.py)
        "AuthenticationFailed": [*base, "--token-file", str(wrong)],
        "leave no trunk": [*base, "--edge-layers", "3,3"],
        "HEAD,TAIL": [*base, "--edge-layers", "two"],
        "TransportError": edge_args("generate", model, 1, "--prompt", "to be", "--allow-stock-edge-weights"),
        "TrunkMismatch: the cloud serves another trunk than the pinned --trunk-fingerprint": [
            *base, "--token-file", str(token_file), "--trunk-fingerprint", other,
        ],
        "refusing to run stock public edge weights": base[:-1],  # stock weights, not allowed
    }  # fmt: skip
    for needle, out in zip(cases, run_commands(list(cases.values()), timeout=300), strict=True):
        assert out.returncode == 2, out.stderr
        assert needle in out.stderr, out.stderr
        assert "Traceback" not in out.stderr, out.stderr


CHAT_MODES = ["off", "auto"]  # --speculate of the chat tests


@pytest.fixture(scope="module")
def chats(shared_cloud: tuple[Path, int, Path]) -> dict[str, subprocess.CompletedProcess[str]]:
    """``splitspec chat --json`` of two turns then /quit, once per --speculate mode (at once)."""
    model, port, token_file = shared_cloud
    extra = ["--token-file", str(token_file), "--max-new-tokens", "6", "--json", "--allow-stock-edge-weights"]
    commands = [edge_args("chat", model, port, *extra, "--speculate", mode) for mode in CHAT_MODES]
    lines = "to be or not\nwhether tis nobler\n/quit\nnever read\n"
    return dict(zip(CHAT_MODES, run_commands(commands, inputs=[lines] * len(CHAT_MODES), timeout=300), strict=True))


@pytest.mark.parametrize("speculate", CHAT_MODES)
def test_chat_keeps_the_cache_across_turns(
    shared_cloud: tuple[Path, int, Path], chats: dict[str, subprocess.CompletedProcess[str]], speculate: str
) -> None:
    model = shared_cloud[0]
    out = chats[speculate]
    assert out.returncode == 0, out.stderr
    turns = [json.loads(line) for line in out.stdout.splitlines()]
    assert [t["turn"] for t in turns] == [1, 2]  # /quit stops before the third line
    first, second = turns
    assert second["sent_ids"][0] == first["token_ids"][-1]  # the carried token, not yet cached
    history = first["input_ids"] + first["token_ids"] + second["sent_ids"][1:]
    assert second["input_ids"] == history
    assert second["token_ids"] == local_greedy(model, history, 6)
    if speculate == "off":  # only the new tokens went up: the earlier turn stayed in the caches
        assert second["sent_tokens"] == len(second["sent_ids"]) + len(second["token_ids"]) - 1
