"""Several ``splitspec`` command lines run as real processes at once, forked from a server that paid the
interpreter's start-up (tests/forkserver.py): each child runs what the installed ``splitspec`` script runs,
``sys.exit(main())``, with its own argv, stdin, stdout and stderr, so its exit status and output are what a user
of the command sees."""

from __future__ import annotations

import subprocess
from collections.abc import Mapping, Sequence

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
