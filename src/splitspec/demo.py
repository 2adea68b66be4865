"""``splitspec demo``: the whole system on the embedded models, in one command.

Starts a trunk server and the WAN emulator as child processes on loopback, then streams a
generation from the edge through the emulated link, with live tok/s, and ends with the per-step
breakdown (network / edge / cloud / serialization, bytes each way). Children are stopped on exit,
Ctrl-C included, and are told by the kernel to stop if this process dies (no orphans).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from splitspec.decoding.sampling import SamplingParams
from splitspec.detokenize import IncrementalText
from splitspec.devices import resolve_device
from splitspec.edge import EdgeConfig, GenerationResult, SplitClient
from splitspec.exceptions import ConfigError, TransportError

log = logging.getLogger(__name__)

ASSETS = Path(__file__).parent / "assets"
SHOWCASE = (
    ("prose", "KING HENRY.\nNow, lords, for France; the enterprise whereof\n"),
    ("code", 'def read_config(path):\n    """Return the parsed configuration file."""\n    '),
)


def embedded_model(name: str) -> Path:
    """Directory of an embedded demo model (``base`` or ``draft``)."""
    path = ASSETS / "models" / name
    if not (path / "config.json").is_file():
        raise ConfigError(f"embedded model {name!r} is missing at {path}; reinstall splitspec")
    return path


@dataclass(frozen=True)
class DemoConfig:
    model_dir: Path  # split model (default: the embedded base model)
    draft_model_dir: Path | None  # drafter for --mode draft/auto (default: the embedded draft model)
    draft_head_dir: Path | None  # EAGLE head for --mode eagle/auto (default: the embedded base model's head)
    prompts: tuple[tuple[str, str], ...]  # (label, prompt text)
    max_new_tokens: int  # per prompt
    rtt_ms: float  # emulated round-trip time, milliseconds
    mode: str  # --speculate mode
    temperature: float = 0.0  # 0 = greedy
    draft_head_target_check: bool = True  # refuse a head pinned to another model (False: warn)
    edge_layers: tuple[int, int] = (2, 2)  # decoder layers on the edge
    device: str = "auto"  # compute device of the edge and of the trunk server child
    dtype: str = "auto"  # compute dtype of both (models.precision)
    wire_codec: str = "raw"  # how hidden states cross the emulated link (protocol.codec); the trunk accepts all
    startup_timeout_s: float = 120.0  # waiting for the children to listen, seconds


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (for a server that cannot be told to pick its own):
    the one such helper of the demo, the benchmarks and the tests."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _spawn(args: Sequence[str]) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "splitspec.cli", "--log-level", "WARNING", *args]
    preexec = _die_with_parent if sys.platform.startswith("linux") else None
    return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, preexec_fn=preexec)


def _wait_for_port(port: int, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise TransportError(f"child process {proc.args!r} exited with code {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.1)
    raise TransportError(f"nothing listening on 127.0.0.1:{port} after {timeout_s:.0f} s")


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def breakdown_table(label: str, result: GenerationResult) -> Table:
    summary = result.summary()
    steps = result.decode_steps
    table = Table(
        title=f"{label}: {summary['new_tokens']} tokens in {result.wall_s:.2f} s "
        f"= {summary['tokens_per_s']:.1f} tok/s, {summary['tokens_per_decode_step']:.2f} tokens/step"
    )
    table.add_column("per decode step (median)")
    table.add_column("value", justify="right")
    for key, name in (
        ("network_ms", "network"),
        ("edge_ms", "edge compute"),
        ("cloud_ms", "cloud compute"),
        ("serialize_ms", "serialization"),
    ):
        table.add_row(f"{name}, ms", f"{summary['median_step_ms'][key]:.2f}")
    table.add_row("bytes up", f"{summary['median_bytes']['bytes_up']:.0f}")
    table.add_row("bytes down", f"{summary['median_bytes']['bytes_down']:.0f}")
    table.add_row("query tokens", f"{statistics.median(s.query_tokens for s in steps) if steps else 0:.0f}")
    table.add_row("round trips", f"{len(result.steps)} (incl. prefill)")
    return table


async def _generate(config: DemoConfig, url: str, console: Console) -> list[tuple[str, GenerationResult]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(config.model_dir, local_files_only=True)
    edge = EdgeConfig(
        model_dir=config.model_dir,
        cloud_url=url,
        edge_layers=config.edge_layers,
        draft_model_dir=config.draft_model_dir,
        draft_head_dir=config.draft_head_dir,
        draft_head_target_check=config.draft_head_target_check,
        device=config.device,
        wire_codec=config.wire_codec,
        dtype=config.dtype,
        # the demo model is public by construction: say so instead of refusing
        allow_stock_edge_weights=True,
    )
    params = SamplingParams(temperature=config.temperature, seed=0 if config.temperature else None)
    results = []
    async with SplitClient(edge) as client:
        if client.provenance.stock:
            console.print(
                f"[yellow]note: the edge runs stock public weights ({client.provenance.reason}); "
                "a real deployment diverges them first (splitspec diverge)[/]"
            )
        for label, prompt in config.prompts:
            console.rule(f"[bold]{label}[/] (RTT {config.rtt_ms:g} ms, --mode {config.mode})")
            ids = tokenizer.encode(prompt)
            console.print(Text(prompt, style="dim"), end="")
            generated: list[int] = []
            first_step = len(client.steps)
            start = time.perf_counter()
            live = Live(console=console, auto_refresh=False, transient=False) if console.is_terminal else None
            streamed = IncrementalText(lambda ids: str(tokenizer.decode(ids)))
            if live is not None:
                live.start()
            try:
                async for token in client.stream(ids, config.max_new_tokens, params, speculate=config.mode):
                    generated.append(token)
                    delta = streamed.push(token)
                    rate = len(generated) / (time.perf_counter() - start)
                    if live is not None:
                        text = Text(streamed.text)
                        live.update(Group(text, Text(f"\n{rate:.1f} tok/s", style="bold cyan")), refresh=True)
                    else:
                        sys.stdout.write(delta)
                        sys.stdout.flush()
            finally:
                tail = streamed.finish()
                if live is not None:
                    live.stop()
            wall = time.perf_counter() - start
            if live is None:
                sys.stdout.write(tail + "\n")
            result = GenerationResult(
                prompt_ids=ids,
                token_ids=generated,
                seed=0,
                wall_s=wall,
                steps=client.steps[first_step:],
                speculate=config.mode,
            )
            console.print(breakdown_table(label, result))
            results.append((label, result))
    return results


def run_demo(config: DemoConfig, console: Console | None = None) -> int:
    console = console or Console()
    resolve_device(config.device)  # an unavailable device fails here, in one line, before any child starts
    cloud_port, link_port = free_port(), free_port()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        console.print(
            f"[bold]splitspec demo[/]: trunk server on :{cloud_port}, WAN emulator on :{link_port} "
            f"({config.rtt_ms:g} ms RTT), edge layers {config.edge_layers[0]}+{config.edge_layers[1]}"
        )
        procs.append(
            _spawn(
                [
                    "cloud",
                    "serve",
                    "--model",
                    str(config.model_dir),
                    "--port",
                    str(cloud_port),
                    "--edge-layers",
                    f"{config.edge_layers[0]},{config.edge_layers[1]}",
                    "--threads",
                    "1",
                    "--device",
                    config.device,
                    "--dtype",
                    config.dtype,
                ]
            )
        )
        procs.append(
            _spawn(
                [
                    "netem",
                    "--listen",
                    f"127.0.0.1:{link_port}",
                    "--upstream",
                    f"127.0.0.1:{cloud_port}",
                    "--rtt-ms",
                    f"{config.rtt_ms:g}",
                ]
            )
        )
        _wait_for_port(cloud_port, procs[0], config.startup_timeout_s)
        _wait_for_port(link_port, procs[1], config.startup_timeout_s)
        asyncio.run(_generate(config, f"ws://127.0.0.1:{link_port}", console))
        return 0
    finally:
        _stop(procs)
        console.print("[dim]demo finished; trunk server and emulator stopped[/]")
