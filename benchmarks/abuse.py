"""Abuse benchmark: hostile clients against a real trunk server while a legitimate generation runs.

Every repeat starts a fresh ``splitspec cloud serve`` process on the demo model (with a shared
secret), warms it with one legitimate generation (the reference output), then runs each scenario
in turn, in an order rotated from repeat to repeat:

* ``baseline``: the legitimate generation alone;
* ``unauth_max_frame``: N connections that never authenticate, each sending one frame of the
  server's full message cap (the pre-handshake frame cap must refuse it from its length);
* ``session_hog``: N authenticated connections, each opening sessions until refused, and holding
  them;
* ``idle_flood``: N connections that upgrade and then send nothing (the handshake deadline must
  close them).

The hostile clients connect from 127.0.0.2, the legitimate one from 127.0.0.1 (both loopback), so
per-address limits apply to the hostile address only. The legitimate client connects once the
hostile load is in place and generates greedily with speculation off; its tokens must equal the
warm-up's. Server RSS is sampled from /proc every 20 ms: growth = peak during the scenario minus
the RSS just before it, reported in MB per hostile connection. For hostile connections the server
closes, the time from the connection's last byte sent to its close is recorded against the
handshake deadline; in ``unauth_max_frame`` and ``idle_flood`` every hostile connection must be
refused at connect or closed by the server within the deadline, plus ``--close-slack-s`` (1 s) for this
process to notice the close (a connection still open when the watch ends, ``handshake_timeout + 20`` s,
fails the run: it has no close time to check).
Scenarios are interleaved over ``--repeats`` rounds; medians are reported.
A scenario's RSS growth is measured on a server that ran the previous ones (memory they freed may
be reused, so growth is a lower bound there; RSS never shrank between scenarios in our runs).

    nice -n 10 python benchmarks/abuse.py --out benchmarks/results/abuse
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake
from websockets.frames import Frame, Opcode

import splitspec
from splitspec.decoding.sampling import SamplingParams
from splitspec.demo import free_port
from splitspec.edge.client import SplitClient
from splitspec.edge.config import EdgeConfig
from splitspec.exceptions import SplitspecError, TooManySessions
from splitspec.models.stack import EdgeModel
from splitspec.protocol.frames import MAGIC, PROTOCOL_VERSION
from splitspec.protocol.messages import OpenSession, SessionOpened
from splitspec.run_info import resident_bytes, run_environment, write_jsonl_gz
from splitspec.transport.client import Channel

log = logging.getLogger("abuse")
MODEL = Path(splitspec.__file__).parent / "assets" / "models" / "base"
TOKEN = "abuse-benchmark-secret"
LEGIT_ADDRESS = "127.0.0.1"
HOSTILE_ADDRESS = "127.0.0.2"
PROMPT = "The old lighthouse keeper climbed the stairs"


@dataclass
class Run:
    """One scenario in one repeat."""

    scenario: str
    repeat: int
    hostile: int  # hostile connections attempted
    legit_tokens: list[int] = field(default_factory=list)
    legit_error: str | None = None
    legit_wall_s: float = 0.0
    identical: bool | None = None  # legit tokens == this repeat's warm-up generation (no hostile load)
    rss_before_mb: float = 0.0
    rss_peak_mb: float = 0.0
    rss_growth_mb: float = 0.0
    mb_per_hostile: float = 0.0
    refused_at_connect: int = 0  # hostile connections the server turned away at once (per-address cap)
    closed_by_server: int = 0
    close_latency_s: list[float] = field(default_factory=list)  # last byte sent -> closed, seconds
    close_codes: list[int] = field(default_factory=list)
    sessions_held: int = 0  # session_hog: sessions the hostile connections obtained


MUST_CLOSE = ("unauth_max_frame", "idle_flood")  # scenarios whose every hostile connection the server must close


# -- the server --------------------------------------------------------------------------------------


def start_trunk(port: int, token_file: Path, args: argparse.Namespace) -> subprocess.Popen[bytes]:
    cmd = [
        *(sys.executable, "-m", "splitspec.cli", "--log-level", "WARNING", "cloud", "serve"),
        *("--model", str(MODEL), "--port", str(port), "--token-file", str(token_file), "--device", "cpu"),
        *("--handshake-timeout", str(args.handshake_timeout), "--max-message-mb", str(args.max_message_mb)),
    ]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 900  # a loaded shared machine starts slowly
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the trunk server exited with code {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return proc
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("the trunk server did not start listening")


def rss_mb(pid: int) -> float:
    return resident_bytes(pid) / 2**20


class RssPeak:
    """Samples a process's RSS every 20 ms until stopped; keeps the peak."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak = rss_mb(pid)
        self._task: asyncio.Task[None] | None = None

    async def _sample(self) -> None:
        while True:
            self.peak = max(self.peak, rss_mb(self.pid))
            await asyncio.sleep(0.02)

    def __enter__(self) -> RssPeak:
        self._task = asyncio.get_running_loop().create_task(self._sample())
        return self

    def __exit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
        self.peak = max(self.peak, rss_mb(self.pid))


