"""The ``splitspec netem`` subcommand: argument parsing and a stand-alone end-to-end run."""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from splitspec.netem.cli import build_config, parse_hostport, register, run


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitspec")
    register(parser.add_subparsers(dest="command", required=True))
    return parser


def test_parse_hostport() -> None:
    assert parse_hostport("127.0.0.1:9000") == ("127.0.0.1", 9000)
    assert parse_hostport("[::1]:8765") == ("::1", 8765)
    assert parse_hostport("localhost:0", allow_zero_port=True) == ("localhost", 0)
    for bad in ("9000", ":9000", "host:", "host:x", "host:70000", "host:0"):
        with pytest.raises(ValueError, match=r"HOST:PORT|port must be"):
            parse_hostport(bad)


def test_arguments_build_config() -> None:
    args = _parser().parse_args(
        [
            "netem",
            "--listen",
            "127.0.0.1:9000",
            "--upstream",
            "127.0.0.1:8765",
            "--rtt-ms",
            "80",
            "--jitter-ms",
            "5",
            "--bandwidth-mbit",
            "100",
            "--seed",
            "3",
        ]
    )
    assert args.run is run
    cfg = build_config(args)
    assert (cfg.listen_host, cfg.listen_port) == ("127.0.0.1", 9000)
    assert (cfg.upstream_host, cfg.upstream_port) == ("127.0.0.1", 8765)
    assert cfg.rtt_ms == 80.0
    assert cfg.jitter_ms == 5.0
    assert cfg.seed == 3
    assert cfg.bandwidth_bps == pytest.approx(100e6)
    default = build_config(_parser().parse_args(["netem", "--upstream", "127.0.0.1:1"]))
    assert default.bandwidth_bps is None
    assert default.rtt_ms == 0.0


def test_bad_values_are_rejected() -> None:
    with pytest.raises(SystemExit):
        _parser().parse_args(["netem", "--upstream", "nonsense"])
    args = _parser().parse_args(["netem", "--upstream", "127.0.0.1:1", "--rtt-ms", "-5"])
    assert run(args) == 2


@pytest.mark.slow
def test_standalone_module_end_to_end() -> None:
    with socket.socket() as listener:  # a one-shot echo upstream
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        upstream = listener.getsockname()[1]
        env = dict(os.environ)
        src = str(Path(__file__).resolve().parents[2] / "src")
        env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
        cmd = [sys.executable, "-m", "splitspec.cli", "netem", "--listen", "127.0.0.1:0"]
        cmd += ["--upstream", f"127.0.0.1:{upstream}", "--rtt-ms", "30"]
        proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
        try:
            assert proc.stderr is not None
            port = None
            for line in proc.stderr:
                match = re.search(r"listening on 127\.0\.0\.1:(\d+)", line)
                if match:
                    port = int(match.group(1))
                    break
            assert port is not None
            with socket.create_connection(("127.0.0.1", port), timeout=10.0) as client:
                listener.settimeout(10.0)
                conn, _ = listener.accept()
                with conn:
                    t0 = time.perf_counter()
                    client.sendall(b"ping")
                    assert conn.recv(4) == b"ping"
                    conn.sendall(b"pong")
                    assert client.recv(4) == b"pong"
                    assert time.perf_counter() - t0 >= 0.028
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=10.0) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            if proc.stderr is not None:
                proc.stderr.close()
