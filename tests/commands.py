"""Several ``splitspec`` command lines run as real processes at once, forked from a server that paid the
interpreter's start-up (tests/forkserver.py): each child runs what the installed ``splitspec`` script runs,
``sys.exit(main())``, with its own argv, stdin, stdout and stderr, so its exit status and output are what a user
of the command sees."""

from __future__ import annotations

import subprocess
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor, Future

from tests.forkserver import Run, run_forked


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
    return run_forked([Run(args, stdin=text) for args, text in zip(commands, texts, strict=True)], env, timeout)


def start_command(runner: Executor, args: Sequence[str], timeout: float) -> Future[subprocess.CompletedProcess[str]]:
    """``splitspec *args`` started on ``runner`` (a long-running one: a server), a process of its own as in
    :func:`run_commands`; the future holds its exit status and output once it ends (killed past ``timeout`` s)."""
    return runner.submit(lambda: run_commands([args], timeout=timeout)[0])


def still_running(run: Future[subprocess.CompletedProcess[str]]) -> bool:
    """True while :func:`start_command`'s command runs; once it has ended, an AssertionError with its output."""
    if run.done():
        out = run.result()
        raise AssertionError(f"the command ended ({out.returncode}): {(out.stdout + out.stderr)[-3000:]}")
    return True
