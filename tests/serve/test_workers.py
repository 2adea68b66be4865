"""``splitspec serve --workers 2`` as a process: two engines on one port, answering alike, supervised."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from splitspec.demo import free_port
from splitspec.exceptions import ConfigError
from splitspec.serve.config import ServeConfig
from splitspec.serve.workers import Supervisor, claim_port, resolve_port, reuse_port_socket, watch_parent
from tests.commands import run_commands, start_command, still_running
from tests.serve.conftest import MODEL_NAME, Stack

PROMPTS = ["to be or not", "the quick brown", "once upon a time", "all the world"]


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    """One client for the requests here, each on a connection of its own (none is kept alive, so the kernel spreads
    them over the workers). ``httpx.get`` builds a client per request, and its TLS context from the CA bundle: ~80 ms
    of CPU a request, 17 s in all beside the workers starting."""
    with httpx.Client(limits=httpx.Limits(max_keepalive_connections=0)) as client:
        yield client


def worker_pids(http: httpx.Client, base: str, tries: int = 40) -> set[int]:
    """The pids that answer /health over ``tries`` fresh connections (the kernel spreads them)."""
    pids = set()
    for _ in range(tries):
        pids.add(int(http.get(f"{base}/health", timeout=5).json()["pid"]))
    return pids


def parent_of(pid: int) -> int:
    """The parent process of ``pid`` (Linux's /proc, as the workers' SO_REUSEPORT)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2 :].split()[1])  # after "pid (comm) state": the parent's pid


def wait_for_workers(
    http: httpx.Client, base: str, run: Future[subprocess.CompletedProcess[str]], count: int, timeout_s: float = 180
) -> set[int]:
    deadline = time.monotonic() + timeout_s
    while True:
        assert still_running(run)
        try:
            pids = worker_pids(http, base, 20)
            if len(pids) >= count:
                return pids
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"{count} workers did not come up"
        time.sleep(0.3)


def complete(http: httpx.Client, base: str, prompt: str) -> str:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 12, "temperature": 0}
    reply = http.post(f"{base}/v1/completions", json=body, timeout=60)  # a fresh connection each
    reply.raise_for_status()
    return str(reply.json()["choices"][0]["text"])


@pytest.mark.slow
def test_two_workers_share_a_port_answer_alike_and_are_restarted(
    stack: Stack, chat_model: Path, http: httpx.Client
) -> None:
    """Both workers answer (two pids behind one port); greedy completions through them equal the
    in-process server's; a worker SIGKILLed is replaced; SIGINT stops the lot with status 130."""
    alone = {p: complete(http, stack.base_url.removesuffix("/v1"), p) for p in PROMPTS}
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    args = ["--log-level", "WARNING", "serve", "--model", str(chat_model),
            "--cloud", f"ws://127.0.0.1:{stack.trunk_port}", "--served-model-name", MODEL_NAME,
            "--port", str(port), "--allow-stock-edge-weights", "--threads", "1", "--workers", "2"]  # fmt: skip
    supervisor = None
    with ThreadPoolExecutor(1) as runner:
        run = start_command(runner, args, timeout=290)  # pytest-timeout stops the test at 300 s
        try:
            pids = wait_for_workers(http, base, run, 2)
            assert len(pids) == 2
            supervisor = parent_of(min(pids))
            assert parent_of(max(pids)) == supervisor != os.getpid()  # the command's process started both
            assert supervisor not in pids  # the supervisor serves nothing itself
            with ThreadPoolExecutor(8) as pool:
                texts = list(pool.map(lambda p: complete(http, base, p), PROMPTS * 2))
            assert texts == [alone[p] for p in PROMPTS * 2]
            labels = set()  # each scrape reaches one worker; its samples say which
            for _ in range(40):
                page = http.get(f"{base}/metrics", timeout=5).text
                labels |= set(re.findall(r'^splitspec_serve_requests_total\{[^}]*worker="(\d+)"', page, re.MULTILINE))
            assert labels == {"0", "1"}
            killed = min(pids)
            os.kill(killed, signal.SIGKILL)
            deadline = time.monotonic() + 180
            while True:
                try:
                    now = worker_pids(http, base, 20)
                except httpx.TransportError:  # a connection the kernel had queued on the killed worker is reset
                    now = set()
                if len(now) == 2 and killed not in now:
                    break
                assert still_running(run)
                assert time.monotonic() < deadline, "the killed worker was not replaced"
                time.sleep(0.5)
            assert complete(http, base, PROMPTS[0]) == alone[PROMPTS[0]]
        finally:
            if supervisor is not None:  # else the run ends at its timeout
                os.kill(supervisor, signal.SIGINT)
        out = run.result()
    assert out.returncode == 130, out.stderr[-3000:]


