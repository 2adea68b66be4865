"""Fuzz every decoder and the in-process server handlers with mutated and random inputs.

Targets: split frames (``decode_frame``), split messages (``decode_message``), federated
messages (``decode_fed``), the federated top-K codec (``decode_topk``), and the two servers'
per-connection handlers (the trunk server's and the SpecFed worker's ``handle``), fed frames in
process without a socket, before and after a valid handshake, on the shipped demo models.

For each input it records:

* a **crash**: by the servers' own refusal policy (``splitspec.protocol.replies``), anything but a
  typed refusal: a decoder raising an exception other than a ``ProtocolError`` (``ConfigError`` and
  ``TransportError`` included) or a ``ServerError`` (the ``server_error`` code); for a handler, any
  exception escaping ``handle`` (a ``TimeoutError`` included), a ``server_error`` reply (a bug of
  ours), or a reply the peer's own decoder refuses;
* a **hang**: one input taking more than 1 s of CPU time (``time.process_time``: the process's
  own compute, whatever the machine's load); an input still running after 30 s of wall-clock time
  is interrupted (SIGALRM) and counted as a hang too, so a true infinite loop cannot stall the run.
  Inputs over 1 s of wall-clock time are counted apart as **stalls** (on a loaded machine the
  scheduler, not the input, can cause those). Before the run, a self-check feeds a target that
  computes past the threshold, one that spins forever and one that sleeps past it, and stops
  unless the first two are counted as hangs and all three as stalls;
* **memory**: on every ``--mem-every``-th input and on a set of large inputs (big raw, bf16 and int8
  steps among them), the peak while decoding, per input byte: the peak of traced allocations
  (Python objects, via tracemalloc, which does not see torch's buffers) and, for inputs of 1 MiB or
  more (the large ones; the kernel's counters are too coarse for small ones), the process's
  resident high-water growth (``VmHWM`` after ``/proc/self/clear_refs``, in a forked child with
  large allocations mmapped and freed pages returned first: it sees torch's buffers); the larger
  of the two is reported, both are kept apart in the JSON. Without ``/proc`` only the traced peak.

Inputs come from valid seeds of every message type (steps and their results in each wire codec:
raw, bf16, int8), mutated (bit flips, interesting bytes,
inserts, deletes, truncation, splices, JSON header values replaced by hostile ones: huge ints,
NaN, lone surrogates, deep nesting, long strings, other codec names) or drawn at random. The trunk
handler's handshaken connection holds one open session, which its seeds name (the session id is
put into each input as it is fed); the connection is replaced whenever that session is gone or a
session quota refuses it, so its steps reach the trunk instead of ``unknown_session``. Results go to
``--out`` as JSON, a markdown table and a PNG; the run stops early at ``--time-budget-s`` and
reports what it ran.

    nice -n 10 python benchmarks/fuzz.py --inputs 1000000 --out benchmarks/results/fuzz
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import ctypes.util
import json
import logging
import os
import random
import select
import signal
import struct
import time
import tracemalloc
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeGuard

import torch

import splitspec
from splitspec.exceptions import ProtocolError, ServerError, SplitspecError, UnknownSession
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
    '"int8"',
    '"bf16"',
    '"raw"',
    "4294967296",
]
SEED_SESSION = "5eed" * 4  # the session id the trunk handler's seeds carry: replaced by the live one as fed
RECYCLE_CODES = {"session_quota_exceeded", "too_many_sessions"}  # refusals that replace the trunk connection


# -- seeds -----------------------------------------------------------------------------------------


def split_seeds() -> list[bytes]:
    """One valid frame of every split message type."""
    q, h = 4, 256
    positions = torch.arange(10, 10 + q, dtype=torch.int32)
    parents = torch.tensor([-1, 0, 0, 1], dtype=torch.int32)
    step = Step("0123456789abcdef", 3, torch.randn(1, q, h), positions, parents, CacheCommand(keep_last=(0, 2)))
    coded: list[Message] = []  # the other wire codecs' paths of decode_hidden (a feature too in a result)
    for codec in ("int8", "bf16"):
        coded.append(Step("0123456789abcdef", 4, torch.randn(1, q, h), positions, parents, None, codec))
        coded.append(StepResult("0123456789abcdef", 4, torch.randn(1, q, h), 1.5, codec, feature=torch.randn(1, q, h)))
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
        *coded,
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
    max_peak_per_byte: float = 0.0  # over sampled inputs of >= 4 KiB: the larger of the two measures below
    max_peak_small_bytes: int = 0  # largest peak for inputs under 4 KiB, bytes
    max_rss_per_byte: float = 0.0  # resident high-water growth (torch buffers included), inputs >= RSS_MIN_BYTES
    max_traced_per_byte: float = 0.0  # tracemalloc's peak (Python objects only), inputs >= 4 KiB
    largest_input_bytes: int = 0
    refusal_codes: dict[str, int] = field(default_factory=dict)  # refusals by wire code
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
    """Time one input (wall and CPU), then, if ``measure``, run it again for its memory: under tracemalloc,
    and, for an input of at least RSS_MIN_BYTES, in a forked child for its resident high-water growth
    (see :func:`resident_peak`)."""
    t0, c0 = time.perf_counter(), time.process_time()
    outcome = _call(stats, fn, data, abort_s)
    record_time(stats, data, time.perf_counter() - t0, time.process_time() - c0, interrupted=outcome == "hang")
    if outcome in ("crash", "hang"):
        return
    if measure:  # tracing slows Python code several-fold: the timed run above is untraced
        tracemalloc.start()
        _call(TargetStats("memory"), fn, data, abort_s)
        _, traced = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        resident = resident_peak(fn, data, abort_s) if len(data) >= RSS_MIN_BYTES else None
        record_memory(stats, data, traced, resident)


def is_refusal(exc: BaseException) -> TypeGuard[ProtocolError]:
    """Whether the servers would answer ``exc`` with a typed refusal (``protocol.replies.refusal``): a
    ProtocolError with its own code. Anything else, ConfigError, TransportError and ServerError (whose
    code is ``server_error``) included, they report as ``server_error``: a bug of ours, so a crash here."""
    return isinstance(exc, ProtocolError) and not isinstance(exc, ServerError)


def _call(stats: TargetStats, fn: SyncTarget, data: bytes, abort_s: float) -> str:
    try:
        with Watchdog(abort_s):
            fn(data)
    except InputHang:
        return "hang"
    except Exception as exc:
        if is_refusal(exc):
            record_refusal(stats, exc.code)
            return "refused"
        record_crash(stats, data, exc)
        return "crash"
    stats.accepted += 1
    return "accepted"


M_MMAP_THRESHOLD = -3  # mallopt's parameter (glibc)
# the kernel's resident-size counters are approximate (per-CPU batches: tens of pages), so the resident figure
# is taken for inputs of at least this size only (the error is then a small fraction of the input), bytes
RSS_MIN_BYTES = 1 << 20
_LIBC: ctypes.CDLL | None = None


def _high_water() -> int:
    """The process's resident high-water mark (VmHWM), bytes. Read with bare os calls: a file object's
    buffers would touch fresh pages (~64 kB) and count as the input's."""
    fd = os.open("/proc/self/status", os.O_RDONLY)
    try:
        text = os.read(fd, 1 << 14)
    finally:
        os.close(fd)
    start = text.index(b"VmHWM:") + len(b"VmHWM:")
    return int(text[start : text.index(b"kB", start)]) * 1024


