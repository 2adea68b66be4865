"""The ``--device`` and ``--compute-on`` choices and help, importable without torch (the CLI parser needs them)."""

from __future__ import annotations

from splitspec.exceptions import ConfigError

DEVICE_CHOICES = "auto, cpu, cuda, cuda:N, mps"  # what ``--device`` takes, as an error message lists it
DEVICE_HELP = (
    "compute device: auto (CUDA, then MPS, then CPU), cpu, cuda, cuda:N or mps (default auto); "
    "model pieces, KV caches, masks and sampling live there, only the wire crosses to the host"
)
COMPUTE_ON_CHOICES = ("auto", "loop", "threads")
COMPUTE_ON_HELP = (
    "where the batched forwards and the draft model's proposals run: threads = worker threads, loop = the event "
    "loop (auto, the default: worker threads on an accelerator, whose kernels run while the loop does I/O; the loop "
    "on a CPU, where a worker thread waits for the interpreter lock after each torch call while the loop runs "
    "Python: a gateway at 16-32 streams on 2 cores delivered 1.11-1.14x the tokens per second, each for 0.81x the "
    "CPU)"
)


def check_compute_on(setting: str) -> None:
    """Refuse a ``--compute-on`` setting that is not one of :data:`COMPUTE_ON_CHOICES`."""
    if setting not in COMPUTE_ON_CHOICES:
        raise ConfigError(f"--compute-on must be one of {', '.join(COMPUTE_ON_CHOICES)}, got {setting!r}")