@pytest.mark.slow
def test_a_worker_that_cannot_start_stops_the_supervisor(tmp_path: Path) -> None:
    """No model in the directory: the first worker fails while loading, and the supervisor exits 1
    instead of restarting it for ever."""
    port = free_port()
    (out,) = run_commands(
        [["--log-level", "WARNING", "serve", "--model", str(tmp_path), "--cloud", "ws://127.0.0.1:9",
          "--port", str(port), "--allow-stock-edge-weights", "--workers", "2"]],
        timeout=180,
    )  # fmt: skip
    assert out.returncode == 1, out.stderr
    assert "while starting" in out.stderr
    assert "restarting" not in out.stderr


def test_workers_share_one_port_and_refuse_one_taken_without_reuse() -> None:
    """Two SO_REUSEPORT sockets bind one port; a plain listener already on a port is a ConfigError."""
    port = resolve_port("127.0.0.1", 0)
    assert port > 0
    first, second = reuse_port_socket("127.0.0.1", port), reuse_port_socket("127.0.0.1", port)
    try:
        assert first.getsockname()[1] == second.getsockname()[1] == port
    finally:
        first.close()
        second.close()
    import socket

    plain = socket.create_server(("127.0.0.1", 0))
    try:
        with pytest.raises(ConfigError, match="cannot listen"):
            reuse_port_socket("127.0.0.1", plain.getsockname()[1])
    finally:
        plain.close()


def test_a_supervisor_needs_two_workers(chat_model: Path) -> None:
    from splitspec.edge import EdgeConfig

    config = ServeConfig(EdgeConfig(model_dir=chat_model, cloud_url="ws://127.0.0.1:9"), served_model_name="m")
    with pytest.raises(ConfigError, match="2 workers or more"):
        Supervisor(config, 1)


def test_a_second_supervisor_on_the_port_is_refused(chat_model: Path) -> None:
    """Every worker socket sets SO_REUSEPORT, so a second ``serve --workers`` on the port used to bind it silently
    and the kernel split the connections between two servers: the supervisor's claim on the port refuses it."""
    from splitspec.edge import EdgeConfig

    port = resolve_port("127.0.0.1", 0)
    held = claim_port(port)
    try:
        with pytest.raises(ConfigError, match=f"cannot listen on port {port}: another splitspec serve"):
            claim_port(port)
        config = ServeConfig(
            EdgeConfig(model_dir=chat_model, cloud_url="ws://127.0.0.1:9"), served_model_name="m", port=port
        )
        supervisor = Supervisor(config, 2)
        with pytest.raises(ConfigError, match="another splitspec serve"):
            supervisor.run()  # refused before it starts a worker
        assert supervisor._procs == [None, None]
        claim_port(port + 1 if port < 65535 else port - 1).close()  # another port is free to claim
    finally:
        held.close()
    claim_port(port).close()  # the claim ends with its holder


def test_a_worker_stops_when_its_supervisor_is_gone() -> None:
    """A worker watches its parent's sentinel, a pipe whose other end the parent holds: the end closes when the parent
    ends, however (a SIGKILLed supervisor used to leave its workers serving with ppid 1)."""
    read, write = os.pipe()
    gone = threading.Event()
    try:
        watch_parent(read, gone.set)
        assert not gone.wait(0.2)  # the parent lives
        os.close(write)  # the parent ends
        write = -1
        assert gone.wait(5)
    finally:
        os.close(read)
        if write >= 0:
            os.close(write)
