"""Step times as a link measured them, for the controller's tests."""

from __future__ import annotations

from splitspec.decoding.estimates import StepTimes


def measured_step_times(one_s: float, per_token_s: float) -> StepTimes:
    """Step times as a link measured them: T(q) = one_s + per_token_s (q - 1)."""
    times = StepTimes()
    for _ in range(20):
        for q in (1, 2, 5, 9, 17):
            times.observe(q, one_s + per_token_s * (q - 1))
    return times
