"""Constant labels on every sample of a Prometheus registry: which process answered a scrape.

A scrape of a port several processes share (``serve --workers N``, a trunk's Ray Serve replicas
behind one proxy) reaches one of them. Without a label of its own on every sample, the
processes' counters would read as one series that jumps back and forth (resets to a rate).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.registry import Collector


class _Labelled(Collector):
    """Every metric of ``inner`` with ``labels`` added to each sample."""

    def __init__(self, inner: CollectorRegistry, labels: Mapping[str, str]) -> None:
        self.inner, self.labels = inner, dict(labels)

    def collect(self) -> Iterator[Metric]:
        for metric in self.inner.collect():
            out = Metric(metric.name, metric.documentation, metric.type, metric.unit)
            out.samples = [s._replace(labels={**self.labels, **s.labels}) for s in metric.samples]
            yield out


def labelled(registry: CollectorRegistry, labels: Mapping[str, str]) -> CollectorRegistry:
    """A registry exposing ``registry``'s metrics with ``labels`` on every sample (read at each scrape)."""
    out = CollectorRegistry()
    out.register(_Labelled(registry, labels))
    return out
