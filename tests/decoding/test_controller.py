"""The adaptive controller drafts when it pays and falls back to sequential when it does not."""

from __future__ import annotations

from splitspec.decoding.controller import SpeculationController, StepTimes


def trained(rtt_s: float, per_token_s: float, accept_rate: float, steps: int = 200) -> SpeculationController:
    ctl = SpeculationController(["ngram"], budgets=(1, 2, 4, 8))
    for i in range(steps):
        for q in (1, 2, 3, 5, 9):
            ctl.observe_step(q, rtt_s + per_token_s * q)
        depth = 4
        accepted = 0
        while accepted < depth and (i * 7919 + accepted * 104729) % 1000 < accept_rate * 1000:
            accepted += 1
        ctl.observe_draft("ngram", depth, accepted, depth, 1e-5)
    return ctl


def test_speculates_when_acceptance_is_high_and_rtt_long() -> None:
    best = trained(rtt_s=0.08, per_token_s=0.002, accept_rate=0.9).ranked()[0]
    assert best.drafter == "ngram"
    assert best.budget >= 4


def test_falls_back_to_sequential_when_acceptance_is_low() -> None:
    best = trained(rtt_s=0.005, per_token_s=0.01, accept_rate=0.05).ranked()[0]
    assert best.drafter is None


def test_break_even_moves_with_rtt() -> None:
    """The same acceptance can pay at long RTT and not at short RTT."""
    long_rtt = trained(rtt_s=0.15, per_token_s=0.01, accept_rate=0.3).ranked()[0]
    short_rtt = trained(rtt_s=0.001, per_token_s=0.01, accept_rate=0.3).ranked()[0]
    assert long_rtt.drafter == "ngram"
    assert short_rtt.drafter is None


def test_step_time_interpolates_and_extrapolates() -> None:
    ctl = SpeculationController(["ngram"])
    ctl.observe_step(1, 0.010)
    ctl.observe_step(5, 0.018)
    assert abs(ctl.step_time(3) - 0.014) < 1e-9
    assert abs(ctl.step_time(9) - 0.026) < 1e-9


def test_probes_again_after_a_long_sequential_run() -> None:
    ctl = trained(rtt_s=0.005, per_token_s=0.01, accept_rate=0.05)
    for _ in range(ctl.probe_every):
        ctl.observe_step(1, 0.015)
    assert ctl.ranked()[0].drafter == "ngram"
    assert ctl.ranked()[0].budget == 1


def test_step_times_follow_the_load_at_every_size() -> None:
    """Step times rise for every size under load; once one-token steps are fast again, a big step's
    prediction comes down with them, though no big step was measured since (it would otherwise
    keep a lone sequence from drafting long after the load has gone)."""
    times = StepTimes()
    times.observe(1, 0.10)
    times.observe(9, 0.14)
    for _ in range(30):  # other sequences queue at the trunk: every step is slow
        times.observe(1, 0.50)
        times.observe(9, 0.56)
    assert times.predict(9) > 0.45
    for _ in range(40):  # alone again, stepping one token at a time
        times.observe(1, 0.10)
    assert times.predict(1) < 0.25  # the estimates decay by observation (0.97 each): on its way down
    assert times.predict(9) < 0.40  # was 0.56 as last measured: it follows the level
    assert times.predict(1) < times.predict(9) < times.predict(1) + 0.15


def test_a_new_sequence_starts_from_the_engine_wide_estimates() -> None:
    """A sequence's controller starts from what every sequence measured (worth POPULATION_WEIGHT
    observations), not the optimistic prior, and what it measures goes to the population too."""
    population = SpeculationController(["ngram"])
    for _ in range(50):  # the population has learned that n-grams are never accepted on this link
        population.observe_step(1, 0.08)
        population.observe_step(5, 0.20)
        population.observe_draft("ngram", 4, 0, 4, 0.0)
    fresh = SpeculationController(["ngram"], step_times=population.step_times)
    seeded = SpeculationController(["ngram"], step_times=population.step_times, population=population)
    assert fresh.ranked()[0].drafter == "ngram"  # the optimistic prior tries it
    assert seeded.ranked()[0].drafter is None  # the population's estimates say it does not pay
    assert seeded.alphas("ngram", 1)[0] < 0.3
    before = population.alphas("ngram", 1)[0]
    for _ in range(20):  # this sequence's text repeats: its n-grams are accepted
        seeded.observe_draft("ngram", 4, 4, 4, 0.0)
    assert seeded.alphas("ngram", 1)[0] > 0.7  # its own observations soon outweigh the prior (from < 0.3)
    assert population.alphas("ngram", 1)[0] > before  # and the population learned from them
