"""Accuracy of the WAN emulator: added round-trip time and shaped throughput vs their settings.

For each RTT setting, sends N small messages through the emulator to a loopback echo server and
compares their round-trip times with N direct round trips measured in the same run. Reports the
median, p10 and p90 of the *added* RTT (emulated sample − direct median) and the error of the
median against the setting. Optionally also measures one-way throughput under a rate limit.

Writes ``<out>.json`` and ``<out>.md`` (default ``benchmarks/results/netem_accuracy``).

    PYTHONPATH=src python benchmarks/netem_accuracy.py --pings 100
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from splitspec.netem.emulator import WanEmulator
from splitspec.netem.schedule import NetemConfig
from splitspec.run_info import run_environment

logger = logging.getLogger("netem_accuracy")


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except OSError:
        pass
    finally:
        writer.close()


async def _sink(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        n = int.from_bytes(await reader.readexactly(8), "big")
        await reader.readexactly(n)
        writer.write(b"ok")
        await writer.drain()
    except (OSError, asyncio.IncompleteReadError):
        pass
    finally:
        writer.close()


async def _pings(port: int, n: int, warmup: int = 3) -> list[float]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    out: list[float] = []
    try:
        for i in range(n + warmup):
            msg = i.to_bytes(8, "big")
            t0 = time.perf_counter()
            writer.write(msg)
            await writer.drain()
            got = await asyncio.wait_for(reader.readexactly(8), 10.0)
            if got != msg:
                raise RuntimeError(f"echo mismatch: {got!r} != {msg!r}")
            if i >= warmup:
                out.append((time.perf_counter() - t0) * 1000.0)
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
    return out


def _summary(values: list[float]) -> dict[str, float]:
    arr = np.asarray(values)
    return {
        "median": float(np.median(arr)),
        "p10": float(np.percentile(arr, 10)),
        "p90": float(np.percentile(arr, 90)),
        "min": float(arr.min()),
        "max": float(arr.max()),
    }


async def _upload_s(port: int, nbytes: int) -> float:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        t0 = time.perf_counter()
        writer.write(nbytes.to_bytes(8, "big") + bytes(nbytes))
        await writer.drain()
        if await asyncio.wait_for(reader.readexactly(2), 60.0) != b"ok":
            raise RuntimeError("sink did not acknowledge")
        return time.perf_counter() - t0
    finally:
        writer.close()


async def measure(
    settings_ms: list[float], n_pings: int, jitter_ms: float, bandwidths_mbit: list[float], nbytes: int
) -> dict[str, Any]:
    echo = await asyncio.start_server(_echo, "127.0.0.1", 0)
    echo_port = int(echo.sockets[0].getsockname()[1])
    sink = await asyncio.start_server(_sink, "127.0.0.1", 0)
    sink_port = int(sink.sockets[0].getsockname()[1])
    try:
        direct = await _pings(echo_port, n_pings)
        direct_median = statistics.median(direct)
        rows = []
        for setting in settings_ms:
            cfg = NetemConfig(upstream_port=echo_port, rtt_ms=setting, jitter_ms=jitter_ms, seed=1)
            async with WanEmulator(cfg) as emu:
                samples = await _pings(emu.port, n_pings)
            added = [s - direct_median for s in samples]
            summary = _summary(added)
            rows.append(
                {
                    "setting_ms": setting,
                    "jitter_ms": jitter_ms,
                    "n": len(samples),
                    "emulated_ms": _summary(samples),
                    "added_ms": summary,
                    "median_error_ms": summary["median"] - setting,
                }
            )
            logger.info("rtt %.0f ms: added median %.2f ms", setting, summary["median"])
        throughput = []
        for mbit in bandwidths_mbit:
            async with WanEmulator(NetemConfig(upstream_port=sink_port)) as emu:
                unshaped = await _upload_s(emu.port, nbytes)
            async with WanEmulator(NetemConfig(upstream_port=sink_port, bandwidth_bps=mbit * 1e6)) as emu:
                shaped = await _upload_s(emu.port, nbytes)
            throughput.append(
                {
                    "setting_mbit": mbit,
                    "bytes": nbytes,
                    "expected_s": nbytes * 8 / (mbit * 1e6),
                    "unshaped_s": unshaped,
                    "shaped_s": shaped,
                    "achieved_mbit": nbytes * 8 / shaped / 1e6,
                }
            )
            logger.info("bandwidth %.0f Mbit/s: achieved %.1f", mbit, throughput[-1]["achieved_mbit"])
    finally:
        echo.close()
        sink.close()
    return {
        "benchmark": "netem_accuracy",
        **run_environment(),
        "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "pings_per_setting": n_pings,
        "direct_ms": _summary(direct),
        "rtt": rows,
        "bandwidth": throughput,
    }


def to_markdown(result: dict[str, Any]) -> str:
    d = result["direct_ms"]
    lines = [
        "# WAN emulator accuracy",
        "",
        f"{result['started_utc']}, Python {result['python']}, {result['cpu_count']} CPUs, "
        f"load average {', '.join(f'{x:.2f}' for x in result['loadavg'] or [])}. "
        f"{result['pings_per_setting']} pings of 8 bytes per setting through the emulator to a "
        f"loopback echo server. Direct loopback RTT: median {d['median']:.3f} ms "
        f"(p10 {d['p10']:.3f}, p90 {d['p90']:.3f}). Added RTT = emulated sample − direct median.",
        "",
        "| setting (ms) | jitter (ms) | added median (ms) | added p10 (ms) | added p90 (ms) | median error (ms) |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for row in result["rtt"]:
        a = row["added_ms"]
        lines.append(
            f"| {row['setting_ms']:.0f} | {row['jitter_ms']:.0f} | {a['median']:.2f} | {a['p10']:.2f} "
            f"| {a['p90']:.2f} | {row['median_error_ms']:+.2f} |"
        )
    if result["bandwidth"]:
        lines += [
            "",
            "| rate setting (Mbit/s) | bytes | expected (s) | unshaped (s) | shaped (s) | achieved (Mbit/s) |",
            "|---:|---:|---:|---:|---:|---:|",
        ]
        for row in result["bandwidth"]:
            lines.append(
                f"| {row['setting_mbit']:.0f} | {row['bytes']} | {row['expected_s']:.3f} "
                f"| {row['unshaped_s']:.3f} | {row['shaped_s']:.3f} | {row['achieved_mbit']:.1f} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(__file__).resolve().parent / "results" / "netem_accuracy",
        help="output path without suffix; writes .json and .md",
    )
    parser.add_argument("--pings", type=int, default=100, help="round trips per setting")
    parser.add_argument("--rtt-ms", type=float, nargs="+", default=[5.0, 20.0, 80.0, 150.0], help="RTT settings, ms")
    parser.add_argument("--jitter-ms", type=float, default=0.0, help="jitter for every setting, ms")
    parser.add_argument(
        "--bandwidth-mbit",
        type=float,
        nargs="*",
        default=[50.0, 200.0],
        help="rate settings to check, Mbit/s (none to skip)",
    )
    parser.add_argument("--bytes", type=int, default=4_000_000, help="upload size per rate check")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    result = asyncio.run(measure(args.rtt_ms, args.pings, args.jitter_ms, args.bandwidth_mbit, args.bytes))
    out: Path = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    table = to_markdown(result)
    out.with_suffix(".md").write_text(table)
    sys.stdout.write(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