# -- clients -------------------------------------------------------------------------------------------


def edge_config(url: str) -> EdgeConfig:
    return EdgeConfig(model_dir=MODEL, cloud_url=url, auth_token=TOKEN, device="cpu", allow_stock_edge_weights=True)


async def legit_generation(url: str, edge: EdgeModel, prompt_ids: list[int], n: int, run: Run) -> None:
    """A greedy generation from the legitimate address (connecting to 127.0.0.1 comes from it)."""
    t0 = time.perf_counter()
    client = SplitClient(edge_config(url), edge=edge)
    try:
        await client.connect()
        result = await client.generate(prompt_ids, n, SamplingParams(temperature=0.0), speculate="off")
        run.legit_tokens = result.token_ids
    except SplitspecError as exc:
        run.legit_error = f"{type(exc).__name__}: {exc}"
    finally:
        run.legit_wall_s = time.perf_counter() - t0
        await client.close()


async def hostile_connection(url: str) -> ClientConnection | None:
    """A WebSocket connection from the hostile address; None if the server refused the upgrade."""
    try:
        return await connect(
            url, local_addr=(HOSTILE_ADDRESS, 0), max_size=None, compression=None, open_timeout=30, ping_interval=None
        )
    except (OSError, InvalidHandshake, TimeoutError):
        return None


async def watch_close(ws: ClientConnection, run: Run, since: float, limit_s: float) -> None:
    """Wait (up to ``limit_s``) for the server to close ``ws``; record when and how (1006: it dropped the
    connection without a close frame). One it never closes is closed here and adds no close time:
    ``summarize`` counts it as never closed."""
    try:
        await asyncio.wait_for(ws.wait_closed(), limit_s)
    except TimeoutError:
        await ws.close()
        return
    run.closed_by_server += 1  # this side never closes first: the server ended the connection
    run.close_latency_s.append(time.perf_counter() - since)
    run.close_codes.append(ws.protocol.close_rcvd.code if ws.protocol.close_rcvd is not None else 1006)


async def unauth_max_frame(url: str, n: int, run: Run, args: argparse.Namespace) -> Callable[[], Awaitable[None]]:
    payload = MAGIC + PROTOCOL_VERSION.to_bytes(2, "big") + bytes(args.max_message_mb * 1024 * 1024 - 6)
    # masked once and written raw: masking 16 MiB per send would block this process's event loop
    # (which the legitimate client shares) for about a second per connection
    wire = Frame(Opcode.BINARY, payload).serialize(mask=True, extensions=[])

    async def one() -> None:
        ws = await hostile_connection(url)
        if ws is None:
            run.refused_at_connect += 1
            return
        ws.transport.write(wire)
        await watch_close(ws, run, time.perf_counter(), args.handshake_timeout + 20)

    tasks = [asyncio.create_task(one()) for _ in range(n)]
    await asyncio.sleep(0.5)  # the frames are on their way before the legitimate client starts

    async def finish() -> None:
        await asyncio.gather(*tasks)

    return finish


