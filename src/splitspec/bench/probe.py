"""Probe a live split deployment: separate link RTT from the fixed per-step overhead f(k).

Every split decode step costs ``RTT + f(k)`` where ``k`` is the number of query tokens in the
step and ``f(k)`` is everything that is not the network round trip: edge compute (head + tail),
cloud compute (trunk), serialization on both sides and the transfer of the payload itself. The
two terms have different owners (placement and routing vs. compute and batch shape), so the probe
measures them separately:

* **RTT** is the median round trip of tiny control messages (``OpenSession`` / ``CloseSession``
  pairs) on a dedicated connection to the same server through the same link. The server answers
  them without touching the model, so their round trip is the network plus a few microseconds of
  framing. (A WebSocket-level ping would be marginally purer but would mean importing
  ``websockets`` outside ``transport/``.)
* **f(k)** comes from real steps: after a committed prefix of ``context_tokens`` tokens, the probe
  sends steps of ``k`` random tokens (a chain) for each ``k`` and drops them again with
  ``keep(())`` (the drop rides on the next step, as in speculative decoding). The wall time of a
  step is ``network_ms + cloud_ms + edge_ms + serialize_ms`` from :class:`StepStats`, and
  ``f(k) = median(step) − RTT`` (:func:`~splitspec.netem.projection.fit_step_time`).

From ``RTT`` and ``f(k)`` it derives the break-even acceptance ``a*(k) = (RTT + f(k)) / (RTT + f(1))``
(speculation with ``k`` query tokens per step must commit more than ``a*`` tokens per step to beat
sequential decoding), the projected sequential throughput ``1000 / (RTT + f(1))`` over a range of
RTTs, and the rental cost per million output tokens at a given price per hour.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from splitspec.edge import EdgeConfig, SplitClient
from splitspec.edge.client import StepStats
from splitspec.exceptions import ConfigError, UnexpectedMessage
from splitspec.measure import median
from splitspec.models.checkpoint import Checkpoint
from splitspec.netem.projection import (
    StepTimeFit,
    cost_per_million_tokens,
    fit_step_time,
    projected_tok_s,
)
from splitspec.protocol.messages import CloseSession, Hello, OpenSession, SessionClosed, SessionOpened, Welcome
from splitspec.transport.client import Channel

__all__ = [
    "DEFAULT_PROJECTION_RTT_MS",
    "DEFAULT_QUERY_TOKENS",
    "ProbeConfig",
    "ProbeReport",
    "ProjectionRow",
    "StepBreakdown",
    "format_report",
    "measure_pings",
    "measure_steps",
    "probe",
    "step_total_ms",
]

log = logging.getLogger(__name__)

DEFAULT_QUERY_TOKENS: tuple[int, ...] = (1, 2, 4, 8, 16)
DEFAULT_PROJECTION_RTT_MS: tuple[float, ...] = (5.0, 20.0, 40.0, 80.0, 150.0)


@dataclass(frozen=True)
class ProbeConfig:
    """What to probe and how hard."""

    cloud_url: str  # trunk server (or the emulator in front of it), e.g. ws://127.0.0.1:8765
    model_dir: Path  # checkpoint directory; only the edge tensors are loaded
    edge_layers: tuple[int, int] = (2, 2)  # decoder layers kept on the edge (head, tail)
    dtype: str = "auto"  # compute dtype: auto follows the server's, a pinned one must equal it (wire_codec raw)
    wire_codec: str = "raw"  # how hidden states cross the link (protocol.codec)
    device: str = "auto"  # the edge's compute device: auto, cpu, cuda, cuda:N or mps
    auth_token: str | None = None  # shared secret, if the server requires one
    tls_ca_file: Path | None = None  # PEM CA bundle to verify a wss:// server; None = system store
    # the trunk the server must hold (as it logs it); None = hash model_dir's trunk layers (an edge-only copy needs it)
    trunk_fingerprint: str | None = None
    query_tokens: tuple[int, ...] = DEFAULT_QUERY_TOKENS  # step sizes k to time, tokens
    repeats: int = 10  # timed steps per k, count
    warmup: int = 2  # untimed steps per k before timing, count
    pings: int = 20  # control-message round trips for the RTT, count (each pair gives two)
    context_tokens: int = 32  # committed prefix the timed steps attend to, tokens
    projection_rtt_ms: tuple[float, ...] = DEFAULT_PROJECTION_RTT_MS  # RTTs to project at, ms
    dollars_per_hour: float | None = None  # rental price of the cloud side, USD/hour; None = skip
    seed: int = 0  # seed of the random probe tokens
    request_timeout_s: float = 60.0  # one request, seconds

    def __post_init__(self) -> None:
        if not self.query_tokens or any(k < 1 for k in self.query_tokens):
            raise ConfigError(f"query_tokens must be positive integers, got {self.query_tokens}")
        if 1 not in self.query_tokens:
            raise ConfigError("query_tokens must include 1 (the sequential step a*(k) is relative to)")
        if self.repeats < 1:
            raise ConfigError(f"repeats must be >= 1, got {self.repeats}")
        if self.warmup < 0:
            raise ConfigError(f"warmup must be >= 0, got {self.warmup}")
        if self.pings < 1:
            raise ConfigError(f"pings must be >= 1, got {self.pings}")
        if self.context_tokens < 1:
            raise ConfigError(f"context_tokens must be >= 1, got {self.context_tokens}")
        if any(r < 0 for r in self.projection_rtt_ms):
            raise ConfigError(f"projection RTTs must be >= 0 ms, got {self.projection_rtt_ms}")
        if self.dollars_per_hour is not None and self.dollars_per_hour < 0:
            raise ConfigError(f"dollars_per_hour must be >= 0, got {self.dollars_per_hour}")


@dataclass(frozen=True)
class StepBreakdown:
    """Medians over the timed steps of one step size ``k``."""

    query_tokens: int  # k, tokens
    n: int  # timed steps, count
    step_ms: float  # whole step as the edge saw it, milliseconds
    overhead_ms: float  # f(k) = step − RTT, milliseconds
    network_ms: float  # round trip minus reported cloud compute, milliseconds
    edge_ms: float  # head + tail compute on the edge, milliseconds
    cloud_ms: float  # trunk compute reported by the cloud, milliseconds
    serialize_ms: float  # edge-side encode + decode, milliseconds
    transfer_ms: float  # network_ms − RTT: payload transfer + cloud-side framing, milliseconds
    bytes_up: float  # request frame, bytes
    bytes_down: float  # reply frame, bytes


@dataclass(frozen=True)
class ProjectionRow:
    """Sequential decoding projected to one RTT, with the break-even of each k there."""

    rtt_ms: float  # assumed round-trip time, milliseconds
    step_ms: float  # RTT + f(1), milliseconds
    tok_s: float  # sequential throughput 1000 / (RTT + f(1)), tokens/second
    usd_per_million_tokens: float | None  # rental cost per 10⁶ output tokens, USD; None = no price
    break_even: dict[int, float]  # k -> a*(k) at this RTT, tokens/step


@dataclass(frozen=True)
class ProbeReport:
    """Everything one probe measured and derived."""

    cloud_url: str
    model_dir: str
    edge_layers: tuple[int, int]
    dollars_per_hour: float | None  # USD/hour, None = not priced
    ping_ms: tuple[float, ...]  # every control round trip, milliseconds
    fit: StepTimeFit  # RTT, f0 + f1·k and the per-k medians
    steps: tuple[StepBreakdown, ...]  # per-k breakdown, ascending k
    break_even_measured: dict[int, float]  # k -> a*(k) at the measured RTT, tokens/step
    projection: tuple[ProjectionRow, ...] = field(default=())

    @property
    def rtt_ms(self) -> float:
        """Median control round trip, milliseconds."""
        return self.fit.rtt_ms

    def overhead_ms(self, k: int) -> float:
        """Measured f(k) (median at a measured k, linear fit elsewhere), milliseconds."""
        return self.fit.overhead_ms(k, interpolate=True)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (string keys)."""
        fit = asdict(self.fit)
        return {
            "cloud_url": self.cloud_url,
            "model_dir": self.model_dir,
            "edge_layers": list(self.edge_layers),
            "rtt_ms": self.rtt_ms,
            "rtt_iqr_ms": self.fit.rtt_iqr_ms,
            "ping_ms": list(self.ping_ms),
            "overhead_fit": {
                "f0_ms": fit["f0_ms"],
                "f1_ms_per_token": fit["f1_ms_per_token"],
                "residual_rms_ms": fit["residual_rms_ms"],
                "n_steps": fit["n_steps"],
                "n_pings": fit["n_pings"],
            },
            "steps": [asdict(s) for s in self.steps],
            "break_even_measured": {str(k): v for k, v in self.break_even_measured.items()},
            "dollars_per_hour": self.dollars_per_hour,
            "projection": [
                {**asdict(row), "break_even": {str(k): v for k, v in row.break_even.items()}} for row in self.projection
            ],
        }


