"""The device resolver, layer placement and host staging, on this machine's CPU."""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from splitspec.devices import (
    HostStaging,
    compute_on_threads,
    device_generator,
    parse_devices,
    resolve_device,
    spread_layers,
)
from splitspec.exceptions import ConfigError, DeviceUnavailable

CPU = torch.device("cpu")
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")


def test_cpu_and_auto(caplog: pytest.LogCaptureFixture) -> None:
    assert resolve_device("cpu") == CPU
    assert resolve_device(" CPU ") == CPU
    with caplog.at_level(logging.INFO, logger="splitspec.devices"):
        chosen = resolve_device("auto")
    expected = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    assert chosen.type == expected
    assert f"device auto: using {chosen}" in caplog.text


@no_cuda
@pytest.mark.parametrize("name", ["cuda", "cuda:0", "cuda:3"])
def test_cuda_without_cuda_is_a_typed_config_error(name: str) -> None:
    with pytest.raises(DeviceUnavailable, match="CUDA is not available") as info:
        resolve_device(name)
    assert isinstance(info.value, ConfigError)


@pytest.mark.skipif(torch.backends.mps.is_available(), reason="checks the refusal on a machine without MPS")
def test_mps_without_mps() -> None:
    with pytest.raises(DeviceUnavailable, match="MPS"):
        resolve_device("mps")


@pytest.mark.parametrize("name", ["gpu", "tpu", "cuda:x", "cuda:-1", "", "cpu:0"])
def test_unknown_names_are_refused(name: str) -> None:
    with pytest.raises(ConfigError):
        resolve_device(name)


def test_parse_devices() -> None:
    assert parse_devices("cpu,cpu") == (CPU, CPU)
    assert parse_devices(" cpu , cpu ,cpu") == (CPU, CPU, CPU)
    with pytest.raises(ConfigError, match="at least one"):
        parse_devices(" , ")
    with pytest.raises(ConfigError, match="auto"):
        parse_devices("auto,cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_an_accelerator_named_twice_is_refused() -> None:
    with pytest.raises(ConfigError, match="twice"):
        parse_devices("cuda:0,cuda:0")


def test_spread_layers_is_contiguous_and_balanced() -> None:
    a, b, c = torch.device("cuda", 0), torch.device("cuda", 1), torch.device("cuda", 2)
    assert spread_layers(range(2, 10), [a, b, c]) == [a, a, a, b, b, b, c, c]
    assert spread_layers(range(2, 4), [a]) == [a, a]
    assert spread_layers(range(0, 3), [a, b, c]) == [a, b, c]
    with pytest.raises(ConfigError, match="at least one layer"):
        spread_layers(range(2, 4), [a, b, c])
    with pytest.raises(ConfigError, match="no device"):
        spread_layers(range(2, 4), [])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_host_staging_round_trip_copies(dtype: torch.dtype) -> None:
    staging = HostStaging(CPU)
    assert not staging.pinned  # page-locked memory only next to CUDA
    x = torch.randn(1, 3, 8).to(dtype)
    host = staging.to_host(x)
    back = staging.to_device(host)
    assert host.device == CPU
    assert back.device == CPU
    assert host.dtype == dtype
    assert back.dtype == dtype
    assert torch.equal(host, x)
    assert torch.equal(back, x)
    # copies, never views: wire buffers are reused and the model must not see them change
    assert host.data_ptr() != x.data_ptr()
    assert back.data_ptr() != host.data_ptr()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_host_staging_on_cuda_pins_and_moves() -> None:
    staging = HostStaging(torch.device("cuda", 0))
    assert staging.pinned
    x = torch.randn(1, 3, 8, device="cuda")
    host = staging.to_host(x)
    assert host.device == CPU
    assert host.is_pinned()
    assert torch.equal(host, x.cpu())
    assert torch.equal(staging.to_device(host), x)


def test_device_generator_is_seeded_on_its_device() -> None:
    a = torch.rand(4, generator=device_generator(CPU, 3))
    b = torch.rand(4, generator=device_generator(CPU, 3))
    assert torch.equal(a, b)


@no_cuda
def test_cli_cuda_without_cuda_fails_in_one_line(make_checkpoint: Callable[..., Path]) -> None:
    """``--device cuda`` on a CPU machine: exit status 2, one error line naming the cause, no traceback."""
    model = make_checkpoint("llama")
    proc = subprocess.run(
        [sys.executable, "-m", "splitspec.cli", "cloud", "serve", "--model", str(model), "--device", "cuda"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert "DeviceUnavailable" in lines[0]
    assert "CUDA is not available" in lines[0]
    assert "Traceback" not in proc.stderr


def test_forwards_run_on_threads_for_an_accelerator_and_on_the_loop_for_a_cpu_unless_told() -> None:
    cpu, cuda, mps = torch.device("cpu"), torch.device("cuda", 0), torch.device("mps")
    assert compute_on_threads("auto", [cpu]) is False  # a CPU's forwards run on the event loop
    assert compute_on_threads("auto", [cuda]) is True
    assert compute_on_threads("auto", [mps]) is True
    assert compute_on_threads("auto", [cpu, cuda]) is True  # a trunk spread over a GPU and the CPU
    assert compute_on_threads("threads", [cpu]) is True
    assert compute_on_threads("loop", [cuda]) is False
    with pytest.raises(ConfigError, match="auto, loop, threads"):
        compute_on_threads("yes", [cpu])
