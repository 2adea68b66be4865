"""Real ``splitspec`` commands and benchmark scripts, run as processes of their own that skip the import cost.

A ``splitspec`` process spends its first 3-5 s (more on a busy machine) importing torch and transformers, a
benchmark script 5-10 s. A fork server pays that once per test worker and environment: one interpreter imports the
command's modules (and what commands and scripts import next) and nothing else, then, for each batch of runs it is
sent, forks a child per run, all at once, and reports their exit statuses. A child is a fresh process from there
on: a command runs what the installed ``splitspec`` script runs, ``sys.exit(main())``, with its own argv; a script
runs as ``python benchmarks/<name>.py ARGS`` would (as ``__main__``, its folder first on ``sys.path``). Each has
its own stdin, stdout and stderr (files, redirected at the file-descriptor level, so whatever any library prints
lands there too), the caller's working directory and environment. An uncaught exception prints its traceback and
exits 1, argparse errors exit 2, ``sys.exit(n)`` exits n: what a user sees.

The environment is also the server's own: libraries read some variables once, at import (huggingface_hub's
``HF_ENDPOINT`` and ``HF_HUB_CACHE``), so runs with another environment get a server started with it.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

# What the commands and the scripts import after parsing their arguments (transformers' model code comes with them).
PRELOAD = (
    "splitspec.models.checkpoint",
    "splitspec.models.hub",
    "splitspec.edge.runtime",
    "splitspec.cloud.server",
    "splitspec.serve.server",
    "splitspec.demo",
    "splitspec.run_info",
    "transformers.models.llama.modeling_llama",
    "matplotlib",
    "numpy",
)
# Variables that differ from test to test but that no library reads at import: not a reason for another server
_PER_TEST = frozenset({"PYTEST_CURRENT_TEST"})
KEPT_SERVERS = 2  # servers kept per test process (environments differ: each test's HF cache is its own)

# The server: argv[1] is the JSON list of modules to preload, argv[2] and argv[3] the files that get what the
# start-up prints (every fresh `splitspec` process would print it first), argv[4] the file of its own later output.
# Each line on stdin is a batch of runs (JSON: script or null for the command, args, in/out/err files, cwd, env); for
# each batch it writes {"pids": [...]} once the children started and {"codes": [...]} once all ended, a line each.
_SERVER = r"""
import gc, importlib, json, os, runpy, sys


def to_file(fd, path, flags=os.O_WRONLY | os.O_CREAT | os.O_TRUNC):
    opened = os.open(path, flags, 0o600)
    os.dup2(opened, fd)
    os.close(opened)


replies = os.fdopen(os.dup(1), "w")
to_file(1, sys.argv[2])
to_file(2, sys.argv[3])
from splitspec.cli import build_parser, main

build_parser()  # the start-up every command shares: what main() does first, importing every subcommand's modules
for module in json.loads(sys.argv[1]):
    importlib.import_module(module)
gc.freeze()  # the children's garbage collector skips what is here already: exiting takes 0.1 s, not 1 s
sys.stdout.flush()
sys.stderr.flush()
to_file(1, os.devnull)  # from here on the server's own output (e.g. Python >= 3.12 warning that it forks with a
to_file(2, sys.argv[4])  # thread running: torch's import starts one) stays out of the runs' output
print(json.dumps({"ready": True}), file=replies, flush=True)
for line in sys.stdin:
    pids = []
    for run in json.loads(line):
        pid = os.fork()
        if pid == 0:  # the run's own process, from here on like a fresh one after its start-up
            os.setpgrp()  # a timeout stops it and whatever it started
            to_file(0, run["in"], os.O_RDONLY)
            to_file(1, run["out"])
            to_file(2, run["err"])
            sys.stdin = open(0, encoding="utf-8", closefd=False)  # no read-ahead of the server's requests
            os.chdir(run["cwd"])
            os.environ.clear()
            os.environ.update(run["env"])
            if run["script"] is None:
                sys.argv = ["splitspec", *run["args"]]
                sys.exit(main())  # an exception escapes to the interpreter: traceback on stderr, exit status 1
            sys.argv = [run["script"], *run["args"]]
            sys.path[0] = os.path.dirname(run["script"])
            runpy.run_path(run["script"], run_name="__main__")
            sys.exit(0)
        pids.append(pid)
    print(json.dumps({"pids": pids}), file=replies, flush=True)
    codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
    print(json.dumps({"codes": codes}), file=replies, flush=True)
