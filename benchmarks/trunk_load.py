"""Trunk load benchmark (#15): batched vs per-session steps under N concurrent sessions.

A load generator speaks the protocol directly (random hidden states, no edge compute) to a
`TrunkServer` running in a process of its own (as `splitspec cloud serve` does, the issue's
setting), one connection per session, on the demo base model and on a random
Llama of hidden size >= 1024 with few layers. For each model, mode (batching on / off) and
session count it measures aggregate decode steps/s and p50/p99 step latency; a "prefill mix"
run adds one 2,000-token prefill arriving mid-run among 16 decoding sessions and reports decode
latency while it computes. Modes are interleaved within each repeat (>= 3 repeats); medians are
reported with the on/off ratio measured side by side. Memory per session-token is compared with
the theoretical KV size. Writes JSON, a markdown table and PNG plots, with the git commit.

    python benchmarks/trunk_load.py [--quick | --repeats 3 --seconds 2] [--threads N]
        [--out benchmarks/results/trunk_load]

Both servers run with torch's default intra-op threads, as `splitspec cloud serve` does, unless
``--threads`` says otherwise (the count is recorded). Give them only cores nothing else keeps
busy: two intra-op threads on 2 cores while another process kept one busy made a batched trunk
10x slower, threads waiting at each other's barriers. The per-session server computes on its
default pool of 4 threads; the load generator uses one thread.

The mix decodes for seconds / 4, sends the prefill and decodes on until seconds / 4 after it
returns; its target compares the p99 of decode steps that overlapped the prefill's computing (sent
before it returned, returned after it was sent) with the p50 of the others. Quantiles are
nearest-rank. Memory per session-token is reported for the decoding sessions (short contexts:
at most one 16-entry block of slack each) and for the big prefill's cache.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import multiprocessing
import shlex
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from splitspec.cloud.config import CloudConfig
from splitspec.cloud.server import TrunkServer
from splitspec.models.checkpoint import Checkpoint
from splitspec.models.family import published_dtype
from splitspec.models.prepack import PackedLinear
from splitspec.protocol.messages import Hello, OpenSession, SessionOpened, Step
from splitspec.run_info import run_environment, write_jsonl_gz
from splitspec.transport.client import Channel

DEMO = Path(__file__).resolve().parents[1] / "src/splitspec/assets/models/base"
CONTEXT = 16  # tokens each session prefills before decoding
MODELS = ("demo-base", "random-llama-1024")
PREFILL = 2000  # the big prefill of the mix (less on a model with fewer positions: recorded per run)


def random_llama(directory: Path) -> Path:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256, hidden_size=1024, intermediate_size=2816, num_hidden_layers=6,
        num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=4096,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(directory)
    return directory


def quantile(values: list[float], q: float) -> float:
    """The nearest-rank ``q`` quantile: the ceil(q x n)-th smallest (p99 of 100 values is the 99th, not the largest)."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    rank = math.ceil(q * len(ordered) - 1e-9)  # q x n is whole up to rounding (0.07 x 100 = 7.000000000000001)
    return ordered[min(len(ordered), max(1, rank)) - 1]


def split_by_window(
    latencies: list[tuple[float, float]], window: tuple[float, float]
) -> tuple[list[float], list[float]]:
    """Steps ((sent at, ms)) that overlapped ``window`` (start, end; seconds), and the others -> their ms, (during,
    outside). A step overlaps when it was sent before the window ended and returned after it began: one in flight
    when the prefill arrived waited on it too."""
    during: list[float] = []
    outside: list[float] = []
    for sent, ms in latencies:
        (during if sent < window[1] and sent + ms / 1e3 > window[0] else outside).append(ms)
    return during, outside


@dataclass(frozen=True)
class Endpoint:
    """What a load generator needs to know of a trunk server running in another process."""

    url: str
    identity: tuple[str, int, int, str, int]  # Hello's fingerprint, layer_start, layer_end, dtype, hidden_size
    dtype: torch.dtype
    max_positions: int
    bytes_per_token: int  # theoretical KV bytes per token of the trunk
    torch_threads: int  # the server process's intra-op threads
    device: str  # where its trunk computes
    prepacked: bool  # its linear layers are prepacked for oneDNN (--prepack)


def _serve(config: CloudConfig, conn: Connection) -> None:
    """The server process: a TrunkServer answering the parent's questions until told to stop."""
    logging.basicConfig(level=logging.WARNING)
    asyncio.run(_serve_async(config, conn))


