"""Where tensors live: one resolver for ``--device`` / ``--devices``, and the wire's host staging.

* :func:`resolve_device` turns ``auto``, ``cpu``, ``cuda``, ``cuda:N`` or ``mps`` into a
  :class:`torch.device`. ``auto`` picks CUDA, then MPS, then CPU, and logs its choice; a device
  this machine lacks raises :class:`~splitspec.exceptions.DeviceUnavailable` (one line from the
  CLI, exit status 2), never a silent fallback to the CPU.
* :func:`parse_devices` reads ``cuda:0,cuda:1,...`` and :func:`spread_layers` gives each device a
  contiguous share of a layer range (a trunk bigger than one accelerator).
* :class:`HostStaging` is the only place a step's hidden state crosses between the compute device
  and the host: once per step each way. Host buffers are page-locked where the device is CUDA and
  the host->device copy is non-blocking; on the CPU the same code runs as a host-to-host copy.
* :func:`compute_on_threads` says whether a server's forwards run on worker threads or on its event loop.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

import torch

from splitspec.device_choices import DEVICE_CHOICES, check_compute_on
from splitspec.exceptions import ConfigError, DeviceUnavailable

log = logging.getLogger(__name__)


def _cuda_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _mps_available() -> bool:
    return bool(torch.backends.mps.is_available())


def resolve_device(spec: str) -> torch.device:
    """The torch device named by ``spec`` (one of :data:`DEVICE_CHOICES`), checked against this machine."""
    text = spec.strip().lower()
    if text == "auto":
        if _cuda_count():
            device = torch.device("cuda", torch.cuda.current_device())
        elif _mps_available():
            device = torch.device("mps")
        else:
            device = torch.device("cpu")
        log.info("device auto: using %s", device)
        return device
    if text == "cpu":
        return torch.device("cpu")
    if text == "mps":
        if not _mps_available():
            raise DeviceUnavailable("device 'mps' requested but this machine has no usable MPS (Apple GPU) backend")
        return torch.device("mps")
    if text == "cuda" or text.startswith("cuda:"):
        index_text = text.partition(":")[2]
        if text != "cuda" and not index_text.isdigit():
            raise ConfigError(f"device {spec!r}: a CUDA device is 'cuda' or 'cuda:N' with N a number")
        count = _cuda_count()
        if count == 0:
            build = "a CPU-only build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}"
            raise DeviceUnavailable(
                f"device {spec!r} requested but CUDA is not available here (torch {torch.__version__}, {build})"
            )
        index = int(index_text) if index_text else torch.cuda.current_device()
        if index >= count:
            raise DeviceUnavailable(f"device {spec!r} requested but this machine has {count} CUDA device(s)")
        return torch.device("cuda", index)
    raise ConfigError(f"device {spec!r} is not one of {DEVICE_CHOICES}")


def parse_devices(text: str) -> tuple[torch.device, ...]:
    """``"cuda:0,cuda:1"`` -> the resolved devices, in order; each named at most once (``cpu`` may repeat)."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    if not names:
        raise ConfigError("--devices needs at least one device, e.g. cuda:0,cuda:1")
    if "auto" in (n.lower() for n in names):
        raise ConfigError("--devices names devices explicitly; 'auto' is for --device")
    devices = tuple(resolve_device(n) for n in names)
    accelerators = [d for d in devices if d.type != "cpu"]
    if len(set(accelerators)) != len(accelerators):
        raise ConfigError(f"--devices {text!r} names an accelerator twice")
    return devices


def spread_layers(layers: range, devices: Sequence[torch.device]) -> list[torch.device]:
    """The device of each layer of ``layers``: contiguous runs, as even as possible, first devices first."""
    if not devices:
        raise ConfigError("no device to place the layers on")
    if len(devices) > len(layers):
        raise ConfigError(f"{len(devices)} devices for {len(layers)} layers: each device needs at least one layer")
    share, extra = divmod(len(layers), len(devices))
    out: list[torch.device] = []
    for i, device in enumerate(devices):
        out.extend([device] * (share + (1 if i < extra else 0)))
    return out


class HostStaging:
    """Moves a step's tensors between ``device`` and the host: the wire's one crossing each way.

    ``to_host`` copies into a host buffer (page-locked next to CUDA); the copy is blocking, and it
    is the step's one host synchronisation: the result is needed to send it. ``to_device`` stages
    wire bytes in such a buffer and copies them to the device without blocking the host.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pinned = device.type == "cuda"  # page-locked host memory serves CUDA copies only

    def _host_buffer(self, like: torch.Tensor) -> torch.Tensor:
        return torch.empty(like.shape, dtype=like.dtype, pin_memory=self.pinned)

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host copy of ``tensor`` (waits for the kernels that produce it)."""
        out = self._host_buffer(tensor)
        out.copy_(tensor)
        return out

    def to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` (host, e.g. decoded wire bytes) on the compute device."""
        with torch.inference_mode():  # an inference tensor, like a step's every activation (one compiled graph)
            staged = self._host_buffer(tensor)
            staged.copy_(tensor)
            return staged.to(self.device, non_blocking=True)


def compute_on_threads(setting: str, devices: Iterable[torch.device]) -> bool:
    """Whether a server runs its forwards (and drafts) on worker threads (True) or on its event loop (False).

    ``setting`` is ``threads``, ``loop`` or ``auto``. On a CPU a forward is hundreds of short torch calls, and each
    releases the interpreter lock and takes it back: a worker thread then waits for the lock after every call
    while the event loop (or another worker) runs Python, the convoy effect. A 2-row edge head forward that
    took 1.7 ms alone took 12 ms beside a thread running Python, at a 50 us switch interval (595 ms at the
    default 5 ms), and two forwards on two threads each spent 1.4x the CPU of one (benchmarks/compute_on.py).
    So ``auto`` keeps the
    forwards on the loop when every device is a CPU. An accelerator's kernels run asynchronously, so there a
    worker thread leaves the loop free for I/O while the device computes: ``auto`` is threads when any
    device is not a CPU."""
    check_compute_on(setting)
    if setting != "auto":
        return setting == "threads"
    return any(device.type != "cpu" for device in devices)


def device_generator(device: torch.device, seed: int) -> torch.Generator:
    """A seeded random generator on ``device`` (sampling draws where the logits are)."""
    return torch.Generator(device=device).manual_seed(seed)


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (an accelerator's kernels run asynchronously): for timing only."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()
