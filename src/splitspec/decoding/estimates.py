"""The decayed estimates the speculation controller keeps: a running mean, and the step times of the link.

:class:`Ema` is a decayed running mean; :class:`Seconds` is one for durations that a single stall cannot hold
up (drafting costs and step times use it).
:class:`StepTimes` predicts T(q), the seconds of a step of q query tokens at a context length, from
the steps measured (per context band, each band as T(1) plus an extra cost per width).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

CONTEXT_BAND_TOKENS = 256  # step times are kept per context band: [0, 256), [256, 512), [512, 1024), ...
MEMO_ENTRIES = 1024  # step-time predictions kept between two observations, at most
RECENT = 3  # latest observations whose lower median bounds a Seconds estimate
CONFIRMED_WEIGHT = 1.5  # decayed count of observations from which an estimate counts as measured more than once
LEVEL_FLOOR = 0.5  # a wide step moves T(1) down to this fraction of its estimate at most


@dataclass
class Ema:
    """A decayed running mean: each update weighs ``decay`` times the weight of everything before it."""

    value: float = math.nan
    weight: float = 0.0

    def update(self, x: float, decay: float) -> None:
        self.weight = decay * self.weight + 1.0
        self.value = x if math.isnan(self.value) else self.value + (x - self.value) / self.weight


@dataclass
class Seconds:
    """A decayed mean of a duration, bounded by the lower median of the latest :data:`RECENT` observations.

    Durations here stall now and then (a garbage collection, a noisy neighbour, a GPU building a kernel plan
    or raising its clocks): one slow observation among a few would otherwise hold a mean up for dozens of
    observations, and the controller judge on it. On an H200 the draft model's first proposals took 139 ms for 2
    tokens and the next 7 ms; the mean cost per token read 67, 37, 22, 16 and 12 ms over the next 5 answers while
    every proposal took 3.5 ms a token (``benchmarks/results/gpu/h200-2026-12-04b/``). The bound follows a
    fall after two observations and ignores one stall among three; a lasting rise moves the mean as before.
    """

    mean: Ema = field(default_factory=Ema)  # the decayed mean of every observation, seconds
    recent: tuple[float, ...] = ()  # the latest observations, oldest first, seconds (at most RECENT)
    value: float = field(init=False)  # the estimate, seconds (nan before any observation): set by each update

    def __post_init__(self) -> None:
        self._estimate()

    def _estimate(self) -> None:
        """Kept as an attribute: a ranking reads the estimates about a hundred times between two updates."""
        if self.recent:
            self.value = min(self.mean.value, sorted(self.recent)[(len(self.recent) - 1) // 2])
        else:
            self.value = self.mean.value

    @property
    def weight(self) -> float:
        """The decayed count of observations behind the mean."""
        return self.mean.weight

    @property
    def measured_once(self) -> bool:
        """Whether one observation is all there is (decayed: below :data:`CONFIRMED_WEIGHT`)."""
        return 0.0 < self.mean.weight < CONFIRMED_WEIGHT

    def update(self, x: float, decay: float) -> None:
        self.mean.update(x, decay)
        self.recent = (*self.recent, x)[-RECENT:]
        self._estimate()

    def scaled_copy(self, weight: float) -> Seconds:
        """This estimate worth at most ``weight`` observations (the same value and latest observations)."""
        return Seconds(Ema(self.mean.value, min(self.mean.weight, weight)), self.recent)


class _WidthTimes:
    """Measured seconds of a step of q query tokens at one context band.

    A step of q tokens is modelled as T(1) + extra(q). Load (other sequences queueing at the trunk
    and at the edge's workers) moves every T(q) together, and a big step measured under load and
    not tried since would otherwise keep a lone sequence from drafting long after the load has
    gone. So each step, whatever its size, moves the level T(1): a one-token step directly, a
    bigger one by half of its surprise (the other half goes to its extra cost), but down to
    :data:`LEVEL_FLOOR` of the level at most (the surprise the level cannot take goes to the extra
    cost, kept so that the step costs at least nothing). Until a one-token step is measured, the
    measured T(q) are interpolated as they are.

    A width's first two steps measure its extra cost alone, and the lower of the two is believed
    (:class:`Seconds`): a stall on a width's first step is the width's until it is measured again,
    and the controller measures it again soon (:meth:`measured_once`).
    """

    def __init__(self, decay: float = 0.97) -> None:
        self.decay = decay  # per-observation decay of every estimate
        self._times: dict[int, Seconds] = {}  # query tokens -> seconds, as measured
        self._one = Seconds()  # T(1), seconds
        self._extra: dict[int, Seconds] = {}  # query tokens > 1 -> seconds over T(1)
        self._extra_sorted: list[tuple[int, float]] | None = None  # _extra as sorted points, until it changes

    def observe(self, query_tokens: int, seconds: float) -> None:
        self._extra_sorted = None
        self._times.setdefault(query_tokens, Seconds()).update(seconds, self.decay)
        one = self._one.value
        if query_tokens == 1:
            self._one.update(seconds, self.decay)
        elif not math.isnan(one):
            extra = self._extra.setdefault(query_tokens, Seconds())
            if extra.weight < CONFIRMED_WEIGHT:  # its first two steps: the lower is believed
                extra.update(seconds - one, self.decay)
                return
            surprise = seconds - (one + extra.value)
            # the level takes half the surprise, but never falls below half of itself: a wide step far faster
            # than predicted says its extra cost was overrated, not that T(1) is gone (it drove T(1) negative,
            # and every drafter then lost to a 1 us one-token step)
            level = max(one + surprise / 2, one * LEVEL_FLOOR)
            self._one.update(level, self.decay)
            # the rest of the surprise is the extra cost's, which never makes the step cost less than nothing
            extra.update(max(extra.value + surprise - (level - one), -self._one.value), self.decay)

    @property
    def level(self) -> float:
        """T(1), seconds (nan until a one-token step is measured)."""
        return self._one.value

    def measured_once(self, q: int) -> bool:
        """Whether the extra cost of a step of q tokens rests on one step (a width measured once)."""
        extra = self._extra.get(q)
        return extra is not None and extra.measured_once

    @property
    def has_extra(self) -> bool:
        """Whether a step wider than one token has been measured (so :meth:`extra` answers)."""
        return bool(self._extra)

    def _extra_points(self) -> list[tuple[int, float]]:
        """(q, seconds over T(1)) of every measured width, with (1, 0), sorted: kept until the next observation.

        A width measured once is put no dearer than the widths measured more often predict it (when there are
        any): its one step may have stalled, and a width read too dear is not stepped again to find out (a
        neighbouring width is drafted instead)."""
        if self._extra_sorted is None:
            points = sorted((k, e.value) for k, e in self._extra.items())
            once = {k for k, e in self._extra.items() if e.measured_once}
            confirmed = [(1, 0.0), *((k, t) for k, t in points if k not in once)]
            if once and len(confirmed) > 1:
                points = [(k, min(t, _interpolate(confirmed, k)) if k in once else t) for k, t in points]
            self._extra_sorted = [(1, 0.0), *points]
        return self._extra_sorted

    def extra(self, q: int) -> float | None:
        """Seconds a step of q tokens costs over T(1), interpolated; None until a wider step is measured."""
        if not self._extra:
            return None
        return _interpolate(self._extra_points(), q)

    def predict(self, q: int) -> float:
        """Predicted seconds for a step of q query tokens."""
        one = self._one.value
        if not math.isnan(one) and self._extra:
            return max(1e-6, one + _interpolate(self._extra_points(), q))
        known = sorted((k, e.value) for k, e in self._times.items() if not math.isnan(e.value))
        if not known:
            return 1.0
        if len(known) == 1:
            k0, t0 = known[0]
            return t0 * (1 + 0.02 * (q - k0))  # before any slope is measured: +2% per extra token
        return max(1e-6, _interpolate(known, q))


class StepTimes:
    """Measured seconds of a step of q query tokens at a context length: what the link and the trunk cost.

    Every sequence on one link shares them (a sequence's own acceptance estimates are its own).
    Attention over a long context makes each extra query token cost more (measured on the demo
    split at 20 ms: a 17-token step cost 12 ms over a one-token one after 2,000 tokens, 6.5 ms after
    100), so estimates are kept per context band (:func:`context_band`: below 256 tokens, then one
    band per doubling). A band with no wide step measured yet borrows the extra cost of the nearest
    band that has one, over its own T(1); a band with no T(1) yet reads the nearest band that has one.
    """

    def __init__(self, decay: float = 0.97) -> None:
        self.decay = decay  # per-observation decay of every estimate
        self._bands: dict[int, _WidthTimes] = {}  # context band -> its estimates
        # (q, band) -> what predict answers until the next observation: a controller's ranking asks for the same
        # few widths once per drafter and budget (about 80 predictions a step, 9 distinct), and each prediction
        # walks every band's sorted estimates in Python (under load, 10 % of the edge server's interpreter time)
        self._memo: dict[tuple[int, int], float] = {}

    @property
    def measured(self) -> bool:
        """Whether any step was measured yet (at any context length)."""
        return bool(self._bands)

    def observe(self, query_tokens: int, seconds: float, context_tokens: int = 0) -> None:
        band = context_band(context_tokens)
        self._bands.setdefault(band, _WidthTimes(self.decay)).observe(query_tokens, seconds)
        self._memo.clear()  # any prediction may have moved

    def predict(self, q: int, context_tokens: int = 0) -> float:
        """Predicted seconds for a step of q query tokens after ``context_tokens`` tokens."""
        key = (q, context_band(context_tokens))
        seconds = self._memo.get(key)
        if seconds is None:
            if len(self._memo) >= MEMO_ENTRIES:  # odd widths asked between two observations: stay bounded
                self._memo.clear()
            seconds = self._memo[key] = self._predict(q, key[1])
        return seconds

    def _predict(self, q: int, band: int) -> float:
        if not self._bands:
            return 1.0
        own = self._level_for(band)
        if math.isnan(own.level):  # no T(1) measured anywhere: the steps measured, as they are
            return own.predict(q)
        extras = self._extras_for(band, own)
        if q == 1 or extras is own:
            return own.predict(q)
        extra = extras.extra(q)
        return own.predict(q) if extra is None else max(1e-6, own.level + extra)

    def _level_for(self, band: int) -> _WidthTimes:
        """The estimates whose T(1) predicts ``band``: its own, or (no T(1) here yet) the nearest band's that has
        one, or with none anywhere the nearest band's (there is at least one)."""
        own = self._bands.get(band)
        if own is not None and not math.isnan(own.level):
            return own
        levelled = [b for b, times in self._bands.items() if not math.isnan(times.level)]
        return self._nearest(band, levelled or list(self._bands))

    def _extras_for(self, band: int, own: _WidthTimes) -> _WidthTimes:
        """The estimates whose extra costs predict ``band``'s wide steps: its own, or the nearest band's that has
        some (``own`` when none has)."""
        if own.has_extra:
            return own
        donors = [b for b, times in self._bands.items() if times.has_extra]
        return self._nearest(band, donors) if donors else own

    def measured_once(self, q: int, context_tokens: int = 0) -> bool:
        """Whether the prediction of a q-token step after ``context_tokens`` tokens rests on one step of q tokens
        (measured again, the lower of the two is believed: the first may have stalled)."""
        if not self._bands:
            return False
        band = context_band(context_tokens)
        return self._extras_for(band, self._level_for(band)).measured_once(q)

    def _nearest(self, band: int, candidates: list[int]) -> _WidthTimes:
        """The estimates of the candidate band nearest ``band`` (the longer context on a tie: the dearer)."""
        return self._bands[min(candidates, key=lambda b: (abs(b - band), -b))]


def context_band(context_tokens: int) -> int:
    """Band of a context length for step times: 0 below CONTEXT_BAND_TOKENS, then one per doubling."""
    return (max(0, context_tokens) // CONTEXT_BAND_TOKENS).bit_length()


def _interpolate(known: list[tuple[int, float]], q: int) -> float:
    """Linear interpolation between the (q, value) points, sorted by q; beyond them, the nearest two's
    slope (never decreasing)."""
    below = [(k, t) for k, t in known if k <= q]
    above = [(k, t) for k, t in known if k >= q]
    if below and above:
        (k0, t0), (k1, t1) = below[-1], above[0]
        return t0 if k1 == k0 else t0 + (t1 - t0) * (q - k0) / (k1 - k0)
    if not above:  # past the last point: from it, on the last two points' slope
        (k0, t0), (k1, t1) = known[-2], known[-1]
        return t1 + max(0.0, (t1 - t0) / (k1 - k0)) * (q - k1)
    (k0, t0), (k1, t1) = known[0], known[1]  # before the first point: from it, on the first two's slope
    return t0 + max(0.0, (t1 - t0) / (k1 - k0)) * (q - k0)
