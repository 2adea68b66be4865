"""A wide step far faster than predicted moves T(1) down to half of itself at most: the rest of the surprise is
the wide step's extra cost. The level once went negative, T(1) read 1 us, and every drafter lost to it."""

from __future__ import annotations

from splitspec.decoding.controller import SpeculationController
from splitspec.decoding.estimates import StepTimes, _WidthTimes

# the reviewer's sequence: slow steps (load), then fast one-token steps, then two fast 17-token steps
SEQUENCE = [(1, 0.04)] * 3 + [(17, 0.09)] * 2 + [(1, 0.01)] * 6 + [(17, 0.012)] * 2


def test_a_fast_wide_step_leaves_t1_positive() -> None:
    times = _WidthTimes()
    for q, seconds in SEQUENCE:
        times.observe(q, seconds)
    assert times.level > 0
    assert times.predict(1) >= 0.005
    assert abs(times.predict(17) - 0.012) < 1e-9  # the surprise the level did not take went to the extra cost


def test_a_perfectly_accepted_drafter_still_drafts_after_a_fast_wide_step() -> None:
    times = StepTimes()
    for q, seconds in SEQUENCE:
        times.observe(q, seconds)
    ctl = SpeculationController(["ngram"], budgets=(1, 2, 4, 8), step_times=times)
    for _ in range(50):
        ctl.observe_draft("ngram", 8, 8, 8, 1e-5)
    assert times.predict(1) >= 0.005
    assert ctl.ranked()[0].drafter == "ngram"