async def idle_flood(url: str, n: int, run: Run, args: argparse.Namespace) -> Callable[[], Awaitable[None]]:
    conns = await asyncio.gather(*(hostile_connection(url) for _ in range(n)))
    since = time.perf_counter()  # connected: the handshake deadline runs from here (give or take the upgrade)
    run.refused_at_connect = sum(ws is None for ws in conns)
    watchers = [
        asyncio.create_task(watch_close(ws, run, since, args.handshake_timeout + 20)) for ws in conns if ws is not None
    ]

    async def finish() -> None:
        await asyncio.gather(*watchers)

    return finish


async def session_hog(url: str, n: int, run: Run, args: argparse.Namespace) -> Callable[[], Awaitable[None]]:
    hello = SplitClient(edge_config(url)).hello
    channels: list[Channel] = []

    async def one() -> None:
        ws = await hostile_connection(url)
        if ws is None:
            run.refused_at_connect += 1
            return
        channel = Channel(ws, 1 << 20)
        channels.append(channel)
        try:
            await channel.request(hello, 30)
            for request_id in range(1000):
                reply, _ = await channel.request(OpenSession(request_id=request_id), 30)
                if isinstance(reply, SessionOpened):
                    run.sessions_held += 1
        except TooManySessions:
            return  # this connection holds all it may
        except (SplitspecError, ConnectionClosed):
            run.refused_at_connect += 1

    await asyncio.gather(*(one() for _ in range(n)))

    async def finish() -> None:
        for channel in channels:
            with contextlib.suppress(Exception):
                await channel.close()

    return finish


SCENARIOS: dict[str, Callable[..., Awaitable[Callable[[], Awaitable[None]]]]] = {
    "unauth_max_frame": unauth_max_frame,
    "session_hog": session_hog,
    "idle_flood": idle_flood,
}


async def run_scenario(
    name: str, n: int, repeat: int, url: str, pid: int, edge: EdgeModel, prompt_ids: list[int], args: argparse.Namespace
) -> Run:
    """One scenario against the running server at ``url`` (process ``pid``)."""
    run = Run(scenario=name, repeat=repeat, hostile=n if name != "baseline" else 0)
    await asyncio.sleep(args.settle_s)  # the previous scenario's connections are gone
    run.rss_before_mb = rss_mb(pid)
    with RssPeak(pid) as peak:
        finish = await SCENARIOS[name](url, n, run, args) if name != "baseline" else None
        await legit_generation(url, edge, prompt_ids, args.tokens, run)
        if finish is not None:
            await finish()
    run.rss_peak_mb = peak.peak
    run.rss_growth_mb = max(0.0, peak.peak - run.rss_before_mb)
    run.mb_per_hostile = run.rss_growth_mb / n if name != "baseline" else 0.0
    return run


async def run_repeat(
    repeat: int, edge: EdgeModel, prompt_ids: list[int], args: argparse.Namespace, token: Path
) -> list[Run]:
    """A fresh server, warmed by one legitimate generation, then every scenario in a rotated order."""
    plan = [("baseline", 0), ("unauth_max_frame", args.hostile), *(("session_hog", n) for n in args.hog)]
    plan.append(("idle_flood", args.hostile))
    plan = plan[repeat % len(plan) :] + plan[: repeat % len(plan)]  # interleaved: each repeat starts elsewhere
    port = free_port()
    proc = start_trunk(port, token, args)
    url = f"ws://127.0.0.1:{port}"
    runs = []
    try:
        warm = Run("warm-up", repeat, 0)
        await legit_generation(url, edge, prompt_ids, args.tokens, warm)  # compute buffers allocated once
        if warm.legit_error:
            raise RuntimeError(f"warm-up generation failed: {warm.legit_error}")
        for name, n in plan:
            run = await run_scenario(name, n, repeat, url, proc.pid, edge, prompt_ids, args)
            run.identical = run.legit_error is None and run.legit_tokens == warm.legit_tokens
            log.warning(
                "repeat %d %s N=%d: identical %s, legit %.2f s, RSS +%.1f MB, closed %d/%d, refused %d, sessions %d%s",
                *(repeat, name, n, run.identical, run.legit_wall_s, run.rss_growth_mb, run.closed_by_server),
                *(n, run.refused_at_connect, run.sessions_held),
                f", legit error {run.legit_error}" if run.legit_error else "",
            )
            runs.append(run)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    return runs