async def _serve_async(config: CloudConfig, conn: Connection) -> None:
    async with TrunkServer(config) as server:
        ident = server.identity
        identity = (ident.fingerprint, ident.layer_start, ident.layer_end, ident.dtype, ident.hidden_size)
        kv_theory = server.budget.bytes_per_token
        threads, device = torch.get_num_threads(), str(server.trunk.input_device)
        packed = any(isinstance(m, PackedLinear) for m in server.trunk.modules())
        conn.send(
            Endpoint(server.url, identity, server.dtype, server.max_positions, kv_theory, threads, device, packed)
        )
        stop = asyncio.Event()

        def answer() -> None:  # the parent asks for each session's KV bytes, or says stop
            if conn.recv() == "stop":
                stop.set()
            else:
                conn.send({sid: s.cache.nbytes for sid, s in server.sessions._sessions.items()})

        asyncio.get_running_loop().add_reader(conn.fileno(), answer)
        await stop.wait()


def spawn_with_pipe(target: Callable[..., None], *args: object) -> tuple[Connection, BaseProcess]:
    """Start ``target(*args, child_end)`` in a spawned process -> (the parent's end of the pipe, the process).

    The child's end lives in the child alone: if the child dies, the parent's ``recv()`` sees EOF at once."""
    spawn = multiprocessing.get_context("spawn")
    conn, child = spawn.Pipe()
    process = spawn.Process(target=target, args=(*args, child), daemon=True)
    process.start()
    child.close()
    return conn, process


class ServerProcess:
    """A trunk server in a process of its own, as `splitspec cloud serve` runs (the issue's setting): the
    load generator's framing and encoding then do not share the server's interpreter and event loop."""

    def __init__(self, config: CloudConfig) -> None:
        self._conn, self._process = spawn_with_pipe(_serve, config)
        try:
            if not self._conn.poll(300):
                raise RuntimeError("the trunk server process did not start within 300 s")
            self.endpoint: Endpoint = self._conn.recv()
        except EOFError as exc:
            raise RuntimeError("the trunk server process died while starting (its traceback is above)") from exc
        self._lock = threading.Lock()

    def _ask(self) -> dict[str, int]:
        with self._lock:
            self._conn.send("kv")
            answer: dict[str, int] = self._conn.recv()
            return answer

    async def kv_bytes(self) -> dict[str, int]:
        """Each open session's KV cache bytes (asked off the event loop)."""
        return await asyncio.get_running_loop().run_in_executor(None, self._ask)

    def close(self) -> None:
        self._conn.send("stop")
        self._process.join(60)


class Session:
    """One load-generating session: its own connection, a prefill, then decode steps."""

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        self.hidden = endpoint.identity[4]
        self.dtype = endpoint.dtype
        self.length = 0
        self.seq = 0
        self.latencies: list[tuple[float, float]] = []  # (sent at, ms)
        # one random decode input per session, sent at every decode step: the trunk's work does not depend on
        # the values, and the generator, which shares the server's cores, spends less CPU than remote edges would
        self.decode_hidden = torch.randn(1, 1, self.hidden).to(self.dtype)  # (1, 1, H)

    async def open(self) -> None:
        self.channel = await Channel.connect(self.endpoint.url, max_message_bytes=64 << 20, timeout_s=30)
        await self.channel.request(Hello(*self.endpoint.identity), 30)
        opened, _ = await self.channel.request(OpenSession(request_id=0), 30)
        if not isinstance(opened, SessionOpened):  # the server's reply, checked like any peer input
            raise RuntimeError(f"expected session_opened, the server sent {opened.TYPE!r}")
        self.sid = opened.session_id

    def random_hidden(self, q: int) -> torch.Tensor:
        return self.decode_hidden if q == 1 else torch.randn(1, q, self.hidden).to(self.dtype)  # (1, q, H)

    async def step(self, q: int, hidden: torch.Tensor | None = None) -> float:
        self.seq += 1
        step = Step(
            self.sid,
            self.seq,
            self.random_hidden(q) if hidden is None else hidden,
            torch.arange(self.length, self.length + q, dtype=torch.int32),
            torch.arange(-1, q - 1, dtype=torch.int32),
        )
        t0 = time.perf_counter()
        await self.channel.request(step, 300)
        ms = (time.perf_counter() - t0) * 1e3
        self.length += q
        return ms

    async def decode_while(self, done: asyncio.Event) -> None:
        while not done.is_set():
            sent = time.perf_counter()
            self.latencies.append((sent, await self.step(1)))