"""


@dataclass(frozen=True)
class Run:
    """One process: ``splitspec *args`` (``script`` None) or ``python script *args``, with ``stdin`` as its input."""

    args: Sequence[str]
    script: Path | None = None
    stdin: str = ""


class _Server:
    """A fork server started with one environment."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self._folder = tempfile.TemporaryDirectory(prefix="splitspec-forkserver-")
        folder = Path(self._folder.name)
        self._start_out, self._start_err, self._err = folder / "start.out", folder / "start.err", folder / "server.err"
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-c",
                _SERVER,
                json.dumps(PRELOAD),
                *map(str, (self._start_out, self._start_err, self._err)),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=dict(env),
            start_new_session=True,
        )
        self._reply(None)  # ready

    def _reply(self, timeout: float | None) -> dict[str, list[int]]:
        stdout: IO[str] | None = self.process.stdout
        assert stdout is not None
        if timeout is not None and not select.select([stdout], [], [], max(timeout, 0.0))[0]:
            raise TimeoutError
        line = stdout.readline()
        if not line:
            err = [self._start_err.read_text() if self._start_err.is_file() else ""]
            err.append(self._err.read_text() if self._err.is_file() else "")
            raise RuntimeError(f"the fork server ended ({self.process.wait()}): {' '.join(err)[-3000:]}")
        reply: dict[str, list[int]] = json.loads(line)
        return reply

    def run(
        self, runs: Sequence[Run], env: Mapping[str, str], timeout: float | None
    ) -> list[subprocess.CompletedProcess[str]]:
        with tempfile.TemporaryDirectory(prefix="splitspec-runs-") as name:
            folder = Path(name)
            batch = []
            for i, run in enumerate(runs):
                (folder / f"{i}.in").write_text(run.stdin)
                files = {key: str(folder / f"{i}.{key}") for key in ("in", "out", "err")}
                script = None if run.script is None else str(run.script)
                batch.append({"script": script, "args": list(run.args), **files, "cwd": os.getcwd(), "env": dict(env)})
            assert self.process.stdin is not None
            self.process.stdin.write(json.dumps(batch) + "\n")
            self.process.stdin.flush()
            pids = self._reply(None)["pids"]
            try:
                codes = self._reply(timeout)["codes"]
            except TimeoutError:
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(pid, signal.SIGKILL)
                self._reply(None)  # the server saw them end
                raise subprocess.TimeoutExpired([str(r.script or "splitspec") for r in runs], timeout or 0.0) from None
            start_out, start_err = self._start_out.read_text(), self._start_err.read_text()
            return [
                subprocess.CompletedProcess(
                    ["splitspec" if run.script is None else str(run.script), *run.args],
                    code,
                    (start_out if run.script is None else "") + (folder / f"{i}.out").read_text(),
                    (start_err if run.script is None else "") + (folder / f"{i}.err").read_text(),
                )
                for i, (run, code) in enumerate(zip(runs, codes, strict=True))
            ]

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        self._folder.cleanup()


_lock = threading.Lock()
_servers: OrderedDict[tuple[tuple[str, str], ...], _Server] = OrderedDict()


def _stop_all() -> None:
    for server in _servers.values():
        server.stop()
    _servers.clear()


atexit.register(_stop_all)


def run_forked(
    runs: Sequence[Run], env: Mapping[str, str] | None = None, timeout: float | None = 600
) -> list[subprocess.CompletedProcess[str]]:
    """Run ``runs`` at once, each a process of its own, in ``env`` (default: this process's environment)."""
    environment = dict(os.environ if env is None else env)
    key = tuple(sorted((k, v) for k, v in environment.items() if k not in _PER_TEST))
    with _lock:
        server = _servers.pop(key, None)
        if server is None or server.process.poll() is not None:
            server = _Server(environment)
        _servers[key] = server  # the most recently used last
        while len(_servers) > KEPT_SERVERS:
            _servers.popitem(last=False)[1].stop()
        return server.run(runs, environment, timeout)
