"""``splitspec demo`` as a user runs it: output, and no child process left behind."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from splitspec.demo import ASSETS

CLI = [sys.executable, "-m", "splitspec.cli"]
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (ASSETS / "models" / "base" / "config.json").is_file(), reason="embedded models not built"),
]


def ports_of(output: str) -> tuple[int, int]:
    match = re.search(r"trunk server on :(\d+), WAN emulator on :(\d+)", output)
    assert match, output
    return int(match.group(1)), int(match.group(2))


def survivors(ports: tuple[int, int]) -> list[str]:
    """Command lines of live processes that mention either port."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "splitspec.cli" in cmd and any(str(p) in cmd for p in ports):
            found.append(cmd)
    return found


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_demo_runs_end_to_end_and_cleans_up() -> None:
    out = subprocess.run(
        [*CLI, "demo", "--prompt", "KING HENRY.\nNow, lords, for France", "--max-new-tokens", "16", "--rtt-ms", "20"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    ports = ports_of(out.stdout)
    assert "tok/s" in out.stdout
    assert "network, ms" in out.stdout
    assert "bytes up" in out.stdout
    assert "16 tokens" in out.stdout or "<|eos|>" in out.stdout
    assert not survivors(ports)
    assert not listening(ports[0])
    assert not listening(ports[1])


def test_ctrl_c_stops_every_child() -> None:
    proc = subprocess.Popen(
        [*CLI, "demo", "--max-new-tokens", "2000", "--rtt-ms", "150", "--mode", "off"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    # log lines (e.g. the device choice) may come first on the merged stream
    first = proc.stdout.readline()
    while first and "trunk server on :" not in first:
        first = proc.stdout.readline()
    ports = ports_of(first)
    deadline = time.monotonic() + 120
    while not listening(ports[1]) and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(2.0)  # let generation start
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=60)
    time.sleep(0.5)
    assert not survivors(ports)