def server_config(
    model: Path, batching: bool, max_sessions: int, threads: int | None, prepack: str = "auto", device: str = "auto"
) -> CloudConfig:
    # the checkpoint's stored dtype, as every recorded run of this benchmark computed (not --dtype auto's choice)
    stored = str(published_dtype(Checkpoint(model).config)).removeprefix("torch.")
    return CloudConfig(
        model_dir=model, port=0, batching=batching, max_sessions=max_sessions,
        max_sessions_per_address=max_sessions, max_connections_per_address=max_sessions,
        max_query_tokens=2048, kv_budget_mb=4096, torch_threads=threads, prepack=prepack, device=device,
        dtype=stored,
    )  # fmt: skip


def _prefill_edge(endpoint: Endpoint, tokens: int, conn: Connection) -> None:
    """The mix's prefilling edge, in a process of its own as it would be on its own machine: its 8 MB frame
    (made, encoded and masked; its reply received and decoded) never stalls the decoding sessions' loop."""
    asyncio.run(_prefill_edge_async(endpoint, tokens, conn))


async def _prefill_edge_async(endpoint: Endpoint, tokens: int, conn: Connection) -> None:
    torch.set_num_threads(1)
    edge = Session(endpoint)
    await edge.open()
    big = edge.random_hidden(tokens)
    conn.send(edge.sid)  # ready
    conn.recv()  # go
    sent = time.perf_counter()  # CLOCK_MONOTONIC: the parent's clock too
    await edge.step(tokens, big)
    conn.send((sent, time.perf_counter()))
    conn.recv()  # the parent has read its cache's bytes
    await edge.channel.close()


class PrefillEdge:
    """Starts :func:`_prefill_edge` and waits for it to be connected, before the measured window."""

    def __init__(self, endpoint: Endpoint, tokens: int) -> None:
        self._conn, self._process = spawn_with_pipe(_prefill_edge, endpoint, tokens)

    async def _recv(self) -> Any:
        return await asyncio.get_running_loop().run_in_executor(None, self._conn.recv)

    async def ready(self) -> str:
        sid: str = await self._recv()
        return sid

    async def prefill(self) -> tuple[float, float]:
        """Send the prefill now -> (sent, returned) on this process's perf_counter clock."""
        self._conn.send("go")
        window: tuple[float, float] = await self._recv()
        return window

    async def close(self) -> None:
        self._conn.send("close")
        await asyncio.get_running_loop().run_in_executor(None, self._process.join, 60)


async def run_load(
    server: ServerProcess, sessions: int, seconds: float, prefill_mix: bool, prefill: int = PREFILL
) -> dict[str, Any]:
    endpoint = server.endpoint
    for _ in range(50):  # the previous run's connections close their sessions as the server sees them go
        if not await server.kv_bytes():
            break
        await asyncio.sleep(0.1)
    else:
        raise RuntimeError("the server still holds sessions of an earlier run")
    load = [Session(endpoint) for _ in range(sessions)]
    await asyncio.gather(*(s.open() for s in load))
    await asyncio.gather(*(s.step(CONTEXT) for s in load))
    heavy_window = (0.0, 0.0)
    prefill_tokens = min(prefill, endpoint.max_positions - 64)
    heavy_bytes_per_token = None
    if prefill_mix:
        heavy = PrefillEdge(endpoint, prefill_tokens)
        heavy_sid = await heavy.ready()
    start = time.perf_counter()
    stop = start + seconds
    done = asyncio.Event()
    tasks = [asyncio.create_task(s.decode_while(done)) for s in load]
    if prefill_mix:  # decode for seconds / 4, send the prefill, decode on for seconds / 4 after it returns
        await asyncio.sleep(seconds / 4)
        heavy_window = await heavy.prefill()
        heavy_bytes_per_token = (await server.kv_bytes())[heavy_sid] / prefill_tokens
        await asyncio.sleep(seconds / 4)
    else:
        await asyncio.sleep(max(0.0, stop - time.perf_counter()))
    done.set()
    await asyncio.gather(*tasks)
    wall = time.perf_counter() - start
    if prefill_mix:
        await heavy.close()  # after the measured window: its interpreter's exit takes a second
    held_tokens = sum(s.length for s in load)
    held = await server.kv_bytes()
    kv_bytes = sum(held[s.sid] for s in load)
    theory = endpoint.bytes_per_token
    for s in load:
        await s.channel.close()
    latencies = [ms for s in load for _, ms in s.latencies]
    during, outside = split_by_window([step for s in load for step in s.latencies], heavy_window)
    return {
        "steps": len(latencies),
        "wall_s": wall,
        "steps_per_s": len(latencies) / wall,
        "p50_ms": quantile(latencies, 0.5),
        "p99_ms": quantile(latencies, 0.99),
        "outside_prefill_p50_ms": quantile(outside, 0.5) if prefill_mix else None,
        "during_prefill_p99_ms": quantile(during, 0.99) if prefill_mix else None,
        "during_prefill_steps": len(during),
        "prefill_ms": (heavy_window[1] - heavy_window[0]) * 1e3 if prefill_mix else None,
        "prefill_tokens": prefill_tokens if prefill_mix else None,
        "kv_bytes_per_token": kv_bytes / held_tokens,
        "prefill_kv_bytes_per_token": heavy_bytes_per_token,
        "theory_bytes_per_token": theory,
    }