def _reset_high_water() -> None:
    """Set VmHWM to the current resident size (``clear_refs`` 5)."""
    fd = os.open("/proc/self/clear_refs", os.O_WRONLY)
    try:
        os.write(fd, b"5")
    finally:
        os.close(fd)


def rss_supported() -> bool:
    """Whether :func:`resident_peak` can measure here (Linux with glibc, /proc/self/clear_refs writable)."""
    global _LIBC
    if _LIBC is not None:
        return True
    name = ctypes.util.find_library("c")
    if not hasattr(os, "fork") or name is None or not os.access("/proc/self/clear_refs", os.W_OK):
        return False
    libc = ctypes.CDLL(name)
    if not hasattr(libc, "mallopt") or not hasattr(libc, "malloc_trim"):
        return False
    _LIBC = libc
    return True


def resident_peak(fn: SyncTarget, data: bytes, abort_s: float = ABORT_S) -> int | None:
    """The growth of resident memory while ``fn(data)`` runs, bytes (None where it cannot be measured).

    tracemalloc sees Python's allocations, not torch's (a 10 MB ``torch.empty`` shows as ~0.5 kB), so this
    reads the kernel's high-water mark instead, in a forked child (the fuzzer's own heap is left alone):
    large allocations are made to be mmapped (no reuse of the parent's free heap, which is resident
    already), ``fn(data)`` is run once to fault in the code it runs (a child refaults its libraries' pages),
    the freed pages are given back (``malloc_trim``), the high-water mark is reset to the current resident
    size (``clear_refs`` 5), and ``fn(data)`` is run again: the peak minus the size before it.
    """
    if not rss_supported():
        return None
    libc = _LIBC
    assert libc is not None
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report the figure through the pipe, never return into the caller's code
        peak = -1
        try:
            torch.set_num_threads(1)  # no OpenMP pool in a forked child
            libc.mallopt(M_MMAP_THRESHOLD, 64 * 1024)  # also ends glibc's dynamic threshold
            _call(TargetStats("warm"), fn, data, abort_s)
            libc.malloc_trim(0)
            _reset_high_water()
            before = _high_water()
            if _call(TargetStats("memory"), fn, data, abort_s) != "hang":
                peak = _high_water() - before
        finally:
            os.write(write, str(peak).encode())
            os._exit(0)
    os.close(write)
    try:
        ready, _, _ = select.select([read], [], [], 2 * abort_s + 30)
        answer = os.read(read, 64) if ready else b""
    finally:
        os.close(read)
        if not answer:
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    value = int(answer) if answer else -1
    return value if value >= 0 else None


