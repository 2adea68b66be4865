"""Run a script of ``benchmarks/`` (not a package) in a process of its own, or import it as a module for tests of
its pure parts.

A benchmark script spends its first 5-10 s importing torch, transformers, splitspec and its plotting libraries.
``run_script`` pays that once per test worker: one interpreter (the script server) imports them and nothing else,
then, for each run, forks a child that runs the script as ``python benchmarks/<name>.py ARGS`` would (as
``__main__``, with ``benchmarks/`` first on ``sys.path``, the caller's environment and working directory, its
output in files). The child's exit status and output are what a user of the script sees: an uncaught exception
prints its traceback and exits 1, ``sys.exit(n)`` exits n.
"""

from __future__ import annotations

import atexit
import importlib.util
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from types import ModuleType
from typing import IO

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"

# What the scripts import (the server imports each once; a child imports anything else itself).
PRELOAD = (
    "torch",
    "transformers",
    "matplotlib",
    "numpy",
    "splitspec.demo",
    "splitspec.models.checkpoint",
    "splitspec.edge.runtime",
    "splitspec.cloud.server",
    "splitspec.serve.server",
    "splitspec.run_info",
    "transformers.models.llama.modeling_llama",
)

# The script server: argv[1] is the JSON list of modules to preload. Each line on stdin is a run (JSON: script,
# args, env, cwd, out and err file paths); for each it writes {"pid": ...} when the child started and
# {"code": ...} when it ended, a line each, on the stdout it was started with.
_SERVER = r"""
import gc, importlib, json, os, runpy, sys

for module in json.loads(sys.argv[1]):
    importlib.import_module(module)
gc.freeze()  # the children's garbage collector skips what is here already
replies = os.fdopen(os.dup(1), "w")
null = os.open(os.devnull, os.O_RDWR)
os.dup2(null, 1)  # from here on the server's own output goes nowhere
for line in sys.stdin:
    run = json.loads(line)
    pid = os.fork()
    if pid == 0:  # the script's process
        os.setpgrp()  # a timeout stops it and whatever it started
        os.dup2(null, 0)
        for fd, path in ((1, run["out"]), (2, run["err"])):
            opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(opened, fd)
            os.close(opened)
        sys.stdin = open(os.devnull)
        os.chdir(run["cwd"])
        os.environ.clear()
        os.environ.update(run["env"])
        sys.argv = [run["script"], *run["args"]]
        sys.path[0] = os.path.dirname(run["script"])
        runpy.run_path(run["script"], run_name="__main__")
        sys.exit(0)  # an exception or sys.exit(n) in the script ends the process as it would a fresh one
    print(json.dumps({"pid": pid}), file=replies, flush=True)
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"code": os.waitstatus_to_exitcode(status)}), file=replies, flush=True)
"""


class _ScriptServer:
    """The script server of this test process, started on first use and stopped when the process exits."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._process: subprocess.Popen[str] | None = None

    def _started(self) -> subprocess.Popen[str]:
        if self._process is None or self._process.poll() is not None:
            self._process = subprocess.Popen(
                [sys.executable, "-c", _SERVER, json.dumps(PRELOAD)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            atexit.register(self._process.kill)
        return self._process

    def _reply(self, process: subprocess.Popen[str], timeout: float | None) -> dict[str, int]:
        stdout: IO[str] | None = process.stdout
        if stdout is None:  # pragma: no cover - Popen was asked for a pipe
            raise RuntimeError("the script server has no stdout")
        if timeout is not None and not select.select([stdout], [], [], max(timeout, 0.0))[0]:
            raise TimeoutError
        line = stdout.readline()
        if not line:
            err = process.stderr.read() if process.stderr is not None else ""
            raise RuntimeError(f"the script server ended ({process.wait()}): {err[-3000:]}")
        reply: dict[str, int] = json.loads(line)
        return reply

    def run(self, script: Path, args: list[str], timeout: float | None) -> subprocess.CompletedProcess[str]:
        with self._lock, tempfile.TemporaryDirectory(prefix="splitspec-script-") as folder:
            out, err = Path(folder) / "out", Path(folder) / "err"
            process = self._started()
            run = {"script": str(script), "args": args, "env": dict(os.environ), "cwd": os.getcwd()}
            assert process.stdin is not None
            process.stdin.write(json.dumps({**run, "out": str(out), "err": str(err)}) + "\n")
            process.stdin.flush()
            pid = self._reply(process, None)["pid"]
            try:
                code = self._reply(process, timeout)["code"]
            except TimeoutError:
                os.killpg(pid, signal.SIGKILL)
                self._reply(process, None)  # the server saw it end
                raise subprocess.TimeoutExpired(
                    [str(script), *args], timeout or 0.0, out.read_text(), err.read_text()
                ) from None
            return subprocess.CompletedProcess([str(script), *args], code, out.read_text(), err.read_text())


_SERVER_OF_THIS_PROCESS = _ScriptServer()


def load_script(filename: str, name: str) -> ModuleType:
    """``benchmarks/<filename>`` imported as module ``name``."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / filename)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def run_script(
    filename: str, args: list[str], timeout: float | None = None, returncodes: tuple[int, ...] = (0,)
) -> subprocess.CompletedProcess[str]:
    """``benchmarks/<filename> args`` in a process of its own; fails the test unless it exits with one of
    ``returncodes`` (with the tails of its output)."""
    run = _SERVER_OF_THIS_PROCESS.run(BENCHMARKS / filename, args, timeout)
    assert run.returncode in returncodes, (
        f"{filename} exited {run.returncode}:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    )
    return run