async def main_async(args: argparse.Namespace) -> list[Run]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(MODEL, local_files_only=True)
    prompt_ids = list(tokenizer.encode(PROMPT))
    edge = SplitClient(edge_config("ws://127.0.0.1:1")).model  # loaded once, shared by every run
    runs: list[Run] = []
    with tempfile.TemporaryDirectory() as tmp:
        token = Path(tmp) / "token"
        token.write_text(TOKEN)
        os.chmod(token, 0o600)
        for repeat in range(args.repeats):
            runs += await run_repeat(repeat, edge, prompt_ids, args, token)
    return runs


# -- report --------------------------------------------------------------------------------------------


def summarize(runs: list[Run], args: argparse.Namespace) -> list[dict[str, Any]]:
    """One row per (scenario, N): medians over the repeats, and the worst case where it matters."""
    rows = []
    baseline_wall = statistics.median(r.legit_wall_s for r in runs if r.scenario == "baseline")
    keys = sorted(
        {(r.scenario, r.hostile) for r in runs},
        key=lambda k: (list(SCENARIOS).index(k[0]) + 1 if k[0] in SCENARIOS else 0, k[1]),
    )
    for name, n in keys:
        group = [r for r in runs if r.scenario == name and r.hostile == n]
        latencies = [x for r in group for x in r.close_latency_s]
        # a connection the server never closed has no latency: counted here, so that it cannot pass unseen
        never_closed = sum(max(0, r.hostile - r.closed_by_server - r.refused_at_connect) for r in group)
        never_closed = never_closed if name in MUST_CLOSE else 0
        rows.append(
            {
                "scenario": name,
                "hostile": n,
                "repeats": len(group),
                "identical": sum(bool(r.identical) for r in group),
                "legit_errors": sorted({r.legit_error for r in group if r.legit_error}),
                "legit_wall_s": statistics.median(r.legit_wall_s for r in group),
                "legit_wall_ratio": statistics.median(r.legit_wall_s for r in group) / baseline_wall,
                "rss_growth_mb": statistics.median(r.rss_growth_mb for r in group),
                "mb_per_hostile": statistics.median(r.mb_per_hostile for r in group),
                "refused_at_connect": statistics.median(r.refused_at_connect for r in group),
                "closed_by_server": statistics.median(r.closed_by_server for r in group),
                "close_median_s": statistics.median(latencies) if latencies else None,
                "close_max_s": max(latencies) if latencies else None,
                "never_closed": never_closed,  # summed over the repeats
                "within_deadline": never_closed == 0
                and all(x <= args.handshake_timeout + args.close_slack_s for x in latencies),
                "close_codes": sorted({c for r in group for c in r.close_codes}),
                "sessions_held": statistics.median(r.sessions_held for r in group),
            }
        )
    return rows


def deadline_cell(row: dict[str, Any]) -> str:
    """The report's "within deadline" cell: yes, NO, or NO with the connections the server never closed."""
    if row["within_deadline"]:
        return "yes"
    return f"NO ({row['never_closed']} never closed)" if row["never_closed"] else "NO"


def exit_status(rows: list[dict[str, Any]]) -> int:
    """0 when every run's legitimate output was identical and every hostile connection was closed in time."""
    return 0 if all(r["identical"] == r["repeats"] and r["within_deadline"] for r in rows) else 1


