"""The WAN link model, pure: the emulator's configuration and the release time of every chunk.

:class:`NetemConfig` says what link to emulate; :class:`LinkSchedule` turns the arrival of each
chunk of bytes into the time it may leave (rate, delay, jitter, no reordering; the model is
described in :mod:`splitspec.netem.emulator`, the asyncio proxy that applies it). No I/O here.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Literal

from splitspec.exceptions import ConfigError

__all__ = ["BURST_GAP_S", "JitterDistribution", "LinkSchedule", "NetemConfig"]

JitterDistribution = Literal["uniform", "normal"]

# a chunk read less than this after the previous chunk finished transmitting continues its burst (the rest of
# one message, or a message sent back to back with it) and shares its jitter draw, seconds
BURST_GAP_S = 0.001


@dataclass(frozen=True)
class NetemConfig:
    """Settings of one emulated WAN link (both directions share them)."""

    upstream_host: str = "127.0.0.1"  # host the proxy forwards to (hostname or IP literal)
    upstream_port: int = 8765  # TCP port the proxy forwards to, 1..65535
    listen_host: str = "127.0.0.1"  # address the proxy listens on
    listen_port: int = 0  # TCP port the proxy listens on; 0 = let the OS pick a free port
    rtt_ms: float = 0.0  # added round-trip time, milliseconds; each direction adds rtt_ms / 2
    jitter_ms: float = 0.0  # jitter scale per burst (message) and direction, milliseconds (0 = none)
    # "uniform": one-way jitter ~ U(-jitter_ms, +jitter_ms);
    # "normal": ~ N(0, jitter_ms²) clipped to ±3·jitter_ms. One-way delay is clipped at 0.
    jitter_distribution: JitterDistribution = "uniform"
    bandwidth_bps: float | None = None  # link rate per direction, bits per second; None = unlimited
    seed: int = 0  # seed of the jitter generators (per connection and direction), integer
    chunk_bytes: int = 64 * 1024  # largest chunk read from a socket at once, bytes
    max_queue_bytes: int = 16 * 1024 * 1024  # per-direction buffer before reading pauses, bytes
    connect_timeout_s: float = 10.0  # timeout for connecting to the upstream, seconds

    def __post_init__(self) -> None:
        if not 1 <= self.upstream_port <= 65535:
            raise ConfigError(f"upstream_port must be in 1..65535, got {self.upstream_port}")
        if not 0 <= self.listen_port <= 65535:
            raise ConfigError(f"listen_port must be in 0..65535, got {self.listen_port}")
        if not math.isfinite(self.rtt_ms) or self.rtt_ms < 0:
            raise ConfigError(f"rtt_ms must be a finite number >= 0, got {self.rtt_ms}")
        if not math.isfinite(self.jitter_ms) or self.jitter_ms < 0:
            raise ConfigError(f"jitter_ms must be a finite number >= 0, got {self.jitter_ms}")
        if self.jitter_distribution not in ("uniform", "normal"):
            raise ConfigError(f"jitter_distribution must be 'uniform' or 'normal', got {self.jitter_distribution!r}")
        if self.bandwidth_bps is not None and (not math.isfinite(self.bandwidth_bps) or self.bandwidth_bps <= 0):
            raise ConfigError(f"bandwidth_bps must be > 0 or None, got {self.bandwidth_bps}")
        if self.chunk_bytes < 1:
            raise ConfigError(f"chunk_bytes must be >= 1, got {self.chunk_bytes}")
        if self.max_queue_bytes < self.chunk_bytes:
            raise ConfigError(f"max_queue_bytes ({self.max_queue_bytes}) must be >= chunk_bytes ({self.chunk_bytes})")
        if not self.connect_timeout_s > 0:
            raise ConfigError(f"connect_timeout_s must be > 0, got {self.connect_timeout_s}")

    @property
    def one_way_delay_s(self) -> float:
        """Mean added one-way propagation delay, seconds."""
        return self.rtt_ms / 2000.0


class LinkSchedule:
    """Pure timing model of one direction of an emulated link (sans-I/O).

    Feed it the time a chunk was read and its size; it returns the time the chunk must be
    written on the other side. Times are in seconds on any monotonic clock.

    Jitter is drawn once per burst, not per chunk: a chunk read less than ``burst_gap_s`` after the
    previous one finished transmitting (the next 64 KiB of one message, or a message sent back to
    back) keeps the burst's draw. A message read in many chunks then lands ``delay + one draw`` late,
    zero-mean jitter whatever its size; a draw per chunk, with releases kept in order, would land it
    at the latest of its chunks' draws (with 16 chunks, ``delay + 0.88 * jitter`` on average).
    """

    def __init__(
        self,
        *,
        delay_s: float,
        jitter_s: float = 0.0,
        distribution: JitterDistribution = "uniform",
        bandwidth_bps: float | None = None,
        rng: random.Random | None = None,
        burst_gap_s: float = BURST_GAP_S,
    ) -> None:
        if delay_s < 0 or jitter_s < 0 or burst_gap_s < 0:
            raise ConfigError("delay_s, jitter_s and burst_gap_s must be >= 0")
        if bandwidth_bps is not None and bandwidth_bps <= 0:
            raise ConfigError("bandwidth_bps must be > 0 or None")
        self.delay_s = delay_s  # mean one-way propagation delay, seconds
        self.jitter_s = jitter_s  # jitter scale, seconds
        self.distribution: JitterDistribution = distribution
        self.bandwidth_bps = bandwidth_bps  # bits per second, None = unlimited
        self._rng = rng if rng is not None else random.Random(0)
        self.burst_gap_s = burst_gap_s  # a longer pause between chunks starts a new burst (a new draw), seconds
        self._link_free_at = -math.inf  # when the transmitter finishes its current chunk, s
        self._last_release = -math.inf  # release time of the previous chunk, s
        self._burst_jitter = 0.0  # the current burst's jitter draw, s

    @classmethod
    def from_config(cls, config: NetemConfig, rng: random.Random) -> LinkSchedule:
        """Build the schedule of one direction from a :class:`NetemConfig`."""
        return cls(
            delay_s=config.one_way_delay_s,
            jitter_s=config.jitter_ms / 1000.0,
            distribution=config.jitter_distribution,
            bandwidth_bps=config.bandwidth_bps,
            rng=rng,
        )

    def transmission_time(self, nbytes: int) -> float:
        """Seconds that ``nbytes`` occupy the link (0 without a rate limit)."""
        if self.bandwidth_bps is None:
            return 0.0
        return nbytes * 8.0 / self.bandwidth_bps

    def sample_jitter(self) -> float:
        """One jitter draw, seconds (may be negative)."""
        if self.jitter_s == 0.0:
            return 0.0
        if self.distribution == "uniform":
            return self._rng.uniform(-self.jitter_s, self.jitter_s)
        draw = self._rng.gauss(0.0, self.jitter_s)
        return min(max(draw, -3.0 * self.jitter_s), 3.0 * self.jitter_s)

    def release_time(self, read_at: float, nbytes: int) -> float:
        """When a chunk of ``nbytes`` read at ``read_at`` is to be written out.

        Never earlier than the previous chunk's release time, so bytes are never reordered. A chunk
        read within ``burst_gap_s`` of the previous one's end of transmission (or while the link still
        sends it) shares that chunk's jitter; any other draws anew.
        """
        if nbytes < 0:
            raise ValueError("nbytes must be >= 0")
        if not read_at - self._link_free_at < self.burst_gap_s:  # a new burst (the first chunk: -inf before it)
            self._burst_jitter = self.sample_jitter()
        start = max(read_at, self._link_free_at)
        sent_at = start + self.transmission_time(nbytes)
        self._link_free_at = sent_at
        arrival = sent_at + max(0.0, self.delay_s + self._burst_jitter)
        release = max(arrival, self._last_release)
        self._last_release = release
        return release