KEYS = (
    "steps_per_s", "p50_ms", "p99_ms", "outside_prefill_p50_ms", "during_prefill_p99_ms", "prefill_ms",
    "kv_bytes_per_token", "prefill_kv_bytes_per_token",
)  # fmt: skip


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def summarise(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    keys = sorted({(r["model"], r["scenario"], r["sessions"]) for r in runs})
    for model, scenario, sessions in keys:
        row: dict[str, Any] = {"model": model, "scenario": scenario, "sessions": sessions}
        for mode in ("batched", "per-session"):
            mine = [
                r
                for r in runs
                if (r["model"], r["scenario"], r["sessions"], r["mode"]) == (model, scenario, sessions, mode)
            ]
            for key in KEYS:
                values = [r[key] for r in mine if r[key] is not None]
                row[f"{mode} {key}"] = statistics.median(values) if values else None
        row["throughput ratio"] = row["batched steps_per_s"] / row["per-session steps_per_s"]
        row["p50 ratio"] = row["batched p50_ms"] / row["per-session p50_ms"]
        for mode in ("batched", "per-session"):  # the prefill target: p99 during it over p50 outside it
            row[f"{mode} prefill p99/p50"] = _ratio(
                row[f"{mode} during_prefill_p99_ms"], row[f"{mode} outside_prefill_p50_ms"]
            )
        row["theory_bytes_per_token"] = next(r["theory_bytes_per_token"] for r in runs if r["model"] == model)
        row["prefill_tokens"] = next(
            (r["prefill_tokens"] for r in runs if r["model"] == model and r["prefill_tokens"]), None
        )
        rows.append(row)
    return rows


def markdown(rows: list[dict[str, Any]], env: dict[str, Any], command: str, setup: dict[str, Endpoint]) -> str:
    threads = sorted({e.torch_threads for e in setup.values()})
    devices = sorted({e.device for e in setup.values()})
    packed = ", ".join(f"{key} {'prepacked' if e.prepacked else 'default'}" for key, e in setup.items())
    lines = [
        "# Trunk load: batched vs per-session (medians of interleaved repeats)",
        "",
        f"commit {env.get('commit')}, `{command}`, {env.get('cpu_count')} CPUs, servers with "
        f"{'/'.join(map(str, threads))} torch thread(s) on {'/'.join(devices)}, per-session with its default pool "
        "of 4 compute threads; server process and load generator on one machine (shared, noisy CPU): only ratios "
        f"mean much. Linear kernels (--prepack): {packed}.",
        "",
        "## Decode load",
        "",
        "| model | sessions | batched steps/s | per-session steps/s | ratio | batched p50/p99 ms "
        "| per-session p50/p99 ms | p50 ratio | KV B/token (batched; theory) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if r["scenario"] != "decode":
            continue
        lines.append(
            f"| {r['model']} | {r['sessions']} | {r['batched steps_per_s']:.0f} "
            f"| {r['per-session steps_per_s']:.0f} | {r['throughput ratio']:.2f} "
            f"| {r['batched p50_ms']:.1f} / {r['batched p99_ms']:.1f} "
            f"| {r['per-session p50_ms']:.1f} / {r['per-session p99_ms']:.1f} | {r['p50 ratio']:.2f} "
            f"| {r['batched kv_bytes_per_token']:.0f}; {r['theory_bytes_per_token']} |"
        )
    lines += [
        "",
        "## One big prefill arriving among 16 decoding sessions",
        "",
        "Decode-step p50 outside the prefill, p99 of the steps that overlapped its computing (in flight at any "
        "moment of it), and their ratio (target "
        "<= 3x); the prefill's own time and its cache's bytes per token.",
        "",
        "| model | prefill tokens | mode | p50 outside ms | p99 during ms | p99/p50 | prefill ms | prefill KV B/token "
        "(theory) |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if r["scenario"] == "decode":
            continue
        for mode in ("batched", "per-session"):
            lines.append(
                f"| {r['model']} | {r['prefill_tokens']} | {mode} | {r[f'{mode} outside_prefill_p50_ms']:.1f} "
                f"| {r[f'{mode} during_prefill_p99_ms']:.1f} | {r[f'{mode} prefill p99/p50']:.2f} "
                f"| {r[f'{mode} prefill_ms']:.0f} | {r[f'{mode} prefill_kv_bytes_per_token']:.0f} "
                f"({r['theory_bytes_per_token']}) |"
            )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for model in sorted({r["model"] for r in rows}):
        mine = [r for r in rows if r["model"] == model and r["scenario"] == "decode"]
        n = [r["sessions"] for r in mine]
        for mode, style in (("batched", "-o"), ("per-session", "--s")):
            axes[0].plot(n, [r[f"{mode} steps_per_s"] for r in mine], style, label=f"{model} {mode}")
            axes[1].plot(n, [r[f"{mode} p50_ms"] for r in mine], style, label=f"{model} {mode}")
    for ax, title in zip(axes, ("aggregate decode steps/s", "p50 step latency, ms"), strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent sessions")
        ax.set_title(title)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "trunk_load.png", dpi=120)


async def main_async(args: argparse.Namespace) -> None:
    env = run_environment()
    command = "python benchmarks/trunk_load.py " + shlex.join(sys.argv[1:])
    runs: list[dict[str, Any]] = []
    setup: dict[str, Endpoint] = {}  # each server's device and kernels, as it reports them
    max_sessions = max([*args.sessions, 16]) + 2
    with tempfile.TemporaryDirectory() as tmp:
        models = {name: DEMO for name in args.models if name == "demo-base"}
        if "random-llama-1024" in args.models:
            models["random-llama-1024"] = random_llama(Path(tmp) / "llama1024")
        for name, path in models.items():
            # one server process per mode, both alive for the model's whole run (the idle one sleeps)
            servers = {
                mode: ServerProcess(
                    server_config(path, mode == "batched", max_sessions, args.threads, args.prepack, args.device)
                )
                for mode in ("batched", "per-session")
            }
            setup.update({f"{name} {mode}": server.endpoint for mode, server in servers.items()})
            try:
                for repeat in range(args.repeats):
                    plans = [("decode", n) for n in args.sessions] + [("prefill-mix", 16)]
                    for scenario, sessions in plans:
                        modes = ("batched", "per-session") if repeat % 2 == 0 else ("per-session", "batched")
                        for mode in modes:  # interleaved, order alternating between repeats
                            mix = scenario != "decode"
                            result = await run_load(servers[mode], sessions, args.seconds, mix, args.prefill)
                            runs.append({"repeat": repeat, "model": name, "scenario": scenario,
                                         "sessions": sessions, "mode": mode, **result})  # fmt: skip
                            logging.info("%s", runs[-1])
            finally:
                for server in servers.values():
                    server.close()
    rows = summarise(runs)
    args.out.mkdir(parents=True, exist_ok=True)
    kernels = {
        key: {"device": e.device, "prepacked": e.prepacked, "threads": e.torch_threads} for key, e in setup.items()
    }
    meta = {"environment": env, "command": command, "servers": kernels, "summary": rows}
    (args.out / "trunk_load.json").write_text(json.dumps(meta, indent=1))
    write_jsonl_gz(args.out / "runs.jsonl.gz", runs, commit=env["commit"], splitspec=env["splitspec"])
    (args.out / "trunk_load.md").write_text(markdown(rows, env, command, setup))
    plot(rows, args.out)
    logging.getLogger(__name__).info("\n%s", markdown(rows, env, command, setup))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="3 repeats of 0.4 s runs and a 1,024-token prefill (under 10 minutes on 2 loaded cores)",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=2.0, help="decode time per run, seconds")
    parser.add_argument("--prefill", type=int, default=PREFILL, help="tokens of the mix's big prefill (default 2000)")
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 4, 16, 32, 64])
    parser.add_argument(
        "--models", nargs="+", choices=MODELS, default=list(MODELS), help="which models to load (default both)"
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="the servers' intra-op threads (default: torch's, as cloud serve)"
    )
    parser.add_argument(
        "--prepack", choices=("auto", "on", "off"), default="auto", help="both servers' --prepack (default auto)"
    )
    parser.add_argument("--device", default="auto", help="both servers' --device (default auto, as cloud serve)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/trunk_load"))
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.seconds, args.prefill = 3, 0.4, 1024
    torch.set_num_threads(1)  # the load generator's own tensor work is small
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger(__name__).setLevel(logging.INFO)
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
