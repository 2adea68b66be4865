"""Errors a user can act on: exit status 2, one line on stderr, no traceback, no network attempt.

Every case runs the real ``splitspec`` command in a process of its own (all at once, forked from
one interpreter that paid the import cost: tests/commands.py), with the Hub endpoint pointed at a
closed local port: a command that tried the network would fail with a connection error instead
of the message asserted here.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.commands import run_commands

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # subprocesses of the real command


# `serve` binds its HTTP port before it loads the edge: the commands run at once, so each takes a free port
# (on the default 8000 one was refused because another still held it)
_ANY_PORT = ("--port", "0")


def generate(model: Path, *extra: str) -> list[str]:
    return [
        "generate", "--model", str(model), "--cloud", "ws://127.0.0.1:9", "--prompt", "to be",
        "--allow-stock-edge-weights", *extra,
    ]  # fmt: skip


def copy_of(model: Path, tmp_path: Path, name: str) -> Path:
    target = tmp_path / name
    shutil.copytree(model, target)
    return target


def with_config(model: Path, **changes: object) -> Path:
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, **changes}))
    return model


def test_errors_are_one_line_exit_2_without_network(make_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    model = make_checkpoint("llama")
    broken = copy_of(model, tmp_path, "broken-config")
    (broken / "config.json").write_text('{"model_type": "llama",')
    no_tokenizer = copy_of(model, tmp_path, "no-tokenizer")
    for f in no_tokenizer.glob("tokenizer*"):
        f.unlink()
    truncated = copy_of(model, tmp_path, "truncated")
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 3])
    gptq = with_config(copy_of(model, tmp_path, "gptq"), quantization_config={"quant_method": "gptq", "bits": 4})
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    cases = {
        "config.json is missing": generate(tmp_path / "no" / "such" / "model"),
        "not valid JSON": generate(broken),
        "trust_remote_code": generate(
            with_config(copy_of(model, tmp_path, "remote"), auto_map={"AutoModelForCausalLM": "m.Custom"})
        ),
        "no_such_family": generate(with_config(copy_of(model, tmp_path, "unknown"), model_type="no_such_family")),
        "cannot load the tokenizer": generate(no_tokenizer),
        "exceeds the model's 4096 positions": generate(model, "--max-new-tokens", "5000"),
        "safetensors": ["cloud", "serve", "--model", str(truncated), "--port", "0"],
        f"cannot listen on 127.0.0.1:{port}": ["cloud", "serve", "--model", str(model), "--port", str(port)],
        "--batch-gather must be between 0 and 10": ["cloud", "serve", "--model", str(model), "--batch-gather", "-1"],
        "--trunk-sessions-per-connection must be at least 1": [
            "serve",
            "--model",
            str(model),
            "--cloud",
            "ws://127.0.0.1:9",
            "--allow-stock-edge-weights",
            "--trunk-sessions-per-connection",
            "0",
            *_ANY_PORT,
        ],
        "checkpoints quantized with gptq are not supported": ["cloud", "serve", "--model", str(gptq), "--port", "0"],
        # the HTTP server binds its port before the edge loads (uvicorn's own lines and exit 3 came after it)
        f"cannot listen on 127.0.0.1:{port}: Address already in use": [
            "serve",
            "--model",
            str(model),
            "--cloud",
            "ws://127.0.0.1:9",
            "--allow-stock-edge-weights",
            "--port",
            str(port),
        ],
        f"netem cannot listen on 127.0.0.1:{port}": [
            "netem",
            "--listen",
            f"127.0.0.1:{port}",
            "--upstream",
            "127.0.0.1:9",
        ],
        "cannot load TLS certificate": [
            "cloud",
            "serve",
            "--model",
            str(model),
            "--tls-cert",
            str(tmp_path / "no.pem"),
            "--tls-key",
            str(tmp_path / "no.key"),
        ],
        "--session-ttl must be positive": ["cloud", "serve", "--model", str(model), "--session-ttl", "0"],
        # serve read the tokenizer before the checkpoint was checked: a transformers traceback, exit 1
        "no-tokenizer: cannot load the tokenizer": [
            "serve",
            "--model",
            str(no_tokenizer),
            "--cloud",
            "ws://127.0.0.1:9",
            "--allow-stock-edge-weights",
            *_ANY_PORT,
        ],
        "such/serve is not a checkpoint directory": [
            "serve",
            "--model",
            str(tmp_path / "no" / "such" / "serve"),
            "--cloud",
            "ws://127.0.0.1:9",
            *_ANY_PORT,
        ],
        "--ray-cpus-per-replica needs --ray-replicas": [
            "cloud",
            "serve",
            "--model",
            str(model),
            "--ray-cpus-per-replica",
            "2",
        ],
    }
    env = {**os.environ, "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_DISABLE_TELEMETRY": "1"}
    env.pop("HF_HUB_OFFLINE", None)  # our code must not rely on it
    try:
        outs = run_commands([["--log-level", "WARNING", *args] for args in cases.values()], env=env, timeout=600)
    finally:
        busy.close()
    for needle, out in zip(cases, outs, strict=True):
        lines = [line for line in out.stderr.splitlines() if line.strip()]
        assert out.returncode == 2, out.stderr
        assert "Traceback" not in out.stderr, out.stderr
        assert len(lines) == 1, out.stderr
        assert needle in lines[0], lines[0]


def test_values_no_server_can_use_are_refused_by_the_parser(make_checkpoint: Callable[..., Path]) -> None:
    """Refused before anything loads, with argparse's usage line and exit 2: a port out of range (a traceback
    from bind, after the model loaded), zero threads (torch's RuntimeError), a zero message cap (the server then
    refused every edge) and a zero K cap (blamed on the workers)."""
    model = str(make_checkpoint("llama"))
    cases = {
        "argument --port: a port is 0 to 65535, got 70000": ["cloud", "serve", "--model", model, "--port", "70000"],
        "argument --threads: expected an integer >= 1, got 0": ["cloud", "serve", "--model", model, "--threads", "0"],
        "argument --max-message-mb: expected an integer >= 1, got 0": [
            "cloud", "serve", "--model", model, "--max-message-mb", "0",
        ],
        "argument --port: a port is 0 to 65535, got -1": ["fed", "worker", "--model", model, "--port", "-1"],
        "argument --max-k: expected an integer >= 1, got 0": [
            "fed", "generate", "--draft", model, "--worker", "ws://127.0.0.1:9", "--target-epsilon", "0.1",
            "--max-k", "0", "--prompt", "x",
        ],
        "argument --port: a port is 0 to 65535, got 65536": [
            "serve", "--model", model, "--cloud", "ws://127.0.0.1:9", "--port", "65536",
        ],
    }  # fmt: skip
    outs = run_commands([list(args) for args in cases.values()], timeout=300)
    for needle, out in zip(cases, outs, strict=True):
        assert out.returncode == 2, out.stderr
        assert "Traceback" not in out.stderr, out.stderr
        assert needle in out.stderr.splitlines()[-1], out.stderr
