"""One stalled step or proposal does not price drafting out: what is measured once is measured again, and the lower
of two is believed (``estimates.Seconds``, ``StepTimes.measured_once``, the controller's confirming probe)."""

from __future__ import annotations

import math

import pytest

from splitspec.decoding.controller import CONFIRM_AFTER, SpeculationController
from splitspec.decoding.estimates import Seconds, StepTimes
from tests.decoding.step_times import measured_step_times

DECAY = 0.97


def test_seconds_ignores_one_stall_among_three_and_follows_a_fall_after_two() -> None:
    s = Seconds()
    assert math.isnan(s.value)  # before any observation
    s.update(0.010, DECAY)
    assert s.value == 0.010
    assert s.measured_once
    for _ in range(4):
        s.update(0.010, DECAY)
    s.update(0.200, DECAY)  # a stall
    assert s.mean.value > 0.04  # the mean alone would hold it for dozens of observations
    assert s.value == pytest.approx(0.010)
    s.update(0.005, DECAY)
    assert s.value == pytest.approx(0.010)  # one lower observation: not yet a fall
    s.update(0.005, DECAY)
    assert s.value == pytest.approx(0.005)  # two: followed
    assert not s.measured_once


def test_a_lasting_rise_moves_seconds_as_the_mean_does() -> None:
    s = Seconds()
    for _ in range(10):
        s.update(0.010, DECAY)
    for _ in range(3):
        s.update(0.030, DECAY)
    assert s.value == s.mean.value  # the recent median (30 ms) is above the mean: the mean is the estimate
    for _ in range(200):
        s.update(0.030, DECAY)
    assert s.value == pytest.approx(0.030, rel=1e-3)


def test_a_scaled_copy_keeps_the_value_and_caps_the_weight() -> None:
    s = Seconds()
    for x in (0.010, 0.010, 0.010, 0.300):
        s.update(x, DECAY)
    copy = s.scaled_copy(1.0)
    assert copy.value == s.value
    assert copy.weight == 1.0
    assert s.weight > 3.5  # the original keeps its own


def test_a_stalled_first_wide_step_is_believed_only_until_measured_again() -> None:
    times = StepTimes()
    for _ in range(3):
        times.observe(1, 0.040)
    times.observe(3, 0.150)  # the first 3-token step stalled
    assert times.predict(3) == pytest.approx(0.150)  # nothing else to judge it by
    assert times.measured_once(3)
    assert not times.measured_once(2)
    times.observe(3, 0.044)
    assert times.predict(3) == pytest.approx(0.044)  # the lower of the two
    assert not times.measured_once(3)


def test_a_width_measured_once_is_no_dearer_than_the_confirmed_widths_predict() -> None:
    times = StepTimes()
    for _ in range(3):
        times.observe(1, 0.040)
    for _ in range(2):
        times.observe(2, 0.041)
        times.observe(5, 0.044)
    times.observe(3, 0.150)  # stalled, beside two widths measured twice
    assert times.predict(3) == pytest.approx(0.042, abs=1e-4)
    assert times.predict(9) < 0.06  # nor does it steepen the extrapolation past it
    times.observe(3, 0.150)  # measured again as dear: believed
    assert times.predict(3) > 0.14


def test_extrapolation_continues_from_the_widest_step_measured() -> None:
    """A cold start made the one-token steps slower than a later 3-token one (as on an H200: T(1) 549 ms, T(3) 164
    ms); a 9-token step was then predicted at T(1) again, dearer than the widest step measured."""
    times = StepTimes()
    times.observe(1, 0.500)
    times.observe(3, 0.160)
    assert times.predict(9) == pytest.approx(times.predict(3))
    assert times.predict(4) <= times.predict(9) + 1e-12


def sequential_until_probed(ctl: SpeculationController, one_s: float, limit: int = 30) -> int:
    """One-token steps taken before the controller asks a drafter again."""
    for steps in range(limit):
        if ctl.ranked()[0].drafter is not None:
            return steps
        ctl.observe_step(1, one_s)
    return limit


def test_a_stalled_first_proposal_is_measured_again_and_drafting_resumes() -> None:
    ctl = SpeculationController(["draft"], step_times=measured_step_times(0.040, 0.001))
    ctl.observe_draft("draft", 2, 2, 2, 0.170)  # both tokens accepted, but the proposal stalled: 85 ms a token
    assert ctl.ranked()[0].drafter is None  # priced out by the stall
    assert sequential_until_probed(ctl, 0.040) == CONFIRM_AFTER  # not probe_every (24): a short answer's length
    probe = ctl.ranked()[0]
    assert probe.drafter == "draft"
    assert probe.budget == 1
    ctl.observe_draft("draft", 1, 1, 1, 0.003)
    ctl.observe_step(2, 0.041)
    best = ctl.ranked()[0]
    assert best.drafter == "draft"
    assert best.budget >= 2


def test_a_stalled_first_wide_step_is_measured_again_at_its_width() -> None:
    ctl = SpeculationController(["draft"])
    for _ in range(3):
        ctl.observe_step(1, 0.040)
    for _ in range(2):
        ctl.observe_draft("draft", 2, 2, 2, 0.006)
    ctl.observe_step(3, 0.150)  # the first wide step stalled
    assert ctl.ranked()[0].drafter is None
    assert sequential_until_probed(ctl, 0.040) == CONFIRM_AFTER
    probe = ctl.ranked()[0]
    assert probe.drafter == "draft"
    assert probe.budget == 2
    ctl.observe_step(3, 0.042)
    assert ctl.ranked()[0].drafter == "draft"


def test_nothing_measured_once_is_probed_again_when_drafting_would_not_pay_without_it() -> None:
    """A drafter whose cost was measured once, on a link where even a free draft loses (a 50 ms extra token),
    waits for the usual probe: a confirmation would only cost a step."""
    ctl = SpeculationController(["draft"], step_times=measured_step_times(0.040, 0.050))
    ctl.observe_draft("draft", 2, 1, 2, 0.170)
    assert sequential_until_probed(ctl, 0.040) == ctl.probe_every


def test_a_dear_drafter_measured_often_waits_for_the_usual_probe() -> None:
    ctl = SpeculationController(["draft"], step_times=measured_step_times(0.040, 0.001))
    for _ in range(3):
        ctl.observe_draft("draft", 2, 2, 2, 0.200)  # 100 ms a token, every time: its cost
    assert sequential_until_probed(ctl, 0.040) == ctl.probe_every