def record_refusal(stats: TargetStats, code: str) -> None:
    stats.refused += 1
    stats.refusal_codes[code] = stats.refusal_codes.get(code, 0) + 1


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


def memory_method() -> str:
    """How the memory figures were measured (for the report)."""
    if rss_supported():
        return (
            "the larger of the resident high-water growth (VmHWM after clear_refs, in a forked child: torch's "
            f"buffers included; inputs of {RSS_MIN_BYTES >> 20} MiB or more, the large inputs) and tracemalloc's "
            "peak (Python objects; every measured input), per input byte"
        )
    return "tracemalloc's peak only (no /proc/self/clear_refs here: torch's buffers are not seen)"


def record_memory(stats: TargetStats, data: bytes, traced: int, resident: int | None = None) -> None:
    """One input's peak memory: ``traced`` by tracemalloc, ``resident`` the high-water growth (None: unmeasured)."""
    peak = max(traced, resident or 0)
    stats.mem_samples += 1
    stats.largest_input_bytes = max(stats.largest_input_bytes, len(data))
    if len(data) >= 4096:
        stats.max_peak_per_byte = max(stats.max_peak_per_byte, peak / len(data))
        stats.max_traced_per_byte = max(stats.max_traced_per_byte, traced / len(data))
        if resident is not None:
            stats.max_rss_per_byte = max(stats.max_rss_per_byte, resident / len(data))
    else:
        stats.max_peak_small_bytes = max(stats.max_peak_small_bytes, peak)


async def handle_once(
    stats: TargetStats, peer: Peer, data: bytes, abort_s: float = ABORT_S
) -> tuple[bytes, bool] | None:
    """Feed ``data`` to ``peer.handle`` and record its time; None when it hung or raised (a crash).

    Only this call's own deadline (and the watchdog) counts as a hang: a TimeoutError that ``handle``
    itself raises is an exception escaping it, a crash.
    """
    t0, c0 = time.perf_counter(), time.process_time()  # CPU time of every thread (to_thread work too)
    deadline = asyncio.timeout(abort_s)
    try:
        # the watchdog interrupts a handler that blocks the event loop (the deadline cannot fire then); it waits
        # a second longer, so that a handler awaiting past the deadline is cancelled by it, not by a signal
        # raised inside the loop's select (which no handler code could catch)
        with Watchdog(abort_s + 1.0):
            async with deadline:
                reply, fatal = await peer.handle(data)
    except InputHang:
        record_time(stats, data, time.perf_counter() - t0, time.process_time() - c0, interrupted=True)
        return None
    except Exception as exc:
        if isinstance(exc, TimeoutError) and deadline.expired():
            record_time(stats, data, time.perf_counter() - t0, time.process_time() - c0, interrupted=True)
            return None
        record_crash(stats, data, exc)
        record_time(stats, data, time.perf_counter() - t0, time.process_time() - c0)
        return None
    record_time(stats, data, time.perf_counter() - t0, time.process_time() - c0)
    return reply, fatal


