"""Several ``splitspec`` command lines run as real processes that share one interpreter start-up.

Every ``splitspec`` process spends its first 3-5 s (more on a busy machine) importing torch and
transformers before it does anything. ``run_commands`` pays that once: one interpreter imports the
command's module and nothing else, then forks a child per command line, and each child runs what
the installed ``splitspec`` script runs, ``sys.exit(main())``, with its own argv and its own stdin,
stdout and stderr (files, redirected at the file-descriptor level, so whatever any library prints
lands there too). A child's exit status and output are therefore what a user of the command sees:
an uncaught exception prints its traceback and exits 1, argparse errors exit 2, a warning printed
at any point is in stderr. The children run at the same time; the environment is the caller's.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

# The modules nearly every command imports after parsing its arguments (transformers' model code comes with them).
PRELOAD = (
    "splitspec.models.checkpoint",
    "splitspec.models.hub",
    "splitspec.edge.runtime",
    "splitspec.cloud.server",
    "splitspec.serve.server",
    "transformers.models.llama.modeling_llama",
)

# Runs in the shared interpreter: argv[1] is the JSON list of argument lists, argv[2] the folder that holds each
# command's stdin (i.in) and gets its stdout and stderr (i.out, i.err) and the exit statuses (codes.json), argv[3]
# the JSON list of the modules to preload (PRELOAD).
# What the start-up prints (start.out, start.err) is what every fresh `splitspec` process would print first.
_FORKER = r"""
import gc, importlib, json, os, sys

_PRELOAD = json.loads(sys.argv[3])

commands, folder = json.loads(sys.argv[1]), sys.argv[2]


def to_file(fd, name, flags=os.O_WRONLY | os.O_CREAT | os.O_TRUNC):
    opened = os.open(os.path.join(folder, name), flags, 0o600)
    os.dup2(opened, fd)
    os.close(opened)


to_file(1, "start.out")
to_file(2, "start.err")
from splitspec.cli import build_parser, main

build_parser()  # the start-up every command shares: what main() does first, importing every subcommand's modules
# and what the commands import next (the checkpoint loader, the edge, the trunk and HTTP servers: transformers'
# model code behind them), which each child would otherwise import again on its own: 4-7 s of CPU apiece
for module in _PRELOAD:
    importlib.import_module(module)
gc.freeze()  # the children's garbage collector skips what is here already: exiting takes 0.1 s, not 1 s of page copies
sys.stdout.flush()
sys.stderr.flush()
to_file(1, "forker.out")  # from here on the forker's own output (e.g. Python >= 3.12 warning that it forks with
to_file(2, "forker.err")  # a thread running: torch's import starts one) stays out of the commands' output
children = []
for i, args in enumerate(commands):
    pid = os.fork()
    if pid == 0:  # the command's own process, from here on like a fresh `splitspec ARGS` after its start-up
        to_file(0, f"{i}.in", os.O_RDONLY)
        to_file(1, f"{i}.out")
        to_file(2, f"{i}.err")
        sys.argv = ["splitspec", *args]
        sys.exit(main())  # an exception escapes to the interpreter: traceback on stderr, exit status 1
    children.append(pid)
with open(os.path.join(folder, "codes.json"), "w") as f:
    json.dump([os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in children], f)
"""


def run_commands(
    commands: Sequence[Sequence[str]],
    inputs: Sequence[str] | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float = 600,
) -> list[subprocess.CompletedProcess[str]]:
    """Run ``splitspec *args`` for each of ``commands`` at once; ``inputs`` are their stdin texts (default empty)."""
    texts = list(inputs) if inputs is not None else [""] * len(commands)
    if len(texts) != len(commands):
        raise ValueError("one input per command")
    with tempfile.TemporaryDirectory(prefix="splitspec-commands-") as name:
        folder = Path(name)
        for i, text in enumerate(texts):
            (folder / f"{i}.in").write_text(text)
        forker = subprocess.Popen(
            [sys.executable, "-c", _FORKER, json.dumps([list(c) for c in commands]), name, json.dumps(PRELOAD)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=None if env is None else dict(env),
            start_new_session=True,  # its children too are stopped on a timeout
        )
        try:
            _, err = forker.communicate(timeout=timeout)
        finally:
            if forker.poll() is None or forker.returncode != 0:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(forker.pid, signal.SIGKILL)
                forker.wait()
        if forker.returncode != 0 or not (folder / "codes.json").is_file():
            logs = [err, *((folder / f).read_text() for f in ("start.err", "forker.err") if (folder / f).is_file())]
            raise RuntimeError(f"the command forker failed ({forker.returncode}): {' '.join(logs)}")
        codes: list[int] = json.loads((folder / "codes.json").read_text())
        start_out, start_err = (folder / "start.out").read_text(), (folder / "start.err").read_text()
        return [
            subprocess.CompletedProcess(
                ["splitspec", *args],
                code,
                start_out + (folder / f"{i}.out").read_text(),
                start_err + (folder / f"{i}.err").read_text(),
            )
            for i, (args, code) in enumerate(zip(commands, codes, strict=True))
        ]
