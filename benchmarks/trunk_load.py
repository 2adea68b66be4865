"""Trunk load benchmark (#15): batched vs per-session steps under N concurrent sessions.

A load generator speaks the protocol directly (random hidden states, no edge compute) to an
in-process `TrunkServer`, one connection per session, on the demo base model and on a random
Llama of hidden size >= 1024 with few layers. For each model, mode (batching on / off) and
session count it measures aggregate decode steps/s and p50/p99 step latency; a "prefill mix"
run adds one 2,000-token prefill arriving mid-run among 16 decoding sessions and reports decode
latency while it computes. Modes are interleaved within each repeat (>= 3 repeats); medians are
reported with the on/off ratio measured side by side. Memory per session-token is compared with
the theoretical KV size. Writes JSON, a markdown table and PNG plots, with the git commit.

    nice -n 10 python benchmarks/trunk_load.py [--repeats 3] [--seconds 2] [--out benchmarks/results/trunk_load]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from splitspec.cloud.config import CloudConfig
from splitspec.cloud.server import TrunkServer
from splitspec.protocol.messages import Hello, OpenSession, SessionOpened, Step
from splitspec.run_info import run_environment, write_jsonl_gz
from splitspec.transport.client import Channel

DEMO = Path(__file__).resolve().parents[1] / "src/splitspec/assets/models/base"
CONTEXT = 16  # tokens each session prefills before decoding
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
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


class Session:
    """One load-generating session: its own connection, a prefill, then decode steps."""

    def __init__(self, server: TrunkServer) -> None:
        self.server = server
        self.hidden = server.identity.hidden_size
        self.dtype = server.dtype
        self.length = 0
        self.seq = 0
        self.latencies: list[tuple[float, float]] = []  # (sent at, ms)

    async def open(self) -> None:
        ident = self.server.identity
        self.channel = await Channel.connect(self.server.url, max_message_bytes=64 << 20, timeout_s=30)
        await self.channel.request(
            Hello(ident.fingerprint, ident.layer_start, ident.layer_end, ident.dtype, ident.hidden_size), 30
        )
        opened, _ = await self.channel.request(OpenSession(request_id=0), 30)
        assert isinstance(opened, SessionOpened)
        self.sid = opened.session_id

    async def step(self, q: int) -> float:
        self.seq += 1
        step = Step(
            self.sid,
            self.seq,
            torch.randn(1, q, self.hidden).to(self.dtype),
            torch.arange(self.length, self.length + q, dtype=torch.int32),
            torch.arange(-1, q - 1, dtype=torch.int32),
        )
        t0 = time.perf_counter()
        await self.channel.request(step, 300)
        ms = (time.perf_counter() - t0) * 1e3
        self.length += q
        return ms

    async def decode_until(self, stop: float) -> None:
        while time.perf_counter() < stop:
            sent = time.perf_counter()
            self.latencies.append((sent, await self.step(1)))


async def run_load(model: Path, batching: bool, sessions: int, seconds: float, prefill_mix: bool) -> dict[str, Any]:
    config = CloudConfig(
        model_dir=model, port=0, batching=batching, max_sessions=sessions + 2,
        max_sessions_per_address=sessions + 2, max_connections_per_address=sessions + 2,
        max_query_tokens=2048, kv_budget_mb=4096,
    )  # fmt: skip
    async with TrunkServer(config) as server:
        load = [Session(server) for _ in range(sessions)]
        await asyncio.gather(*(s.open() for s in load))
        await asyncio.gather(*(s.step(CONTEXT) for s in load))
        heavy_window = (0.0, 0.0)
        prefill_tokens = min(PREFILL, server.max_positions - 64)
        start = time.perf_counter()
        stop = start + seconds
        tasks = [asyncio.create_task(s.decode_until(stop)) for s in load]
        if prefill_mix:
            heavy = Session(server)
            await heavy.open()
            await asyncio.sleep(seconds / 4)
            sent = time.perf_counter()
            await heavy.step(prefill_tokens)
            heavy_window = (sent, time.perf_counter())
        await asyncio.gather(*tasks)
        wall = time.perf_counter() - start
        held_tokens = sum(s.length for s in load)
        kv_bytes = sum(server.sessions._sessions[s.sid].cache.nbytes for s in load)
        theory = server.budget.bytes_per_token
        for s in load:
            await s.channel.close()
    latencies = [ms for s in load for _, ms in s.latencies]
    during = [ms for s in load for sent, ms in s.latencies if heavy_window[0] <= sent <= heavy_window[1]]
    return {
        "steps": len(latencies),
        "steps_per_s": len(latencies) / wall,
        "p50_ms": quantile(latencies, 0.5),
        "p99_ms": quantile(latencies, 0.99),
        "during_prefill_p99_ms": quantile(during, 0.99) if prefill_mix else None,
        "during_prefill_steps": len(during),
        "prefill_ms": (heavy_window[1] - heavy_window[0]) * 1e3 if prefill_mix else None,
        "prefill_tokens": prefill_tokens if prefill_mix else None,
        "kv_bytes_per_token": kv_bytes / held_tokens,
        "theory_bytes_per_token": theory,
    }


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
            for key in ("steps_per_s", "p50_ms", "p99_ms", "during_prefill_p99_ms", "kv_bytes_per_token"):
                values = [r[key] for r in mine if r[key] is not None]
                row[f"{mode} {key}"] = statistics.median(values) if values else None
        row["throughput ratio"] = row["batched steps_per_s"] / row["per-session steps_per_s"]
        row["p50 ratio"] = row["batched p50_ms"] / row["per-session p50_ms"]
        row["theory_bytes_per_token"] = next(r["theory_bytes_per_token"] for r in runs if r["model"] == model)
        rows.append(row)
    return rows


def markdown(rows: list[dict[str, Any]], env: dict[str, Any]) -> str:
    lines = [
        "# Trunk load: batched vs per-session (medians of interleaved repeats)",
        "",
        f"commit {env.get('commit')}; in-process server and load generator on one machine (shared, noisy CPU).",
        "",
        "| model | scenario | sessions | batched steps/s | per-session steps/s | ratio | batched p50/p99 ms "
        "| per-session p50/p99 ms | p99 during the big prefill (batched / per-session) ms "
        "| KV B/token (batched; theory) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        during = (
            f"{r['batched during_prefill_p99_ms']:.1f} / {r['per-session during_prefill_p99_ms']:.1f}"
            if r["batched during_prefill_p99_ms"] is not None and r["per-session during_prefill_p99_ms"] is not None
            else "-"
        )
        lines.append(
            f"| {r['model']} | {r['scenario']} | {r['sessions']} | {r['batched steps_per_s']:.0f} "
            f"| {r['per-session steps_per_s']:.0f} | {r['throughput ratio']:.2f} "
            f"| {r['batched p50_ms']:.1f} / {r['batched p99_ms']:.1f} "
            f"| {r['per-session p50_ms']:.1f} / {r['per-session p99_ms']:.1f} | {during} "
            f"| {r['batched kv_bytes_per_token']:.0f}; {r['theory_bytes_per_token']} |"
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
    with tempfile.TemporaryDirectory() as tmp:
        models = {"demo-base": DEMO, "random-llama-1024": random_llama(Path(tmp) / "llama1024")}
        runs: list[dict[str, Any]] = []
        for repeat in range(args.repeats):
            for name, path in models.items():
                plans = [("decode", n) for n in args.sessions] + [("prefill-mix", 16)]
                for scenario, sessions in plans:
                    modes = ("batched", "per-session") if repeat % 2 == 0 else ("per-session", "batched")
                    for mode in modes:  # interleaved, order alternating between repeats
                        result = await run_load(path, mode == "batched", sessions, args.seconds, scenario != "decode")
                        runs.append({"repeat": repeat, "model": name, "scenario": scenario, "sessions": sessions,
                                     "mode": mode, **result})  # fmt: skip
                        logging.info("%s", runs[-1])
    rows = summarise(runs)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "trunk_load.json").write_text(json.dumps({"environment": env, "summary": rows}, indent=1))
    write_jsonl_gz(args.out / "runs.jsonl.gz", runs, commit=env["commit"], splitspec=env["splitspec"])
    (args.out / "trunk_load.md").write_text(markdown(rows, env))
    plot(rows, args.out)
    print(markdown(rows, env))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=2.0, help="decode time per run, seconds")
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 4, 16, 32, 64])
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/trunk_load"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger(__name__).setLevel(logging.INFO)
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
