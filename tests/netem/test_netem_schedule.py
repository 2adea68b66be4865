"""The pure timing model of one emulated link direction, and config validation."""

from __future__ import annotations

import itertools
import random
import statistics

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
    reads = [i * 0.002 for i in range(2000)]  # 2 ms apart: each read its own burst, its own draw
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


@pytest.mark.parametrize("distribution", ["uniform", "normal"])
def test_a_many_chunk_message_gets_one_zero_mean_jitter(distribution: JitterDistribution) -> None:
    """A message read in 16 back-to-back chunks lands ``delay`` late on average, as a one-chunk one does.

    With a draw per chunk (and releases kept in order) it landed at the latest of 16 draws: with uniform
    jitter J, ``delay + 0.88 J`` on average (+9.6 ms for 256 KB at J = 10 ms, +3.0 ms for 100 B)."""

    def lateness(seed: int, chunks: int) -> list[float]:
        link = LinkSchedule(delay_s=0.040, jitter_s=0.010, distribution=distribution, rng=random.Random(seed))
        out = []
        for message in range(2000):
            read_at = message * 1.0  # messages a second apart; the chunks of one 50 us apart
            releases = [link.release_time(read_at + i * 50e-6, 64 * 1024) for i in range(chunks)]
            assert all(b >= a for a, b in itertools.pairwise(releases))
            out.append(releases[-1] - read_at)
        return out

    for chunks in (1, 16):
        late = lateness(7, chunks)
        spread = statistics.pstdev(late)
        assert spread > 0.004  # jitter is applied
        # the standard error of the mean over 2000 messages is about 0.13 ms
        assert statistics.fmean(late) == pytest.approx(0.040 + (chunks - 1) * 50e-6, abs=0.0006), chunks
    assert lateness(7, 16) == lateness(7, 16)  # seeded: the same run again
    assert lateness(7, 16) != lateness(8, 16)


def test_a_pause_starts_a_new_burst_and_a_rate_limited_backlog_does_not() -> None:
    link = LinkSchedule(delay_s=0.010, jitter_s=0.005, rng=random.Random(2), burst_gap_s=0.001)
    first = [link.release_time(0.0, 10) - 0.0 for _ in range(3)]
    assert first[0] == first[1] == first[2]  # one draw for the burst
    added = [link.release_time(t, 10) - t for t in (0.5, 1.0, 1.5, 2.0)]  # each after a pause: a draw each
    assert len(set(added)) == 4
    # behind a 1 Mbit/s transmitter the chunks wait for the link: they stay one burst however long it takes
    slow = LinkSchedule(delay_s=0.010, jitter_s=0.005, rng=random.Random(2), bandwidth_bps=1e6)
    releases = [slow.release_time(i * 0.002, 1250) for i in range(10)]  # 10 ms of transmission each
    steps = [b - a for a, b in itertools.pairwise(releases)]
    assert steps == pytest.approx([0.010] * 9)  # the same jitter throughout: spaced by the rate alone


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