def step_total_ms(step: StepStats) -> float:
    """Wall time of one step as the edge saw it: round trip + edge compute + edge serialization."""
    return step.network_ms + step.cloud_ms + step.edge_ms + step.serialize_ms


async def measure_pings(
    url: str,
    hello: Hello,
    n: int,
    *,
    max_message_bytes: int = 1 << 20,
    timeout_s: float = 30.0,
    ca_file: Path | None = None,
) -> list[float]:
    """Round trips, in ms, of ``n`` OpenSession/CloseSession pairs (``2n`` samples).

    Uses a dedicated connection through the same link, so the timed requests never queue behind
    a step. The server answers both messages without model compute.
    """
    if n < 1:
        raise ValueError("n must be >= 1")
    channel = await Channel.connect(url, max_message_bytes=max_message_bytes, timeout_s=timeout_s, ca_file=ca_file)
    samples: list[float] = []
    try:
        welcome, _ = await channel.request(hello, timeout_s)
        if not isinstance(welcome, Welcome):
            raise UnexpectedMessage(f"expected a Welcome, got {welcome.TYPE!r}")
        for i in range(n):
            opened, ex_open = await channel.request(OpenSession(request_id=i), timeout_s)
            if not isinstance(opened, SessionOpened):
                raise UnexpectedMessage(f"expected SessionOpened, got {opened.TYPE!r}")
            closed, ex_close = await channel.request(CloseSession(opened.session_id), timeout_s)
            if not isinstance(closed, SessionClosed):
                raise UnexpectedMessage(f"expected SessionClosed, got {closed.TYPE!r}")
            samples.extend((ex_open.roundtrip_ms, ex_close.roundtrip_ms))
    finally:
        await channel.close()
    log.debug("pings to %s: median %.2f ms over %d", url, median(samples), len(samples))
    return samples