class Handlers:
    """The trunk server's and the fed worker's per-connection handlers, driven in process."""

    def __init__(self, worker: bool = True) -> None:
        from splitspec.cloud.config import CloudConfig
        from splitspec.cloud.server import TrunkServer
        from splitspec.federated.lm import load_model
        from splitspec.federated.worker import FedWorker, WorkerConfig

        self.trunk = TrunkServer(CloudConfig(model_dir=ASSETS / "base", port=0, max_sessions=100_000))
        ident = self.trunk.identity
        self.hello = encode_message(
            Hello(ident.fingerprint, ident.layer_start, ident.layer_end, ident.dtype, ident.hidden_size)
        )
        self.worker: Any = None
        self.fed_hello = b""
        if worker:
            loaded = load_model(ASSETS / "worker")
            self.worker = FedWorker(WorkerConfig(model_dir=ASSETS / "worker", port=0), loaded)
            self.fed_hello = encode_fed(FedHello(loaded.vocab_size, loaded.tokenizer_fingerprint))
        self.trunk_peer: Any = None
        self.worker_peer: Any = None
        self.session = ""  # the session the handshaken trunk connection holds
        self.trunk_peers = 0  # handshaken trunk connections made (a new one when the session is gone)
        self.computing = False

    def start_compute(self) -> None:
        """The trunk's batcher (and TTL sweep) on the running loop, as ``TrunkServer.start`` does without a listener:
        without it every step that reaches the trunk fails (``the batcher is not running``)."""
        if not self.computing:
            self.trunk.start_compute()
            self.computing = True

    async def close(self) -> None:
        """Release the connections and stop the trunk's compute (on the loop that ran it)."""
        for peer in (self.trunk_peer, self.worker_peer):
            if peer is not None:
                await peer.closed()
        self.trunk_peer = self.worker_peer = None
        if self.computing:
            await self.trunk.stop_compute()
            self.computing = False

    async def fresh_trunk_peer(self) -> Any:
        self.start_compute()
        peer = self.trunk.new_peer("fuzz")
        await peer.handle(self.hello)
        reply, _ = await peer.handle(encode_message(OpenSession(request_id=1)))
        opened = decode_message(reply)
        if not isinstance(opened, SessionOpened):
            raise RuntimeError(f"cannot open a session: {opened}")
        if len(opened.session_id) != len(SEED_SESSION):  # the seeds' id is swapped in place: same length
            raise RuntimeError(f"session id {opened.session_id!r} is not {len(SEED_SESSION)} characters long")
        self.session = opened.session_id
        self.trunk_peers += 1
        return peer

    def trunk_seeds(self) -> list[bytes]:
        """Valid trunk frames; the steps and the close name :data:`SEED_SESSION` (the live session, once fed).
        The steps start by truncating the cache to 0, so each one is valid again after the last."""
        h = self.trunk.identity.hidden_size
        reset = CacheCommand(truncate_to=0)
        dtype = self.trunk.dtype  # a raw step carries the trunk's own dtype
        tree = Step(
            SEED_SESSION,
            1,
            torch.randn(1, 3, h, dtype=dtype),
            torch.tensor([0, 1, 1], dtype=torch.int32),
            torch.tensor([-1, 0, 0], dtype=torch.int32),
            reset,
        )
        chain = Step(
            SEED_SESSION,
            2,
            torch.randn(1, 3, h, dtype=dtype),
            torch.arange(3, dtype=torch.int32),
            torch.arange(-1, 2, dtype=torch.int32),
            reset,
        )
        decode = Step(
            SEED_SESSION,
            3,
            torch.randn(1, 1, h, dtype=dtype),
            torch.zeros(1, dtype=torch.int32),
            torch.tensor([-1], dtype=torch.int32),
            reset,
        )
        return [
            self.hello,
            encode_message(OpenSession(request_id=2)),
            encode_message(tree),
            encode_message(chain),
            encode_message(decode),
            encode_message(CloseSession(SEED_SESSION)),
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

    async def run(self, stats: TargetStats, kind: str, data: bytes, handshaken: bool, abort_s: float = ABORT_S) -> None:
        decode: Callable[[bytes], object]
        peer: Peer
        if kind == "trunk":
            self.start_compute()
            if not handshaken:
                peer = self.trunk.new_peer("fuzz")
            else:
                if self.trunk_peer is None:
                    self.trunk_peer = await self.fresh_trunk_peer()
                peer = self.trunk_peer
                data = data.replace(SEED_SESSION.encode(), self.session.encode())  # same length: framing intact
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
        try:
            handled = await handle_once(stats, peer, data, abort_s)
        finally:
            if not handshaken:
                await peer.closed()  # a throwaway connection releases what its handshake took
        if handled is None:
            return
        reply, fatal = handled
        try:
            answer = decode(reply)
        except SplitspecError as exc:
            record_crash(stats, data, f"reply refused by the peer's decoder: {exc}")
            return
        if isinstance(answer, Error):
            if answer.code == "server_error":
                record_crash(stats, data, f"server_error: {answer.message}")
            else:
                record_refusal(stats, answer.code)
        else:
            stats.accepted += 1
        if not handshaken:
            return
        if fatal or (isinstance(answer, Error) and answer.fatal):
            await peer.closed()
            self.trunk_peer = None if kind == "trunk" else self.trunk_peer
            self.worker_peer = None if kind == "worker" else self.worker_peer
        elif kind == "trunk" and (
            (isinstance(answer, Error) and answer.code in RECYCLE_CODES) or not self._session_alive()
        ):
            # the seeds' session is gone (closed, or a failed step closed it) or no session can be opened on
            # this connection: a fresh connection and session, so the next steps reach the trunk again
            await peer.closed()
            self.trunk_peer = None

    def _session_alive(self) -> bool:
        """Whether the handshaken trunk connection still holds the session its seeds name."""
        try:
            self.trunk.sessions.get(self.session, self.trunk_peer.conn_id)
        except UnknownSession:
            return False
        return True


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
    q = 4096  # the wire codecs' big steps: int8's decode peaks highest per input byte
    coded = [
        encode_message(
            Step(
                "s",
                1,
                torch.randn(1, q, 256),
                torch.arange(q, dtype=torch.int32),
                torch.arange(-1, q - 1, dtype=torch.int32),
                codec=codec,
            )
        )
        for codec in ("int8", "bf16")
    ]
    big_scores = FedScores(seq=1, positions=9, vocab_size=8192, stream=rng.randbytes(mib), worker_ms=1.0).to_bytes()
    noise = [rng.randbytes(mib), b"\0" * mib, b"\xff" * mib]
    frames = [big_step, *coded, mutate(rng, big_step, split), split[0][:PREFIX_SIZE] + rng.randbytes(mib), *noise]
    return {
        "frames": frames,
        "messages": frames,
        "fed_messages": [big_scores, *noise, fed[2][:PREFIX_SIZE] + rng.randbytes(mib)],
        "codec": [rng.randbytes(mib), b"\x55" * mib, b"\x80" + b"\0" * mib, *noise],
    }


def pick_input(rng: random.Random, seeds: list[bytes]) -> bytes:
    """One fuzz input: random bytes a quarter of the time, else a mutated seed."""
    return random_input(rng, seeds) if rng.random() < 0.25 else mutate(rng, rng.choice(seeds), seeds)


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
    if handlers is not None:  # the trunk's seeds name SEED_SESSION: the live session is put in as they are fed
        handler_seeds = {"trunk_handler": handlers.trunk_seeds(), "worker_handler": handlers.worker_seeds()}
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
        data = pick_input(rng, seeds)
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
    if handlers is not None:
        loop.run_until_complete(handlers.close())
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
        "memory_method": memory_method(),
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
        "peak memory per input byte (inputs >= 4 KiB) | of which resident / traced | "
        "largest peak under 4 KiB, KiB | largest input, KiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in stats.values():
        mean_us = s.cpu_s / s.inputs * 1e6 if s.inputs else 0.0
        lines.append(
            f"| {s.name} | {s.inputs:,} | {s.crashes} | {s.hangs} | {s.stalls} | {s.refused:,} | {s.accepted:,} | "
            f"{s.slowest_cpu_s * 1e3:.1f} | {s.slowest_s * 1e3:.1f} | {mean_us:.0f} | {s.max_peak_per_byte:.2f} | "
            f"{s.max_rss_per_byte:.2f} / {s.max_traced_per_byte:.2f} | "
            f"{s.max_peak_small_bytes / 1024:.1f} | {s.largest_input_bytes / 1024:.0f} |"
        )
    lines.append(
        f"\nHang detection self-check passed before the run: a target computing {HANG_S * 1.2:.1f} s and one "
        f"looping forever (interrupted after {HANG_S * 1.5:.1f} s) were both counted as hangs, and one "
        f"sleeping {HANG_S * 1.2:.1f} s only as a stall.\n\nMemory: {memory_method()}"
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
    right.set_ylabel("peak bytes / input byte")
    right.set_title("decoder memory, inputs >= 4 KiB")
    right.legend()
    for ax in (left, right):
        ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(args.out / "fuzz.png", dpi=110)
    print("\n".join(lines))


if __name__ == "__main__":
    raise SystemExit(main())
