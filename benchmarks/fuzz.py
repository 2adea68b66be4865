"""Fuzz every decoder and the in-process server handlers with mutated and random inputs.

Targets: split frames (``decode_frame``), split messages (``decode_message``), federated
messages (``decode_fed``), the federated top-K codec (``decode_topk``), and the two servers'
per-connection handlers (the trunk server's and the SpecFed worker's ``handle``), fed frames in
process without a socket, before and after a valid handshake, on the shipped demo models.

For each input it records:

* a **crash**: an exception outside splitspec's documented tree (``SplitspecError``); for a
  handler, any exception escaping ``handle``, a ``server_error`` reply (a bug of ours), or a reply
  the peer's own decoder refuses;
* a **hang**: one input taking more than 1 s of CPU time (``time.process_time``: the process's
  own compute, whatever the machine's load); an input still running after 30 s of wall-clock time
  is interrupted (SIGALRM) and counted as a hang too, so a true infinite loop cannot stall the run.
  Inputs over 1 s of wall-clock time are counted apart as **stalls** (on a loaded machine the
  scheduler, not the input, can cause those). Before the run, a self-check feeds a target that
  computes past the threshold, one that spins forever and one that sleeps past it, and stops
  unless the first two are counted as hangs and all three as stalls;
* **memory**: on every ``--mem-every``-th input and on a set of large inputs, the peak of traced
  allocations (Python objects and numpy buffers, via tracemalloc) while decoding, per input byte.

Inputs come from valid seeds of every message type, mutated (bit flips, interesting bytes,
inserts, deletes, truncation, splices, JSON header values replaced by hostile ones: huge ints,
NaN, lone surrogates, deep nesting, long strings) or drawn at random. Results go to
``--out`` as JSON, a markdown table and a PNG; the run stops early at ``--time-budget-s`` and
reports what it ran.

    nice -n 10 python benchmarks/fuzz.py --inputs 1000000 --out benchmarks/results/fuzz
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import signal
import struct
import time
import tracemalloc
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import splitspec
from splitspec.exceptions import SplitspecError
from splitspec.federated.codec import decode_topk, encode_topk
from splitspec.federated.topk import TopKPolicy, select_topk
from splitspec.protocol.fed import (
    FedHello,
    FedMessage,
    FedScore,
    FedScores,
    FedWelcome,
    ValueCodec,
    decode_fed,
    encode_fed,
)
from splitspec.protocol.frames import PREFIX_SIZE, decode_frame
from splitspec.protocol.messages import (
    CacheCommand,
    CloseSession,
    Error,
    Hello,
    Message,
    OpenSession,
    SessionClosed,
    SessionOpened,
    Step,
    StepResult,
    Welcome,
    decode_message,
    encode_message,
)
from splitspec.protocol.trunk_fingerprint import TrunkFingerprint
from splitspec.run_info import run_environment
from splitspec.transport.server import Peer

HANG_S = 1.0  # an input using more CPU time than this is a hang (more wall-clock time: a stall), seconds
ABORT_S = 30.0  # an input still running after this long is interrupted (and counted as a hang), seconds
ASSETS = Path(splitspec.__file__).parent / "assets" / "models"
HOSTILE_JSON = [
    "18446744073709551616",
    "-1",
    "1e308",
    "NaN",
    "Infinity",
    '"\\ud800"',
    "[" * 3000 + "]" * 3000,
    '"' + "x" * 60000 + '"',
    "9" * 5000,
    "[]",
    "{}",
    "true",
    "null",
    "0.5",
    '"float16"',
    "4294967296",
]


# -- seeds -----------------------------------------------------------------------------------------


def split_seeds() -> list[bytes]:
    """One valid frame of every split message type."""
    q, h = 4, 256
    step = Step(
        "0123456789abcdef",
        3,
        torch.randn(1, q, h),
        torch.arange(10, 10 + q, dtype=torch.int32),
        torch.tensor([-1, 0, 0, 1], dtype=torch.int32),
        CacheCommand(keep_last=(0, 2)),
    )
    messages: list[Message] = [
        Hello(fingerprint="f" * 16, layer_start=2, layer_end=6, dtype="float32", hidden_size=h, auth_token="t"),
        Welcome(
            server="s",
            max_message_bytes=1 << 24,
            max_query_tokens=2048,
            session_ttl_s=300.0,
            trunk=TrunkFingerprint(2, 6, "float32", "0123456789abcdef" * 2),
            dtype="float32",
        ),
        OpenSession(request_id=1),
        SessionOpened(request_id=1, session_id="0123456789abcdef"),
        step,
        StepResult("0123456789abcdef", 3, torch.randn(1, q, h), 1.5),
        CloseSession("0123456789abcdef"),
        SessionClosed("0123456789abcdef"),
        Error(code="bad_tensor", message="no", session_id="s", seq=1, fatal=False),
    ]
    return [encode_message(m) for m in messages]


def codec_seeds(vocab: int) -> list[tuple[bytes, int]]:
    """Valid top-K streams (with their position counts) in every value codec."""
    gen = torch.Generator().manual_seed(0)
    laws = torch.softmax(torch.randn(5, vocab, generator=gen) * 3, -1)
    out = []
    codecs: tuple[ValueCodec, ...] = ("quantized", "float16", "float32")
    for codec in codecs:
        for policy in (TopKPolicy(k=8), TopKPolicy(target_epsilon=0.1, max_k=200)):
            out.append((encode_topk(laws, select_topk(laws, policy), codec), 5))
    return out


def fed_seeds(vocab: int) -> list[bytes]:
    stream, _ = codec_seeds(vocab)[0]
    messages: list[FedMessage] = [
        FedHello(vocab_size=vocab, tokenizer_fingerprint="abc", auth_token=None),
        FedWelcome(
            worker="w",
            model_fingerprint="m",
            vocab_size=vocab,
            tokenizer_fingerprint="abc",
            max_message_bytes=1 << 24,
            max_query_tokens=4096,
            max_positions=1024,
        ),
        FedScore(
            seq=1, keep=0, tokens=torch.tensor([5, 6, 7, 8, 9], dtype=torch.int32), num_scored=3, temperature=1.0, k=8
        ),
        FedScore(
            seq=2,
            keep=3,
            tokens=torch.tensor([5, 6], dtype=torch.int32),
            num_scored=2,
            temperature=0.7,
            target_epsilon=0.05,
            max_k=64,
            epsilon_scope="round",
        ),
        FedScores(seq=1, positions=5, vocab_size=vocab, stream=stream, worker_ms=1.0),
        Error(code="bad_tensor", message="no", seq=1),
    ]
    return [encode_fed(m) for m in messages]


# -- mutation --------------------------------------------------------------------------------------


def mutate_header(rng: random.Random, data: bytes) -> bytes:
    """Replace one JSON value of a frame's header with a hostile one, keeping the frame's layout."""
    if len(data) < PREFIX_SIZE:
        return data
    (length,) = struct.unpack_from(">I", data, 6)
    try:
        header = json.loads(data[PREFIX_SIZE : PREFIX_SIZE + length])
    except (ValueError, RecursionError):
        return data
    if not isinstance(header, dict) or not header:
        return data
    text = json.dumps(header)
    key = rng.choice(list(header))
    value = json.dumps(header[key])
    text = text.replace(f'"{key}": {value}', f'"{key}": {rng.choice(HOSTILE_JSON)}', 1)
    if rng.random() < 0.2:  # or a descriptor's field
        text = text.replace('"nbytes": ', f'"nbytes": {rng.choice(["-1", "1e9", "0", "3"])}, "x": ', 1)
    raw = text.encode("utf-8", "surrogatepass")
    return data[:6] + struct.pack(">I", len(raw)) + raw + data[PREFIX_SIZE + length :]


def mutate(rng: random.Random, data: bytes, seeds: list[bytes]) -> bytes:
    """Apply one to four random byte-level or structural mutations."""
    buf = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(9)
        n = len(buf)
        if op == 0 and n:  # flip a bit
            i = rng.randrange(n)
            buf[i] ^= 1 << rng.randrange(8)
        elif op == 1 and n:  # an interesting byte
            buf[rng.randrange(n)] = rng.choice([0, 0xFF, 0x7F, 0x80, 0x01, 0x20, 0x22, 0x5B])
        elif op == 2:  # insert random bytes
            i = rng.randint(0, n)
            buf[i:i] = rng.randbytes(rng.randint(1, 16))
        elif op == 3 and n:  # delete a range
            i = rng.randrange(n)
            del buf[i : i + rng.randint(1, 16)]
        elif op == 4 and n:  # truncate
            del buf[rng.randrange(n) :]
        elif op == 5 and n:  # duplicate a range
            i = rng.randrange(n)
            buf[i:i] = buf[i : i + rng.randint(1, 64)]
        elif op == 6:  # splice with another seed
            other = rng.choice(seeds)
            buf = buf[: rng.randint(0, n)] + other[rng.randint(0, len(other)) :]
        elif op == 7:  # hostile header value
            buf = bytearray(mutate_header(rng, bytes(buf)))
        elif op == 8 and n >= 4:  # overwrite a 32-bit field with an extreme value
            i = rng.randrange(n - 3)
            buf[i : i + 4] = struct.pack(">I", rng.choice([0, 1, 0xFFFFFFFF, 0x7FFFFFFF, 1 << 24]))
    return bytes(buf)


def random_input(rng: random.Random, seeds: list[bytes]) -> bytes:
    """Random bytes, sometimes behind a valid prefix so they reach deeper checks."""
    body = rng.randbytes(rng.choice([0, 1, 4, 9, 10, 25, 64, 300, 2000]))
    if rng.random() < 0.5:
        seed = rng.choice(seeds)
        return seed[: rng.randint(0, min(len(seed), 40))] + body
    return body


# -- targets ---------------------------------------------------------------------------------------


@dataclass
class TargetStats:
    name: str
    inputs: int = 0
    crashes: int = 0
    hangs: int = 0
    refused: int = 0  # inputs refused with a documented error (the expected outcome for most)
    accepted: int = 0
    stalls: int = 0  # inputs over HANG_S of wall-clock time (scheduling included)
    wall_s: float = 0.0
    cpu_s: float = 0.0
    slowest_s: float = 0.0  # wall-clock
    slowest_cpu_s: float = 0.0
    mem_samples: int = 0
    max_peak_per_byte: float = 0.0  # over sampled inputs of >= 4 KiB
    max_peak_small_bytes: int = 0  # largest peak for inputs under 4 KiB, bytes
    largest_input_bytes: int = 0
    crash_examples: list[str] = field(default_factory=list)
    hang_examples: list[str] = field(default_factory=list)
    stall_examples: list[str] = field(default_factory=list)


SyncTarget = Callable[[bytes], object]


class InputHang(BaseException):
    """Raised by the watchdog in an input that ran past ABORT_S (not an Exception: nothing catches it)."""


def _abort_input(signum: int, frame: object) -> None:
    raise InputHang


class Watchdog:
    """Interrupts the input in progress after ``abort_s`` (SIGALRM, main thread)."""

    def __init__(self, abort_s: float = ABORT_S) -> None:
        self.abort_s = abort_s
        signal.signal(signal.SIGALRM, _abort_input)

    def __enter__(self) -> Watchdog:
        signal.setitimer(signal.ITIMER_REAL, self.abort_s)
        return self

    def __exit__(self, *exc: object) -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)


def run_sync(stats: TargetStats, fn: SyncTarget, data: bytes, measure: bool, abort_s: float = ABORT_S) -> None:
    """Time one input (wall and CPU), then, if ``measure``, run it again under tracemalloc for its memory."""
    t0, c0 = time.perf_counter(), time.process_time()
    outcome = _call(stats, fn, data, abort_s)
    record_time(stats, data, time.perf_counter() - t0, time.process_time() - c0, interrupted=outcome == "hang")
    if outcome == "crash":
        return
    if measure:  # tracing slows Python code several-fold: the timed run above is untraced
        tracemalloc.start()
        _call(TargetStats("memory"), fn, data, abort_s)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        record_memory(stats, data, peak)


def _call(stats: TargetStats, fn: SyncTarget, data: bytes, abort_s: float) -> str:
    try:
        with Watchdog(abort_s):
            fn(data)
    except SplitspecError:
        stats.refused += 1
        return "refused"
    except InputHang:
        return "hang"
    except Exception as exc:
        record_crash(stats, data, exc)
        return "crash"
    stats.accepted += 1
    return "accepted"


def record_crash(stats: TargetStats, data: bytes, exc: BaseException | str) -> None:
    stats.crashes += 1
    if len(stats.crash_examples) < 5:
        stats.crash_examples.append(f"{exc!r:.300} on {data[:80]!r}")


def record_time(stats: TargetStats, data: bytes, wall: float, cpu: float, interrupted: bool = False) -> None:
    stats.inputs += 1
    stats.wall_s += wall
    stats.cpu_s += cpu
    stats.slowest_s = max(stats.slowest_s, wall)
    stats.slowest_cpu_s = max(stats.slowest_cpu_s, cpu)
    if cpu > HANG_S or interrupted:
        stats.hangs += 1
        if len(stats.hang_examples) < 5:
            stats.hang_examples.append(f"{cpu:.2f} s CPU ({wall:.2f} s wall) on {data[:80]!r}")
    if wall > HANG_S:
        stats.stalls += 1
        if len(stats.stall_examples) < 5:
            stats.stall_examples.append(f"{wall:.2f} s wall ({cpu:.3f} s CPU) on {data[:80]!r}")


def check_hang_detection() -> None:
    """The hang detector must fire on compute, not on waiting: a target computing past HANG_S and one
    spinning forever are hangs; one sleeping past HANG_S is only a stall."""
    stats = TargetStats("self-check")

    def compute(_: bytes) -> None:
        start = time.process_time()
        while time.process_time() - start < HANG_S * 1.2:
            pass

    def spin(_: bytes) -> None:
        while True:
            pass

    run_sync(stats, compute, b"compute", measure=False)
    run_sync(stats, spin, b"spin", measure=False, abort_s=HANG_S * 1.5)
    run_sync(stats, lambda _: time.sleep(HANG_S * 1.2), b"sleep", measure=False)
    if stats.hangs != 2 or stats.stalls != 3 or stats.crashes or len(stats.hang_examples) != 2:
        raise SystemExit(f"hang detection self-check failed: {stats}")


def record_memory(stats: TargetStats, data: bytes, peak: int) -> None:
    stats.mem_samples += 1
    stats.largest_input_bytes = max(stats.largest_input_bytes, len(data))
    if len(data) >= 4096:
        stats.max_peak_per_byte = max(stats.max_peak_per_byte, peak / len(data))
    else:
        stats.max_peak_small_bytes = max(stats.max_peak_small_bytes, peak)


class Handlers:
    """The trunk server's and the fed worker's per-connection handlers, driven in process."""

    def __init__(self) -> None:
        from splitspec.cloud.config import CloudConfig
        from splitspec.cloud.server import TrunkServer
        from splitspec.federated.lm import load_model
        from splitspec.federated.worker import FedWorker, WorkerConfig

        self.trunk = TrunkServer(CloudConfig(model_dir=ASSETS / "base", port=0, max_sessions=100_000))
        loaded = load_model(ASSETS / "worker")
        self.worker = FedWorker(WorkerConfig(model_dir=ASSETS / "worker", port=0), loaded)
        ident = self.trunk.identity
        self.hello = encode_message(
            Hello(ident.fingerprint, ident.layer_start, ident.layer_end, ident.dtype, ident.hidden_size)
        )
        self.fed_hello = encode_fed(FedHello(loaded.vocab_size, loaded.tokenizer_fingerprint))
        self.trunk_peer: Any = None
        self.worker_peer: Any = None
        self.session = ""

    async def fresh_trunk_peer(self) -> Any:
        peer = self.trunk.new_peer("fuzz")
        await peer.handle(self.hello)
        reply, _ = await peer.handle(encode_message(OpenSession(request_id=1)))
        opened = decode_message(reply)
        if not isinstance(opened, SessionOpened):
            raise RuntimeError(f"cannot open a session: {opened}")
        self.session = opened.session_id
        return peer

    def trunk_seeds(self) -> list[bytes]:
        h = self.trunk.identity.hidden_size
        step = Step(
            self.session,
            1,
            torch.randn(1, 3, h),
            torch.arange(3, dtype=torch.int32),
            torch.arange(-1, 2, dtype=torch.int32),
        )
        return [
            self.hello,
            encode_message(OpenSession(request_id=2)),
            encode_message(step),
            encode_message(CloseSession(self.session)),
        ]

    def worker_seeds(self) -> list[bytes]:
        tokens = torch.tensor([5, 6, 7], dtype=torch.int32)
        return [
            self.fed_hello,
            encode_fed(FedScore(seq=1, keep=0, tokens=tokens, num_scored=2, temperature=1.0, k=8)),
            encode_fed(
                FedScore(seq=2, keep=0, tokens=tokens, num_scored=3, temperature=0.0, target_epsilon=0.1, max_k=50)
            ),
        ]

    async def run(self, stats: TargetStats, kind: str, data: bytes, handshaken: bool) -> None:
        decode: Callable[[bytes], object]
        peer: Peer
        if kind == "trunk":
            if not handshaken:
                peer = self.trunk.new_peer("fuzz")
            else:
                if self.trunk_peer is None:
                    self.trunk_peer = await self.fresh_trunk_peer()
                peer = self.trunk_peer
            decode = decode_message
        else:
            if not handshaken:
                peer = self.worker._new_peer("fuzz")
            else:
                if self.worker_peer is None:
                    self.worker_peer = self.worker._new_peer("fuzz")
                    await self.worker_peer.handle(self.fed_hello)
                peer = self.worker_peer
            decode = decode_fed
        t0, c0 = time.perf_counter(), time.process_time()  # CPU time of every thread (to_thread work too)
        try:
            with Watchdog():  # interrupts the handler even if it blocks the event loop
                reply, fatal = await asyncio.wait_for(peer.handle(data), ABORT_S)
        except (InputHang, TimeoutError):
            record_time(stats, data, time.perf_counter() - t0, time.process_time() - c0, interrupted=True)
            return
        except Exception as exc:
            record_crash(stats, data, exc)
            record_time(stats, data, time.perf_counter() - t0, time.process_time() - c0)
            return
        finally:
            if not handshaken:
                await peer.closed()  # a throwaway connection releases what its handshake took
        record_time(stats, data, time.perf_counter() - t0, time.process_time() - c0)
        try:
            answer = decode(reply)
        except SplitspecError as exc:
            record_crash(stats, data, f"reply refused by the peer's decoder: {exc}")
            return
        if isinstance(answer, Error):
            if answer.code == "server_error":
                record_crash(stats, data, f"server_error: {answer.message}")
            else:
                stats.refused += 1
        else:
            stats.accepted += 1
        if handshaken and (fatal or (isinstance(answer, Error) and answer.fatal)):
            await peer.closed()
            self.trunk_peer = None if kind == "trunk" else self.trunk_peer
            self.worker_peer = None if kind == "worker" else self.worker_peer


# -- driver ----------------------------------------------------------------------------------------


def large_inputs(rng: random.Random, split: list[bytes], fed: list[bytes]) -> dict[str, list[bytes]]:
    """Big inputs per target, for the memory figures (the mutated ones are small)."""
    mib = 1 << 20
    big_step = encode_message(
        Step(
            "s",
            1,
            torch.randn(1, 1024, 256),
            torch.arange(1024, dtype=torch.int32),
            torch.arange(-1, 1023, dtype=torch.int32),
        )
    )
    big_scores = FedScores(seq=1, positions=9, vocab_size=8192, stream=rng.randbytes(mib), worker_ms=1.0).to_bytes()
    noise = [rng.randbytes(mib), b"\0" * mib, b"\xff" * mib]
    frames = [big_step, mutate(rng, big_step, split), split[0][:PREFIX_SIZE] + rng.randbytes(mib), *noise]
    return {
        "frames": frames,
        "messages": frames,
        "fed_messages": [big_scores, *noise, fed[2][:PREFIX_SIZE] + rng.randbytes(mib)],
        "codec": [rng.randbytes(mib), b"\x55" * mib, b"\x80" + b"\0" * mib, *noise],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--inputs", type=int, default=1_000_000, help="inputs in all, over every target")
    parser.add_argument("--time-budget-s", type=float, default=3600.0, help="stop after this many seconds")
    parser.add_argument("--mem-every", type=int, default=500, help="measure memory on every N-th input")
    parser.add_argument("--seed", type=int, default=12)
    parser.add_argument("--no-handlers", action="store_true", help="decoders only (no model loading)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/fuzz"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.CRITICAL)  # the handlers log every refusal; keep the run quiet
    torch.set_num_threads(1)
    check_hang_detection()
    environment = run_environment()  # at the start: the code under test was imported from this tree
    rng = random.Random(args.seed)
    vocab = 8192
    split = split_seeds()
    fed = fed_seeds(vocab)
    codec = codec_seeds(vocab)
    codec_streams = [s for s, _ in codec]
    # share of the inputs per target (the handlers are slower: they get fewer)
    shares = {
        "frames": 0.22,
        "messages": 0.22,
        "fed_messages": 0.22,
        "codec": 0.22,
        "trunk_handler": 0.06,
        "worker_handler": 0.06,
    }
    if args.no_handlers:
        shares = {k: v for k, v in shares.items() if "handler" not in k}
    stats = {name: TargetStats(name) for name in shares}
    sync_targets: dict[str, tuple[SyncTarget, list[bytes]]] = {
        "frames": (decode_frame, split + fed),
        "messages": (decode_message, split),
        "fed_messages": (decode_fed, fed + split[:1]),
        "codec": (lambda d: decode_topk(d, 5, vocab, max_k=200), codec_streams),
    }
    handlers = None if args.no_handlers else Handlers()
    loop = asyncio.new_event_loop()
    handler_seeds: dict[str, list[bytes]] = {}
    if handlers is not None:
        loop.run_until_complete(handlers.fresh_trunk_peer())
        handler_seeds = {"trunk_handler": handlers.trunk_seeds(), "worker_handler": handlers.worker_seeds()}
        handlers.trunk_peer = None
    for name, inputs in large_inputs(rng, split, fed).items():
        fn, _ = sync_targets[name]
        for data in inputs:
            run_sync(stats[name], fn, data, measure=True)
    names = list(shares)
    weights = [shares[n] for n in names]
    t_start = time.perf_counter()
    done = 0
    while done < args.inputs and time.perf_counter() - t_start < args.time_budget_s:
        name = rng.choices(names, weights)[0]
        seeds = sync_targets[name][1] if name in sync_targets else handler_seeds[name]
        data = random_input(rng, seeds) if rng.random() < 0.25 else mutate(rng, rng.choice(seeds), seeds)
        measure = done % args.mem_every == 0
        if name in sync_targets:
            run_sync(stats[name], sync_targets[name][0], data, measure)
        elif handlers is not None:
            kind = "trunk" if name == "trunk_handler" else "worker"
            run: Awaitable[None] = handlers.run(stats[name], kind, data, handshaken=rng.random() < 0.7)
            loop.run_until_complete(run)
        done += 1
        if done % 50_000 == 0:
            crashes = sum(s.crashes for s in stats.values())
            print(f"{done} inputs, {time.perf_counter() - t_start:.0f} s, crashes {crashes}", flush=True)
    wall = time.perf_counter() - t_start
    loop.close()
    write_results(args, stats, done, wall, environment)
    return 0 if all(s.crashes == 0 and s.hangs == 0 for s in stats.values()) else 1


def write_results(
    args: argparse.Namespace, stats: dict[str, TargetStats], done: int, wall: float, environment: dict[str, Any]
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    args.out.mkdir(parents=True, exist_ok=True)
    commit = environment["commit"]
    result = {
        "commit": commit,
        "environment": environment,
        "inputs_requested": args.inputs,
        "inputs_run": done,
        "wall_s": wall,
        "hang_threshold_s": HANG_S,
        "hang_abort_s": ABORT_S,
        "hang_criterion": "CPU time (time.process_time) > hang_threshold_s, or interrupted after hang_abort_s wall",
        "stall_criterion": "wall-clock time > hang_threshold_s (scheduling included)",
        "hang_self_check": "passed (1.2 s of compute and an endless loop were hangs; a 1.2 s sleep only a stall)",
        "seed": args.seed,
        "targets": {name: s.__dict__ for name, s in stats.items()},
    }
    (args.out / "fuzz.json").write_text(json.dumps(result, indent=2))
    lines = [
        f"Fuzz run at commit `{commit[:12]}`: {done:,} inputs in {wall:.0f} s "
        f"(plus the large inputs), seed {args.seed}.",
        "",
        "| target | inputs | crashes | hangs (> 1 s CPU) | stalls (> 1 s wall) | refused | accepted | "
        "slowest, ms CPU | slowest, ms wall | mean, µs CPU | "
        "peak memory per input byte (inputs >= 4 KiB) | largest peak under 4 KiB, KiB | largest input, KiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in stats.values():
        mean_us = s.cpu_s / s.inputs * 1e6 if s.inputs else 0.0
        lines.append(
            f"| {s.name} | {s.inputs:,} | {s.crashes} | {s.hangs} | {s.stalls} | {s.refused:,} | {s.accepted:,} | "
            f"{s.slowest_cpu_s * 1e3:.1f} | {s.slowest_s * 1e3:.1f} | {mean_us:.0f} | {s.max_peak_per_byte:.2f} | "
            f"{s.max_peak_small_bytes / 1024:.1f} | {s.largest_input_bytes / 1024:.0f} |"
        )
    lines.append(
        f"\nHang detection self-check passed before the run: a target computing {HANG_S * 1.2:.1f} s and one "
        f"looping forever (interrupted after {HANG_S * 1.5:.1f} s) were both counted as hangs, and one "
        f"sleeping {HANG_S * 1.2:.1f} s only as a stall."
    )
    for s in stats.values():
        for example in s.crash_examples:
            lines.append(f"\n- crash in {s.name}: `{example}`")
        for example in s.hang_examples:
            lines.append(f"\n- hang in {s.name}: `{example}`")
        for example in s.stall_examples:
            lines.append(f"\n- stall in {s.name}: `{example}`")
    (args.out / "fuzz.md").write_text("\n".join(lines) + "\n")
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    names = list(stats)
    left.bar(names, [stats[n].inputs for n in names])
    left.set_ylabel("inputs")
    left.set_title("inputs per target (0 crashes, 0 hangs expected)")
    right.bar(names, [stats[n].max_peak_per_byte for n in names])
    right.axhline(8, color="red", linestyle="--", label="8x input")
    right.set_ylabel("peak traced bytes / input byte")
    right.set_title("decoder memory, inputs >= 4 KiB")
    right.legend()
    for ax in (left, right):
        ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(args.out / "fuzz.png", dpi=110)
    print("\n".join(lines))


if __name__ == "__main__":
    raise SystemExit(main())
