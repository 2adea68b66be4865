"""Prometheus metrics of the trunk server (prometheus-client), one registry per server.

Counters and histograms are updated as steps are served; the session store's state (sessions
open, KV bytes held, evictions) is read at scrape time. Every name starts with ``splitspec_trunk_``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator

import torch
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from splitspec.cloud.sessions import SessionStore
from splitspec.models.masks import is_chain
from splitspec.prometheus_labels import labelled

_MS_BUCKETS = (0.25, 0.5, 1, 2, 5, 10, 20, 40, 80, 160, 320, 640, 1280, 2560)
_COUNT_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
_TOKEN_BUCKETS = (1, 4, 16, 64, 128, 256, 512, 1024, 2048, 4096)
P = "splitspec_trunk_"


def step_kind(parents: torch.Tensor) -> str:
    """``decode`` (one token), ``prefill`` (a chain of several) or ``tree`` (a draft tree)."""
    if parents.shape[0] == 1:
        return "decode"
    return "prefill" if is_chain(parents) else "tree"


class _StoreCollector(Collector):
    """The session store's state, read when scraped."""

    def __init__(self, store: SessionStore) -> None:
        self.store = store

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        store = self.store
        yield GaugeMetricFamily(P + "sessions_open", "live sessions", value=len(store))
        yield GaugeMetricFamily(P + "sessions_busy", "sessions with a step queued or computing", value=store.busy())
        yield GaugeMetricFamily(P + "kv_bytes_used", "KV cache memory the sessions hold, bytes", value=store.kv_bytes())
        budget = store.budget.budget_bytes if store.budget is not None else float("inf")
        yield GaugeMetricFamily(P + "kv_bytes_budget", "KV cache memory budget, bytes", value=budget)
        yield CounterMetricFamily(P + "evictions", "idle sessions evicted for KV memory", value=store.evictions)


class TrunkMetrics:
    """What the trunk's ``/metrics`` and ``/health`` expose.

    ``failure`` says why the server cannot serve steps (a background task it needs has ended), or
    None while it can; ``/health`` answers 503 with that reason.
    """

    def __init__(self, store: SessionStore, failure: Callable[[], str | None] = lambda: None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self._exposed = r  # what /metrics renders: the registry, or it with labels (label_samples)
        self.store = store
        self.failure = failure
        r.register(_StoreCollector(store))
        self.batch_size = Histogram(
            P + "batch_size", "steps computed together in one forward", buckets=_COUNT_BUCKETS, registry=r
        )
        self.batch_tokens = Histogram(
            P + "batch_tokens", "query tokens computed together in one forward", buckets=_TOKEN_BUCKETS, registry=r
        )
        self.queue_ms = Histogram(
            P + "queue_wait_milliseconds", "a step's wait for the compute worker", buckets=_MS_BUCKETS, registry=r
        )
        self.compute_ms = Histogram(
            P + "compute_milliseconds",
            "one forward through the trunk, with its copies",
            buckets=_MS_BUCKETS,
            registry=r,
        )
        self.steps = Counter(P + "steps", "steps served, by kind (decode, tree, prefill)", ["kind"], registry=r)
        self.step_tokens = Counter(P + "step_tokens", "query tokens served, by step kind", ["kind"], registry=r)
        self.wire_bytes = Counter(
            P + "wire_bytes", "frame bytes by direction (in, out) and message type", ["direction", "type"], registry=r
        )
        self.errors = Counter(P + "errors", "refusals and failures sent, by error code", ["code"], registry=r)

    def observe_batch(self, steps: int, tokens: int, compute_ms: float) -> None:
        self.batch_size.observe(steps)
        self.batch_tokens.observe(tokens)
        self.compute_ms.observe(compute_ms)

    def label_samples(self, labels: dict[str, str]) -> None:
        """Put ``labels`` on every sample ``/metrics`` shows (a Ray Serve replica: which one answered)."""
        self._exposed = labelled(self.registry, labels)

    def render(self) -> tuple[int, str, str]:
        """The ``/metrics`` answer: (status, content type, body)."""
        return 200, CONTENT_TYPE_LATEST, generate_latest(self._exposed).decode()

    def health(self) -> tuple[int, str, str]:
        """The ``/health`` answer: serving, with its load; 503 with the reason when steps cannot be served."""
        store = self.store
        body: dict[str, str | int] = {"status": "ok", "sessions": len(store), "kv_bytes_used": store.kv_bytes()}
        if store.budget is not None:
            body["kv_bytes_budget"] = store.budget.budget_bytes
        failure = self.failure()
        if failure is not None:
            body |= {"status": "failing", "error": failure}
            return 503, "application/json", json.dumps(body)
        return 200, "application/json", json.dumps(body)
