"""The ``fed worker`` / ``fed generate`` commands: a worker process with a shared secret on loopback."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from splitspec.cli import main
from splitspec.demo import free_port


@pytest.fixture(scope="module")
def worker_url(make_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    token = tmp_path_factory.mktemp("tok") / "token"
    token.write_text("s3cret\n")
    port = free_port()
    model = make_checkpoint("llama", layers=2, logit_scale=6.0)
    cmd = [sys.executable, "-m", "splitspec.cli", "fed", "worker", "--model", str(model)]
    proc = subprocess.Popen(
        [*cmd, "--port", str(port), "--token-file", str(token)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    deadline = time.monotonic() + 120
    while True:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                break
        if proc.poll() is not None:
            pytest.fail(f"worker exited: {proc.stderr.read().decode() if proc.stderr else ''}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("the worker did not listen within 120 s")
        time.sleep(0.2)
    yield f"ws://127.0.0.1:{port}|{token}"
    proc.terminate()
    proc.wait(timeout=30)


@pytest.mark.slow
def test_generate_json_against_a_worker_process(
    worker_url: str, make_checkpoint: Callable[..., Path], capsys: pytest.CaptureFixture[str]
) -> None:
    url, token = worker_url.split("|")
    draft = make_checkpoint("llama", layers=1, logit_scale=6.0)
    args = ["fed", "generate", "--draft", str(draft), "--worker", url, "--worker", url, "--weights", "2,1"]
    args += ["--top-k", "5", "--gamma", "3", "--max-new-tokens", "9", "--prompt", "to be or not"]
    args += ["--temperature", "0.9", "--seed", "4", "--json", "--audit", "--token-file", token]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    ids = out["token_ids"]
    assert out["seed"] == 4
    eos = 1  # "</s>" in the tiny tokenizer
    assert len(ids) < 9, "this seed samples EOS before the length limit"
    assert ids[-1] == eos
    assert eos not in ids[:-1]  # generation stops at the first EOS
    assert out["summary"]["audit"]["violations"] == 0
    assert all(w["k"] == [5] * (r["drafted"] + 1) for r in out["rounds"] for w in r["workers"])
    # A limit of 5 with this seed: the run ends at the limit, before any EOS.
    short = [a if a != "9" else "5" for a in args]
    assert main(short) == 0
    cut = json.loads(capsys.readouterr().out)["token_ids"]
    assert len(cut) == 5
    assert eos not in cut


@pytest.mark.slow
def test_wrong_secret_is_refused(
    worker_url: str, make_checkpoint: Callable[..., Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    url, _ = worker_url.split("|")
    wrong = tmp_path / "wrong"
    wrong.write_text("nope")
    draft = make_checkpoint("llama", layers=1, logit_scale=6.0)
    args = ["fed", "generate", "--draft", str(draft), "--worker", url, "--token-file", str(wrong)]
    assert main(args) == 2
    assert "AuthenticationFailed" in caplog.text


def test_epsilon_scope_needs_a_target(make_checkpoint: Callable[..., Path], caplog: pytest.LogCaptureFixture) -> None:
    draft = make_checkpoint("llama", layers=1)
    args = ["fed", "generate", "--draft", str(draft), "--worker", "ws://127.0.0.1:9", "--epsilon-scope", "round"]
    assert main(args) == 2
    assert "--target-epsilon" in caplog.text
    assert main([*args[:-2], "--quant-budget", "0.9"]) == 2
    assert "--quant-budget" in caplog.text


def test_options_a_fixed_k_or_a_float_codec_ignores_are_refused(
    make_checkpoint: Callable[..., Path], caplog: pytest.LogCaptureFixture
) -> None:
    """--max-k caps adaptive K only, --quant-budget is the quantized codec's: both were accepted and ignored."""
    draft = make_checkpoint("llama", layers=1)
    args = ["fed", "generate", "--draft", str(draft), "--worker", "ws://127.0.0.1:9"]
    for extra in (["--max-k", "100"], ["--max-k", "100", "--top-k", "8"]):
        caplog.clear()
        assert main([*args, *extra]) == 2
        assert "--max-k caps adaptive K" in caplog.text
    caplog.clear()
    assert main([*args, "--prob-codec", "float16", "--quant-budget", "0.2"]) == 2
    assert "--quant-budget applies to the quantized codec" in caplog.text
    # allowed: the cap with adaptive K, the default cap given explicitly, a budget for the quantized codec (the
    # run then fails for want of a worker at port 9)
    for extra in (
        ["--max-k", "100", "--target-epsilon", "0.1"],
        ["--max-k", "4096", "--top-k", "8"],
        ["--quant-budget", "0.2"],
    ):
        caplog.clear()
        assert main([*args, *extra]) == 2
        assert "TransportError" in caplog.text
        assert "ConfigError" not in caplog.text


def test_a_temperature_the_workers_refuse_is_refused_at_once(
    make_checkpoint: Callable[..., Path], caplog: pytest.LogCaptureFixture
) -> None:
    """--temperature 150 ended in "every worker failed this round": the workers refuse T > 100."""
    draft = make_checkpoint("llama", layers=1)
    args = ["fed", "generate", "--draft", str(draft), "--worker", "ws://127.0.0.1:9", "--temperature", "150"]
    assert main(args) == 2
    assert "ConfigError: --temperature must be at most 100" in caplog.text
