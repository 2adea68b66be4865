"""What ``gateway_load.py`` computes from what it collects: quantiles, a stream's deliveries and inter-token
latencies from its chunks' arrival times and the tokens each carried, the rate while every stream is active, and the
edge's forwards and a
round trip's parts from ``splitspec serve``'s ``/metrics``."""

from __future__ import annotations

import itertools
import math
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample


def quantile(values: list[float], q: float) -> float:
    """The nearest-rank ``q`` quantile: the smallest value with at least ``q`` of them at or below it (p99 of 100
    values is the 99th, not the largest)."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


BURST_FLOOR_S = 0.002  # content chunks closer than this arrived together, whatever the link


def burst_s(rtt_ms: float) -> float:
    """Content chunks of one stream closer than this are one delivery. Each of a stream's steps crosses the link,
    so its deliveries are at least one round trip apart; ``serve`` streamed a step's tokens as a chunk each until
    stop 64 (one chunk a step since), and on a busy machine they reached the client milliseconds apart (2-8 ms at one
    stream in stop 56's run, more under load). A quarter of the round trip tells the two apart."""
    return max(BURST_FLOOR_S, rtt_ms / 4e3)


def deliveries(chunks: list[float], counts: list[int], burst: float) -> list[tuple[float, float, int]]:
    """(arrival, gap, tokens) of every delivery after the first: content chunks (arrival times ``chunks``, carrying
    ``counts`` tokens each) less than ``burst`` seconds apart are one delivery (a speculative step's tokens,
    :func:`burst_s`); arrival: its last chunk's; gap: seconds since the previous delivery's last chunk."""
    bursts: list[list[tuple[float, int]]] = []
    for t, k in zip(chunks, counts, strict=True):
        if bursts and t - bursts[-1][-1][0] < burst:
            bursts[-1].append((t, k))
        else:
            bursts.append([(t, k)])
    return [(b[-1][0], b[-1][0] - previous[-1][0], sum(k for _, k in b)) for previous, b in itertools.pairwise(bursts)]


def token_latencies(chunks: list[float], counts: list[int], burst: float) -> list[tuple[float, float]]:
    """(arrival, seconds per token) for every token after the first: a delivery of k tokens that came g seconds
    after the previous delivery gives each of its k tokens g / k."""
    return [(at, gap / k) for at, gap, k in deliveries(chunks, counts, burst) for _ in range(k)]


def delivery_gaps(chunks: list[float], counts: list[int], burst: float) -> list[tuple[float, float]]:
    """(arrival, gap) per delivery: vLLM's inter-token latency (its benchmark appends the time since the last
    chunk for every chunk, and vLLM streams a speculative step's tokens as one chunk)."""
    return [(at, gap) for at, gap, _ in deliveries(chunks, counts, burst)]


def overlapping(
    chunks: list[float], counts: list[int], burst: float, window: tuple[float, float]
) -> tuple[list[float], list[float]]:
    """A stream's latencies that waited through part of ``window`` (start, end): (per token, per delivery). A
    delivery overlapped the window when it came after the window opened and its wait began before the window
    closed; each of its k tokens then counts, with g / k."""
    per_token: list[float] = []
    per_delivery: list[float] = []
    for at, gap, k in deliveries(chunks, counts, burst):
        if window[0] < at and at - gap < window[1]:
            per_delivery.append(gap)
            per_token += [gap / k] * k
    return per_token, per_delivery


def tpot(result: dict[str, Any]) -> float | None:
    """A request's time per output token after its first chunk (vLLM's TPOT); None when no token came after it."""
    chunks, after = result["chunks"], sum(result["counts"][1:])
    return (chunks[-1] - chunks[0]) / after if after else None


def arrived(result: dict[str, Any], until: float) -> int:
    """The tokens of a request's content chunks that arrived by ``until``."""
    return sum(k for t, k in zip(result["chunks"], result["counts"], strict=True) if t <= until)


def all_active_rate(per_stream: list[list[dict[str, Any]]], t0: float) -> float:
    """Output tok/s while every stream is active: from ``t0`` until the first stream finishes its last request.
    A level's wall time also holds its ramp-down, when the streams that finished early leave fewer running: a
    lower concurrency than the level's. Counted by the tokens of the content chunks that arrived by then."""
    until = float(min(stream[-1]["end"] for stream in per_stream))
    return sum(arrived(r, until) for stream in per_stream for r in stream) / (until - t0)


def metric_samples(text: str) -> list[Sample]:
    """Every sample of a /metrics page, by prometheus-client's own parser."""
    return [sample for family in text_string_to_metric_families(text) for sample in family.samples]


def edge_forwards(samples: list[Sample]) -> dict[tuple[str, int], tuple[float, float]]:
    """(part, rows) -> (forwards, total ms) from a /metrics page's samples."""
    slots = {"splitspec_serve_edge_forwards_total": 0, "splitspec_serve_edge_forward_milliseconds_total": 1}
    out: dict[tuple[str, int], list[float]] = {}
    for sample in samples:
        if sample.name in slots:
            key = (sample.labels["part"], int(sample.labels["rows"]))
            out.setdefault(key, [0.0, 0.0])[slots[sample.name]] = sample.value
    return {k: (v[0], v[1]) for k, v in out.items()}


def step_parts(samples: list[Sample]) -> dict[str, float]:
    """From a /metrics page's samples: per part of a round trip (network, edge, cloud, serialize) its total ms and
    count, as ``PART_ms`` and ``PART_n``; and the decode round trips and completion tokens."""
    suffixes = {"splitspec_serve_step_milliseconds_sum": "ms", "splitspec_serve_step_milliseconds_count": "n"}
    out: dict[str, float] = {}
    for sample in samples:
        if sample.name in suffixes:
            out[f"{sample.labels['part']}_{suffixes[sample.name]}"] = sample.value
        elif sample.name == "splitspec_serve_round_trips_total" and sample.labels.get("kind") == "decode":
            out["decode_trips"] = sample.value
        elif sample.name == "splitspec_serve_completion_tokens_total":
            out["completion_tokens"] = sample.value
    return out


def per_step(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What a level added to :func:`step_parts`: mean ms per round trip of each part, and tokens per decode trip."""
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    out = {
        f"{part}_ms": delta[f"{part}_ms"] / delta[f"{part}_n"]
        for part in ("network", "cloud_queue", "edge", "edge_queue", "cloud", "serialize")
        if delta.get(f"{part}_n")
    }
    if delta.get("decode_trips"):
        out["tokens_per_trip"] = delta.get("completion_tokens", 0.0) / delta["decode_trips"]
    return out