def write_report(runs: list[Run], rows: list[dict[str, Any]], args: argparse.Namespace, env: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    (out / "abuse.json").write_text(json.dumps({"environment": env, "settings": settings, "summary": rows}, indent=2))
    write_jsonl_gz(out / "runs.jsonl.gz", (asdict(r) for r in runs), commit=env["commit"], splitspec=env["splitspec"])

    def fmt(x: float | None, spec: str = ".2f") -> str:
        return "–" if x is None else format(x, spec)

    lines = [
        f"Abuse benchmark at commit `{env['commit'][:12]}`: a fresh trunk server (demo model, shared secret, "
        f"handshake deadline {args.handshake_timeout:g} s, {args.max_message_mb} MiB message cap) per repeat, "
        "scenarios in a rotated order; "
        f"a legitimate greedy generation of {args.tokens} tokens from 127.0.0.1 (speculation off) while N hostile "
        f'clients connect from 127.0.0.2; {args.repeats} interleaved repeats, medians. "Within deadline": every '
        f"hostile connection refused, or its close seen here at most {args.close_slack_s:g} s past the deadline.",
        "",
        "| scenario | N | legit output identical | legit time vs baseline | server RSS growth, MB | "
        "MB per hostile connection | refused at connect | closed by server | close time median / max, s | "
        "within deadline | close codes | sessions held by hostile |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['scenario']} | {r['hostile']} | {r['identical']}/{r['repeats']} | {r['legit_wall_ratio']:.2f}x | "
            f"{r['rss_growth_mb']:.1f} | {r['mb_per_hostile']:.3f} | {r['refused_at_connect']:g} | "
            f"{r['closed_by_server']:g} | {fmt(r['close_median_s'])} / {fmt(r['close_max_s'])} | "
            f"{deadline_cell(r)} | {', '.join(map(str, r['close_codes'])) or '–'} | "
            f"{r['sessions_held']:g} |"
        )
    for r in rows:
        for error in r["legit_errors"]:
            lines.append(f"\n- {r['scenario']} N={r['hostile']}: the legitimate client failed: `{error}`")
    lines.append(
        "\nClose codes: 1006 dropped without a close frame, 1008 policy violation (no handshake within the deadline), "
        "1009 message too big "
        "(the pre-handshake frame cap), 1013 try again later (a per-address or handshake-count limit). "
        "Reproduce: `nice -n 10 python benchmarks/abuse.py`."
    )
    (out / "abuse.md").write_text("\n".join(lines) + "\n")
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
    labels = [f"{r['scenario']}\nN={r['hostile']}" for r in rows]
    left.bar(labels, [r["rss_growth_mb"] for r in rows])
    left.set_ylabel("server RSS growth, MB (median)")
    left.set_title("server memory under hostile load")
    right.bar(labels, [r["close_max_s"] or 0.0 for r in rows])
    right.axhline(args.handshake_timeout, color="red", linestyle="--", label="handshake deadline")
    right.set_ylabel("slowest close of a hostile connection, s")
    right.set_title("hostile connections closed by the server")
    right.legend()
    for ax in (left, right):
        ax.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(out / "abuse.png", dpi=110)
    print("\n".join(lines))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--hostile", type=int, default=32, help="unauthenticated / idle hostile connections (default 32)"
    )
    parser.add_argument(
        "--hog", type=int, nargs="+", default=[4, 32], help="session-hogging connections, one run each (default 4 32)"
    )
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats of every scenario")
    parser.add_argument("--tokens", type=int, default=16, help="tokens the legitimate client generates")
    parser.add_argument("--handshake-timeout", type=float, default=10.0, help="the server's handshake deadline, s")
    parser.add_argument("--max-message-mb", type=int, default=16, help="the server's message cap, MiB")
    parser.add_argument(
        "--close-slack-s",
        type=float,
        default=1.0,
        help="seconds past the handshake deadline a close may be seen and count as within it (default 1: this "
        "process notices a close when its event loop, shared with the legitimate client, gets to it)",
    )
    parser.add_argument(
        "--settle-s",
        type=float,
        default=1.0,
        help="pause before each scenario, s, for the last one's connections to go (default 1)",
    )
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/abuse"))
    args = parser.parse_args()
    if args.settle_s < 0:
        parser.error(f"--settle-s must not be negative, got {args.settle_s}")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")
    logging.getLogger("splitspec").setLevel(logging.ERROR)  # the edge warns about stock demo weights
    env = run_environment()
    runs = asyncio.run(main_async(args))
    rows = summarize(runs, args)
    write_report(runs, rows, args, env)
    return exit_status(rows)


if __name__ == "__main__":
    raise SystemExit(main())
