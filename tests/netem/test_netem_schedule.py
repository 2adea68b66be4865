"""The pure timing model of one emulated link direction, and config validation."""

from __future__ import annotations

import itertools
import random

import pytest

from splitspec.exceptions import ConfigError
from splitspec.netem.schedule import JitterDistribution, LinkSchedule, NetemConfig


def test_delay_only() -> None:
    link = LinkSchedule(delay_s=0.040)
    assert link.release_time(1.0, 100) == pytest.approx(1.040)
    assert link.release_time(1.5, 0) == pytest.approx(1.540)


def test_bandwidth_serialises_chunks() -> None:
    link = LinkSchedule(delay_s=0.010, bandwidth_bps=100e6)
    chunk = 64 * 1024
    n_chunks = 10_000_000 // chunk + 1
    releases = [link.release_time(0.0, chunk) for _ in range(n_chunks)]
    per_chunk = chunk * 8 / 100e6
    assert releases[0] == pytest.approx(per_chunk + 0.010)
    assert releases[1] - releases[0] == pytest.approx(per_chunk)
    # ~10 MB at 100 Mbit/s occupies the link for ~0.8 s.
    assert releases[-1] == pytest.approx(n_chunks * per_chunk + 0.010)
    assert 0.80 <= releases[-1] - 0.010 <= 0.81
    # An idle link starts transmitting immediately: no credit, no backlog.
    later = link.release_time(100.0, 1250)  # 10 kbit
    assert later == pytest.approx(100.0 + 1e-4 + 0.010)


def test_unlimited_bandwidth_costs_nothing() -> None:
    link = LinkSchedule(delay_s=0.0)
    assert link.transmission_time(10**9) == 0.0
    assert link.release_time(3.0, 10**9) == 3.0


@pytest.mark.parametrize("distribution", ["uniform", "normal"])
def test_jitter_never_reorders_and_varies(distribution: JitterDistribution) -> None:
    link = LinkSchedule(delay_s=0.005, jitter_s=0.020, distribution=distribution, rng=random.Random(1))
    reads = [i * 0.001 for i in range(2000)]
    releases = [link.release_time(t, 100) for t in reads]
    assert all(b >= a for a, b in itertools.pairwise(releases))
    assert all(rel >= t for t, rel in zip(reads, releases, strict=True))  # delay clipped at 0
    added = [rel - t for t, rel in zip(reads, releases, strict=True)]
    assert max(added) - min(added) > 0.020  # jitter really is applied
    bound = 0.005 + (0.020 if distribution == "uniform" else 0.060)
    assert max(added) <= bound + 1e-12


def test_jitter_is_seeded() -> None:
    def run(seed: int) -> list[float]:
        link = LinkSchedule(delay_s=0.01, jitter_s=0.01, rng=random.Random(seed))
        return [link.release_time(i * 0.05, 10) for i in range(50)]

    assert run(3) == run(3)
    assert run(3) != run(4)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"upstream_port": 0},
        {"upstream_port": 70000},
        {"listen_port": -1},
        {"rtt_ms": -1.0},
        {"rtt_ms": float("nan")},
        {"jitter_ms": -0.1},
        {"jitter_distribution": "pareto"},
        {"bandwidth_bps": 0.0},
        {"chunk_bytes": 0},
        {"chunk_bytes": 1024, "max_queue_bytes": 512},
        {"connect_timeout_s": 0.0},
    ],
)
def test_config_validation(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        NetemConfig(**kwargs)  # type: ignore[arg-type]


def test_config_defaults() -> None:
    cfg = NetemConfig(upstream_port=8765, rtt_ms=80.0)
    assert cfg.one_way_delay_s == pytest.approx(0.040)
    assert cfg.listen_port == 0
    assert cfg.bandwidth_bps is None
