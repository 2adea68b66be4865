"""Prometheus metrics of the edge server (prometheus-client), one registry per app."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from splitspec.edge.engine import EdgeEngine
from splitspec.edge.sequence import StepStats
from splitspec.models.batcher import BatchLog
from splitspec.prometheus_labels import labelled

_MS_BUCKETS = (0.5, 1, 2, 5, 10, 20, 40, 80, 160, 320, 640, 1280, 2560)
_S_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 6.4, 12.8)


class ServeMetrics:
    """What ``/metrics`` exposes; every name starts with ``splitspec_serve_``. ``worker``: the process's
    index under ``serve --workers N``, a ``worker`` label on every sample (None: a lone server, no label)."""

    def __init__(self, worker: int | None = None) -> None:
        self.registry = CollectorRegistry()
        self._exposed = self.registry if worker is None else labelled(self.registry, {"worker": str(worker)})
        r = self.registry
        p = "splitspec_serve_"
        self.requests = Counter(p + "requests", "HTTP requests answered", ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.cached_tokens = Counter(p + "cached_prompt_tokens", "prompt tokens reused from a kept session", registry=r)
        self.completion_tokens = Counter(p + "completion_tokens", "tokens generated", registry=r)
        self.ttft = Histogram(
            p + "time_to_first_token_seconds", "request start to first token", buckets=_S_BUCKETS, registry=r
        )
        self.decode_rate = Histogram(
            p + "decode_tokens_per_second",
            "tokens after the first over the time after the first, per request",
            buckets=(1, 2, 5, 10, 20, 40, 80, 160, 320, 640),
            registry=r,
        )
        self.tokens_per_trip = Histogram(
            p + "tokens_per_round_trip",
            "tokens generated per decode round trip, per request",
            buckets=(1, 1.25, 1.5, 2, 2.5, 3, 4, 6, 8, 12),
            registry=r,
        )
        self.step_ms = Histogram(
            p + "step_milliseconds", "per round trip: network, edge, cloud, serialization", ["part"],
            buckets=_MS_BUCKETS, registry=r,
        )  # fmt: skip
        self.wire_bytes = Counter(p + "wire_bytes", "bytes to (up) / from (down) the trunk", ["direction"], registry=r)
        self.round_trips = Counter(p + "round_trips", "steps sent to the trunk", ["kind"], registry=r)
        self.recoveries = Counter(p + "recoveries", "lost cloud sessions recovered by replay", registry=r)
        self.errors = Counter(p + "errors", "failed requests by error type", ["type"], registry=r)
        self.active = Gauge(p + "sessions_active", "requests generating now", registry=r)
        self.idle = Gauge(p + "sessions_idle", "idle sessions kept for prefix reuse", registry=r)

    def observe_steps(self, steps: Sequence[StepStats]) -> None:
        for s in steps:
            self.round_trips.labels(s.kind).inc()
            self.wire_bytes.labels("up").inc(s.bytes_up)
            self.wire_bytes.labels("down").inc(s.bytes_down)
            for part in ("network_ms", "edge_ms", "cloud_ms", "serialize_ms", "edge_queue_ms", "cloud_queue_ms"):
                self.step_ms.labels(part.removesuffix("_ms")).observe(getattr(s, part))

    def watch_engine(self, engine: EdgeEngine) -> None:
        """Also expose the engine's batched forwards: per part (head, tail) and batch size (rows)."""
        self.registry.register(_EngineCollector(engine))

    def render(self) -> bytes:
        return generate_latest(self._exposed)


class _EngineCollector(Collector):
    """``splitspec_serve_edge_forwards_total`` and ``..._edge_forward_milliseconds_total`` by part and rows:
    the edge compute per forward (and per sequence: divide by rows) against the batch size. Part ``draft``
    counts the draft model's proposals run together in lockstep (decoding/lockstep.py): rows are proposals,
    each of several forwards, and its milliseconds those of all of them."""

    def __init__(self, engine: EdgeEngine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        p = "splitspec_serve_edge_"
        forwards = CounterMetricFamily(p + "forwards", "batched edge forwards", labels=["part", "rows"])
        ms = CounterMetricFamily(p + "forward_milliseconds", "their compute, milliseconds", labels=["part", "rows"])
        logs: dict[str, BatchLog] = {
            "head": self.engine.head_batches,
            "tail": self.engine.tail_batches,
            "draft": self.engine.draft_executor.lockstep_log,
        }
        for part, log in logs.items():
            for rows, (count, mean_ms) in log.snapshot().items():
                forwards.add_metric([part, str(rows)], count)
                ms.add_metric([part, str(rows)], count * mean_ms)
        yield forwards
        yield ms
        # the engine's measured choice on dear drafters under load (decoding/dear_gate.py)
        gate = self.engine.draft_executor.gate
        held = GaugeMetricFamily(
            p + "dear_drafters_held_back", "1 while the engine holds dear drafters back under load"
        )
        held.add_metric([], 1.0 if gate.holding_back else 0.0)
        yield held
        rates = GaugeMetricFamily(
            p + "dear_gate_tokens_per_second",
            "engine output tokens per second measured with dear drafters and without, by load band",
            labels=["sequences_from", "dear_drafters"],
        )
        for band, arms in sorted(gate.rates().items()):
            for allowed, value in arms.items():
                rates.add_metric([str(2**band), "allowed" if allowed else "held_back"], value)
        yield rates