async def measure_steps(
    client: SplitClient,
    query_tokens: Sequence[int],
    *,
    repeats: int,
    warmup: int,
    context_tokens: int,
    vocab_size: int,
    seed: int = 0,
) -> list[StepStats]:
    """Time ``repeats`` steps of each size in ``query_tokens`` after a ``context_tokens`` prefix.

    Each timed step is dropped again with ``keep(())``, so every step sees the same context. The
    order of ``k`` rotates from one round to the next, so slow drift hits every ``k`` alike.
    Returns the timed steps' stats (warm-up excluded).
    """
    rng = random.Random(seed)
    ks = list(query_tokens)
    client.reset()
    await client.forward([rng.randrange(vocab_size) for _ in range(context_tokens)])
    timed: list[StepStats] = []
    for round_ in range(warmup + repeats):
        shift = round_ % len(ks)
        for k in ks[shift:] + ks[:shift]:
            await client.forward([rng.randrange(vocab_size) for _ in range(k)])
            client.keep(())
            if round_ >= warmup:
                timed.append(client.steps[-1])
    return timed


def build_report(config: ProbeConfig, pings: Sequence[float], steps: Sequence[StepStats]) -> ProbeReport:
    """Fit RTT + f(k) and derive the break-even and projection tables (pure; no I/O)."""
    fit = fit_step_time(list(pings), [s.query_tokens for s in steps], [step_total_ms(s) for s in steps])
    rtt = fit.rtt_ms
    breakdown = []
    for k in fit.query_tokens:
        group = [s for s in steps if s.query_tokens == k]
        network = median([s.network_ms for s in group])
        breakdown.append(
            StepBreakdown(
                query_tokens=k,
                n=len(group),
                step_ms=median([step_total_ms(s) for s in group]),
                overhead_ms=fit.overhead_ms(k, interpolate=True),
                network_ms=network,
                edge_ms=median([s.edge_ms for s in group]),
                cloud_ms=median([s.cloud_ms for s in group]),
                serialize_ms=median([s.serialize_ms for s in group]),
                transfer_ms=network - rtt,
                bytes_up=median([float(s.bytes_up) for s in group]),
                bytes_down=median([float(s.bytes_down) for s in group]),
            )
        )
    ks = fit.query_tokens
    f1 = fit.overhead_ms(1, interpolate=True)
    rows = []
    for r in config.projection_rtt_ms:
        tok_s = projected_tok_s(r, f1)
        rows.append(
            ProjectionRow(
                rtt_ms=float(r),
                step_ms=r + f1,
                tok_s=tok_s,
                usd_per_million_tokens=(
                    None if config.dollars_per_hour is None else cost_per_million_tokens(config.dollars_per_hour, tok_s)
                ),
                break_even={k: fit.break_even(k, r, interpolate=True) for k in ks},
            )
        )
    return ProbeReport(
        cloud_url=config.cloud_url,
        model_dir=str(config.model_dir),
        edge_layers=config.edge_layers,
        dollars_per_hour=config.dollars_per_hour,
        ping_ms=tuple(float(p) for p in pings),
        fit=fit,
        steps=tuple(breakdown),
        break_even_measured={k: fit.break_even(k, interpolate=True) for k in ks},
        projection=tuple(rows),
    )


