"""Whether dear drafters pay under load: the engine's delivered tokens per second, measured with and without them.

A draft model's proposal costs the edge several forwards. Alone, a sequence spends that time while its
round trip would otherwise leave the edge idle, and each sequence's controller weighs it against the
tokens it saves (decoding/controller.py). Under load the sequences share the engine's one interpreter
and, on a small machine, its cores: a second of drafting is then also a second the other sequences'
head, tail and I/O wait, which no sequence's own estimates see (its measured step times T(q) rise for
every choice alike). Whether drafting still pays then depends on the machine: on one 2-core machine
the gateway delivered 1.14x the tokens at 16 streams with the draft model; on another, 0.92x, and
0.81x at 32 (benchmarks/results/draft_under_load/).

So the engine measures it. While two or more sequences decode, :class:`DearGate` runs in epochs of
``epoch_s`` seconds, each with dear drafters allowed or not (an *arm*), and keeps, per load band (the
number of sequences decoding, in powers of two), a decayed mean of the tokens the engine delivered per
second under each arm. An epoch's band is the one it starts in, which chooses its arm: it tries an arm
not yet measured in that band first; after that it takes the better arm, except that every
``explore_every``-th epoch of a band takes the other one, so that a change of text or load can turn the
choice back. What the epoch delivered is that band's measurement of that arm, whatever the load does
meanwhile (recorded under a band the load reached instead, a load that crossed a band's edge within each
epoch left the band it started in unmeasured: its first arm was chosen again and again, the other never
tried). A lone sequence is not gated: its controller's own estimates are right for it (and a dear drafter
alone is judged aside, decoding/aside.py).

Sans-I/O: the caller passes the clock's readings, so the tests drive it with literal times.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

ARMS = (True, False)  # dear drafters allowed, not allowed

log = logging.getLogger(__name__)


def load_band(decoding: int) -> int:
    """The band of ``decoding`` sequences (>= 2): 2-3 -> 1, 4-7 -> 2, 8-15 -> 3, 16-31 -> 4, ..."""
    return max(1, decoding.bit_length() - 1)


@dataclass
class _Band:
    rate: dict[bool, float] = field(default_factory=dict)  # arm -> decayed mean tokens per second
    epochs: int = 0  # epochs measured in this band


class DearGate:
    """Dear drafters allowed or not, by measured engine throughput under load (see the module's docstring)."""

    def __init__(self, epoch_s: float = 2.0, explore_every: int = 5, decay: float = 0.5) -> None:
        if epoch_s <= 0 or explore_every < 2 or not 0.0 <= decay < 1.0:
            raise ValueError("epoch_s > 0, explore_every >= 2 and 0 <= decay < 1 are required")
        self.epoch_s = epoch_s  # seconds an arm runs before it is measured
        self.explore_every = explore_every  # every n-th epoch of a band runs the arm that measured worse
        self.decay = decay  # weight of a band's earlier epochs in its rate per arm
        self._bands: dict[int, _Band] = {}
        self._arm = True  # the arm of the epoch in progress
        self._running = False  # an epoch is in progress (False while fewer than two sequences decode)
        self._start = math.nan  # when it started, seconds
        self._tokens = 0  # tokens delivered in it
        self._band = 0  # its load band (:func:`load_band`), the one it started in: its arm was chosen for it

    def allows(self, decoding: int, now: float) -> bool:
        """Whether a step starting at ``now`` seconds, with ``decoding`` sequences decoding, may ask a dear
        drafter. Ends the epoch in progress once it has run ``epoch_s`` and starts the next one."""
        if decoding < 2:
            self._running = False  # alone: not gated, and nothing of this moment is measured
            return True
        if not self._running:
            self._begin(load_band(decoding), now)
        elif now - self._start >= self.epoch_s:
            self._finish(now)
            self._begin(load_band(decoding), now)
        return self._arm

    def delivered(self, tokens: int) -> None:
        """A step emitted ``tokens`` tokens (counted into the epoch in progress, if any)."""
        if self._running:
            self._tokens += tokens

    @property
    def holding_back(self) -> bool:
        """Whether the epoch in progress holds dear drafters back (False alone, or with no epoch running)."""
        return self._running and not self._arm

    def rates(self) -> dict[int, dict[bool, float]]:
        """The measured tokens per second by load band (see :func:`load_band`) and arm."""
        return {index: dict(band.rate) for index, band in self._bands.items()}

    def rate(self, decoding: int, allowed: bool) -> float | None:
        """The measured tokens per second with ``decoding`` sequences under an arm (None: not measured)."""
        band = self._bands.get(load_band(decoding))
        return None if band is None else band.rate.get(allowed)

    def _finish(self, now: float) -> None:
        band = self._bands.setdefault(self._band, _Band())  # the band its arm was chosen for
        rate = self._tokens / (now - self._start)
        before = band.rate.get(self._arm)
        band.rate[self._arm] = rate if before is None else self.decay * before + (1.0 - self.decay) * rate
        band.epochs += 1

    def _begin(self, band_index: int, now: float) -> None:
        band = self._bands.setdefault(band_index, _Band())
        untried = [arm for arm in ARMS if arm not in band.rate]
        if untried:
            self._arm = untried[0]
        else:
            best = band.rate[True] >= band.rate[False]  # ties keep the drafters: the controller asked for them
            explore = (band.epochs + 1) % self.explore_every == 0
            arm = (not best) if explore else best
            if arm != self._arm:
                log.debug(
                    "dear drafters %s (load band %d; tok/s with them %.1f, without %.1f%s)",
                    "allowed" if arm else "held back", band_index, band.rate[True], band.rate[False],
                    ", exploring" if explore else "",
                )  # fmt: skip
            self._arm = arm
        self._running, self._start, self._tokens, self._band = True, now, 0, band_index