async def probe(config: ProbeConfig, *, client: SplitClient | None = None) -> ProbeReport:
    """Run the probe against ``config.cloud_url`` (opening a client unless one is given)."""
    vocab_size = int(Checkpoint(config.model_dir).config.vocab_size)
    if client is None:
        edge = EdgeConfig(
            allow_stock_edge_weights=True,
            model_dir=config.model_dir,
            cloud_url=config.cloud_url,
            edge_layers=config.edge_layers,
            dtype=config.dtype,
            wire_codec=config.wire_codec,
            device=config.device,
            auth_token=config.auth_token,
            tls_ca_file=config.tls_ca_file,
            request_timeout_s=config.request_timeout_s,
            trunk_fingerprint=config.trunk_fingerprint,
        )
        async with SplitClient(edge) as own:
            return await probe(config, client=own)
    log.info("probing %s: %d pings, k in %s x %d", config.cloud_url, config.pings, config.query_tokens, config.repeats)
    pings = await measure_pings(
        config.cloud_url, client.hello, config.pings, timeout_s=config.request_timeout_s, ca_file=config.tls_ca_file
    )
    steps = await measure_steps(
        client,
        config.query_tokens,
        repeats=config.repeats,
        warmup=config.warmup,
        context_tokens=config.context_tokens,
        vocab_size=vocab_size,
        seed=config.seed,
    )
    # A second batch of pings after the steps: the RTT estimate then spans the whole probe.
    pings += await measure_pings(
        config.cloud_url, client.hello, config.pings, timeout_s=config.request_timeout_s, ca_file=config.tls_ca_file
    )
    return build_report(config, pings, steps)


def format_report(report: ProbeReport) -> str:
    """The human-readable tables the CLI prints."""
    fit = report.fit
    lines = [
        f"cloud {report.cloud_url}  model {report.model_dir}  "
        f"edge layers {report.edge_layers[0]},{report.edge_layers[1]}",
        f"RTT (control round trips): median {fit.rtt_ms:.2f} ms, IQR {fit.rtt_iqr_ms:.2f} ms, n={fit.n_pings}",
        f"fixed overhead fit: f(k) = {fit.f0_ms:.2f} ms + {fit.f1_ms_per_token:.3f} ms/token * k"
        f"  (residual RMS {fit.residual_rms_ms:.2f} ms over {fit.n_steps} steps)",
        "",
        "per-step medians by query tokens k (ms; f(k) = step - RTT; transfer = network - RTT):",
        f"{'k':>4} {'n':>4} {'step':>8} {'f(k)':>8} {'edge':>7} {'cloud':>7} {'serial':>7} "
        f"{'transfer':>8} {'B up':>8} {'B down':>8} {'a*(k)':>7}",
    ]
    for s in report.steps:
        lines.append(
            f"{s.query_tokens:>4} {s.n:>4} {s.step_ms:>8.2f} {s.overhead_ms:>8.2f} {s.edge_ms:>7.2f} "
            f"{s.cloud_ms:>7.2f} {s.serialize_ms:>7.2f} {s.transfer_ms:>8.2f} {s.bytes_up:>8.0f} "
            f"{s.bytes_down:>8.0f} {report.break_even_measured[s.query_tokens]:>7.3f}"
        )
    ks = [s.query_tokens for s in report.steps if s.query_tokens != 1]
    priced = report.dollars_per_hour is not None
    lines += [
        "",
        "sequential projection tok/s = 1000 / (RTT + f(1)); a*(k) = (RTT + f(k)) / (RTT + f(1))"
        + (f"; cost at ${report.dollars_per_hour:.2f}/h" if priced else ""),
        f"{'RTT ms':>7} {'step ms':>8} {'tok/s':>7}"
        + (f" {'$/Mtok':>8}" if priced else "")
        + "".join(f" {'a*(' + str(k) + ')':>7}" for k in ks),
    ]
    for row in report.projection:
        cost = f" {row.usd_per_million_tokens:>8.2f}" if row.usd_per_million_tokens is not None else ""
        lines.append(
            f"{row.rtt_ms:>7.1f} {row.step_ms:>8.2f} {row.tok_s:>7.2f}{cost}"
            + "".join(f" {row.break_even[k]:>7.3f}" for k in ks)
        )
    return "\n".join(lines)
