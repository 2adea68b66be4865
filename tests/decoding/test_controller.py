"""The adaptive controller drafts when it pays and falls back to sequential when it does not."""

from __future__ import annotations

import math
import random

import pytest

from splitspec.decoding.controller import (
    PRIOR_FADE,
    PROBE_BUDGET,
    SHADOW_UNTIL,
    SpeculationController,
)
from splitspec.decoding.estimates import MEMO_ENTRIES, StepTimes
from tests.decoding.step_times import measured_step_times


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


def test_short_answers_re_probe_a_drafter_the_engine_judged_too_dear() -> None:
    """Every sequence starts from the engine-wide estimates; answers shorter than ``probe_every`` one-token steps
    still re-probe, on the engine's count (a cold GPU's first proposals once locked the draft model out for good)."""
    population = SpeculationController(["draft"])
    population.observe_step(1, 0.06)
    population.observe_step(3, 0.07)
    for _ in range(3):  # cold proposals: 400 ms a token, as the draft model's first ones on a cold H200
        population.observe_draft("draft", 2, 1, 2, 0.8)
    probed_in = []
    for answer in range(4):  # answers of 10 tokens, each a new sequence
        ctl = SpeculationController(["draft"], step_times=population.step_times, population=population)
        for _ in range(10):
            best = ctl.ranked()[0]
            if best.drafter is not None:
                assert best.budget == 1  # a probe: the cheapest draft
                probed_in.append(answer)
                ctl.observe_step(2, 0.065)
                break
            ctl.observe_step(1, 0.06)
    assert probed_in == [2]  # after 24 one-token steps of the engine (20 in answers 0-1, 4 in answer 2)


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


@pytest.mark.parametrize(("miss_s", "drafts"), [(0.012, False), (0.0005, True)])
def test_a_drafter_that_mostly_finds_nothing_pays_only_if_finding_nothing_is_cheap(miss_s: float, drafts: bool) -> None:
    """Prompt lookup over a long context: 20 of 21 proposals find no match, each scan costing ``miss_s``;
    its one draft had 2 of 4 tokens accepted. A miss's step is a one-token step plus the scan: at 12 ms a
    scan (on a 30 ms step) drafting cannot pay, at 0.5 ms it does."""
    ctl = SpeculationController(["prompt-lookup"], budgets=(1, 2, 4, 8), step_times=measured_step_times(0.03, 0.0005))
    for _ in range(20):
        ctl.observe_draft("prompt-lookup", 0, 0, 0, miss_s)
    ctl.observe_draft("prompt-lookup", 4, 2, 4, 0.0001)
    best = ctl.ranked()[0]
    assert (best.drafter == "prompt-lookup") is drafts
    assert ctl.value("prompt-lookup", 4) < ctl.value(None, 0) or drafts


def test_a_drafter_rejected_at_depth_one_is_not_expected_to_go_deep() -> None:
    """A fresh controller (optimistic prior 0.7) whose drafter was rejected at depth 1 three times: the
    depths never judged are expected to go as depth 1, so it drafts short (or not) instead of 8-deep."""
    ctl = SpeculationController(["draft"], budgets=(1, 2, 4, 8, 16), step_times=measured_step_times(0.03, 0.001))
    for _ in range(3):
        ctl.observe_draft("draft", 8, 0, 8, 0.0001)
    alphas = ctl.alphas("draft", 4)
    assert alphas[0] < 0.3
    assert all(a <= alphas[0] + 1e-9 for a in alphas)  # not the 0.7 prior past depth 1
    assert ctl.ranked()[0].budget <= 2


def test_no_acceptance_is_expected_past_the_depth_a_drafter_reaches() -> None:
    """A draft head's trees are 6 levels deep at most. Its drafts accepted whole leave depth 7 unjudged, which
    must not be expected to go as depth 6 (nor every depth past it): a 16-node tree was credited with 16 accepted
    tokens, and 17-token steps were asked for 7 tokens at most. Past its reach nothing is accepted."""
    ctl = SpeculationController(["eagle"], step_times=measured_step_times(0.03, 0.001), max_depths={"eagle": 6})
    for _ in range(40):
        ctl.observe_draft("eagle", 6, 6, 16, 0.0001)
    assert ctl.reach("eagle") == 6
    alphas = ctl.alphas("eagle", 16)
    assert min(alphas[:6]) > 0.9
    assert alphas[6:] == [0.0] * 10
    assert ctl.expected_accepted("eagle", 16) == pytest.approx(ctl.expected_accepted("eagle", 6))
    assert ctl.expected_accepted("eagle", 16) <= 6.0
    best = ctl.ranked()[0]
    assert (best.drafter, best.budget) == ("eagle", 6)  # the depth it reaches, not a wider step for nothing


def test_a_reach_is_told_to_the_population_and_outgrown_by_deeper_drafts() -> None:
    """A drafter with no limit (prompt lookup) keeps every budget's depths; a declared reach goes to the engine-wide
    estimates too; a drafter seen drafting deeper than it declared is believed from its drafts."""
    population = SpeculationController(["ngram", "prompt-lookup"])
    ctl = SpeculationController(["ngram", "prompt-lookup"], step_times=population.step_times, population=population)
    ctl.set_max_depths({"ngram": 3, "prompt-lookup": None, "not-mine": 2})
    assert (ctl.reach("ngram"), population.reach("ngram"), ctl.reach("prompt-lookup")) == (3, 3, None)
    assert min(ctl.alphas("prompt-lookup", 16)) > 0.0
    ctl.observe_draft("ngram", 5, 5, 5, 0.0)
    assert ctl.reach("ngram") == 5
    alphas = ctl.alphas("ngram", 8)
    assert alphas[4] > 0.0
    assert alphas[5:] == [0.0] * 3
    with pytest.raises(ValueError, match="depth of 1"):
        ctl.set_max_depths({"ngram": 0})


def test_a_fresh_controller_prefers_no_draft_when_drafting_costs_more_than_it_can_save() -> None:
    """Measured: 30 ms one-token steps, 4 ms more per extra token (a long context), and a drafter at
    20 ms a token: even at the optimistic prior acceptance, sequential steps are faster."""
    ctl = SpeculationController(["draft"], step_times=measured_step_times(0.03, 0.004))
    ctl.observe_draft("draft", 1, 1, 1, 0.020)
    assert ctl.ranked()[0].drafter is None
    cheap = SpeculationController(["draft"], step_times=measured_step_times(0.03, 0.004))
    cheap.observe_draft("draft", 1, 1, 1, 0.001)
    assert cheap.ranked()[0].drafter == "draft"  # the same acceptance at 1 ms a token pays


def test_what_is_known_of_an_unused_drafter_ages() -> None:
    """Prompt lookup found nothing once, early; then the draft model drafted for 60 steps. The text has
    moved on (it may have begun to repeat itself): prompt lookup's estimate returns towards the
    prior, so it is asked again instead of being written off for good."""
    ctl = SpeculationController(["draft", "prompt-lookup"], step_times=measured_step_times(0.03, 0.0005))
    ctl.observe_draft("prompt-lookup", 0, 0, 0, 0.0001)
    assert ctl.hit_rate("prompt-lookup") <= 0.5
    for _ in range(60):
        ctl.observe_draft("draft", 4, 1, 4, 0.004)
    assert ctl.hit_rate("prompt-lookup") > 0.8
    assert ctl.ranked()[0].drafter == "prompt-lookup"


def test_a_controller_with_no_step_measured_steps_sequentially_first() -> None:
    """Nothing measured: every T(q) would read alike and the deepest draft would win blind. The first
    step is a one-token one (what ``off`` does); once it is measured, drafting is judged against it."""
    ctl = SpeculationController(["ngram", "prompt-lookup"])
    assert [c.drafter for c in ctl.ranked()] == [None]
    ctl.observe_step(1, 0.03)
    ranked = ctl.ranked()
    assert ranked[0].drafter is not None
    assert sorted(str(c.drafter) for c in ranked) == ["None", "ngram", "prompt-lookup"]  # one budget each
    assert ranked[0].budget < max(ctl.budgets)  # +2 % a token before a wide step is measured: not blind-deep


def test_step_times_are_kept_per_context_length() -> None:
    """One link, two context lengths: a wide step after 2,000 tokens costs more than after 100 (attention
    over the context), and each is predicted from its own band. A band with only T(1) measured borrows
    the extra cost of the nearest band that has one."""
    times = StepTimes()
    for _ in range(20):
        times.observe(1, 0.030, context_tokens=100)
        times.observe(17, 0.0365, context_tokens=100)
        times.observe(1, 0.031, context_tokens=2000)
        times.observe(17, 0.043, context_tokens=2000)
    assert abs(times.predict(17, 100) - 0.0365) < 1e-3
    assert abs(times.predict(17, 2000) - 0.043) < 1e-3
    assert abs(times.predict(17, 3000) - 0.043) < 1e-3  # the nearest band with a wide step measured
    times.observe(1, 0.040, context_tokens=5000)  # a new band: only T(1), and the 2,000 band's extra cost
    assert abs(times.predict(17, 5000) - (0.040 + 0.012)) < 2e-3


def test_a_long_context_drafts_less_than_a_short_one_on_the_same_link() -> None:
    """The same drafter and acceptance: at 100 tokens a deep draft pays, at 4,000 (steep wide steps) only a
    short one or none, from the same shared step times."""
    times = StepTimes()
    for _ in range(20):
        for q in (1, 2, 5, 9, 17):
            times.observe(q, 0.030 + 0.0003 * (q - 1), context_tokens=100)
            times.observe(q, 0.031 + 0.004 * (q - 1), context_tokens=4000)
    ctl = SpeculationController(["ngram"], budgets=(1, 2, 4, 8, 16), step_times=times)
    for i in range(30):  # accepted about half the time at each depth
        ctl.observe_draft("ngram", 8, i % 2 + i % 3, 8, 0.0001)
    short, long = ctl.ranked(100)[0], ctl.ranked(4000)[0]
    assert short.drafter == "ngram"
    assert long.drafter is None or long.budget < short.budget


def test_a_drafter_not_yet_judged_is_probed_with_a_short_draft() -> None:
    """Untried, a drafter looks as good as the optimistic prior says, deep drafts best of all; a short
    answer cannot amortise a deep miss (and a slow drafter's cost is unknown), so it is probed with
    at most PROBE_BUDGET tokens. Once its drafts are judged, deep drafts are offered when they pay."""
    ctl = SpeculationController(["draft"], budgets=(1, 2, 4, 8, 16), step_times=measured_step_times(0.03, 0.0003))
    first = ctl.ranked()[0]
    assert first.drafter == "draft"
    assert first.budget <= PROBE_BUDGET
    for _ in range(2):
        ctl.observe_draft("draft", 2, 2, 2, 0.0002)  # both tokens accepted, cheaply
    assert ctl.judged("draft")
    assert ctl.ranked()[0].budget > PROBE_BUDGET


def test_a_cheap_drafter_that_sometimes_finds_nothing_is_asked_before_a_dear_one() -> None:
    """Prompt lookup offers a draft one time in four, and then 2 of its 4 tokens are accepted; the draft
    model always offers one, at 1.5 ms a token, its first token accepted. The draft model is the
    better bet per step (prompt lookup's misses make its steps one-token ones), but a miss of prompt
    lookup costs only its search, the loop then asks the draft model: so prompt lookup, whose drafts
    are the better ones when it has them, is asked first."""
    times = measured_step_times(0.03, 0.001)
    ctl = SpeculationController(["draft", "prompt-lookup"], budgets=(1, 2, 4), step_times=times)
    for i in range(20):
        ctl.observe_draft("draft", 2, 1, 2, 0.003)
        if i % 4 == 0:
            ctl.observe_draft("prompt-lookup", 4, 2, 4, 0.0001)
        else:
            ctl.observe_draft("prompt-lookup", 0, 0, 0, 0.0001)
    ranked = ctl.ranked()
    by_drafter = {c.drafter: c for c in ranked}
    assert by_drafter["draft"].expected_tokens_per_s > by_drafter["prompt-lookup"].expected_tokens_per_s
    assert by_drafter["prompt-lookup"].expected_tokens_per_s > ctl.value(None, 0)  # both worth asking
    assert [c.drafter for c in ranked] == ["prompt-lookup", "draft", None]


def test_a_drafter_judged_on_a_few_poor_drafts_is_asked_after_drafters_judged_better() -> None:
    """The draft model's first draft was rejected at depth 1; prompt lookup's drafts, scored on many steps,
    are accepted a third of the time there. Both are still worth asking (the draft model on its
    optimistic prior), but the one judged better is asked first: on one draft the optimistic prior
    still ranked the draft model's guesses above prompt lookup's measured drafts."""
    times = measured_step_times(0.08, 0.001)
    ctl = SpeculationController(["draft", "prompt-lookup"], budgets=(1, 2, 4), step_times=times)
    for i in range(12):
        ctl.observe_draft("prompt-lookup", 4, 1 if i % 3 == 0 else 0, 4, 0.0001)
    ctl.observe_draft("draft", 2, 0, 2, 0.002)
    assert ctl.judged("draft")
    assert ctl.judged("prompt-lookup")
    assert ctl.value_if_offered("draft", 2) > ctl.value_if_offered("prompt-lookup", 2)  # the optimistic order
    ranked = [c.drafter for c in ctl.ranked()]
    assert ranked.index("prompt-lookup") < ranked.index("draft") < ranked.index(None)


def test_a_good_drafter_kept_waiting_keeps_its_place() -> None:
    """The head was judged on three drafts, all accepted deep; then the draft model was chosen for 30
    steps, accepted at depth 1 two times in three. What is known of the head ages, but its rate survives the ageing,
    so it is still asked first (ordering by evidence alone, with no prior, would age it towards 0 and
    lock it out behind whichever drafter got ahead early)."""
    ctl = SpeculationController(["draft", "head"], budgets=(1, 2, 4), step_times=measured_step_times(0.08, 0.001))
    for _ in range(3):
        ctl.observe_draft("head", 4, 4, 4, 0.001)
    for i in range(30):
        ctl.observe_draft("draft", 4, i % 3, 4, 0.001)
    assert ctl.judged("draft")
    assert ctl.judged("head")
    assert ctl.ranked()[0].drafter == "head"


def test_remembered_step_times_are_what_a_fresh_estimate_predicts_after_every_observation() -> None:
    """StepTimes remembers its predictions between observations; every observation forgets them. Interleaved
    predictions and observations answer what estimates rebuilt from the same observations predict."""
    rng = random.Random(3)
    times = StepTimes()
    seen: list[tuple[int, float, int]] = []
    for _ in range(200):
        if rng.random() < 0.4:
            obs = (rng.choice([1, 2, 3, 5, 9, 17]), rng.uniform(0.01, 0.2), rng.choice([10, 300, 700, 2100]))
            times.observe(*obs)
            seen.append(obs)
        q, context = rng.choice([1, 2, 4, 7, 13, 17]), rng.choice([10, 300, 700, 2100, 5000])
        fresh = StepTimes()
        for obs in seen:
            fresh.observe(*obs)
        assert times.predict(q, context) == fresh.predict(q, context)
        assert times.predict(q, context) == fresh.predict(q, context)  # asked again: remembered, the same
    assert len(times._memo) <= MEMO_ENTRIES


def test_a_controller_asked_between_observations_ranks_as_one_asked_only_at_the_end() -> None:
    """What the ranking keeps between observations (step-time predictions, expected accepted tokens) is
    forgotten at each: a controller ranked after every observation answers as one that never was."""
    rng = random.Random(5)
    drafters = ["ngram", "prompt-lookup", "draft"]
    asked, quiet = SpeculationController(drafters), SpeculationController(drafters)
    for step in range(150):
        context = rng.choice([50, 400, 1500])
        q, seconds = rng.choice([1, 2, 3, 5, 9]), rng.uniform(0.02, 0.1)
        name, depth = rng.choice(drafters), rng.randint(1, 6)
        accepted, chosen, draft_s = rng.randint(0, depth), rng.random() < 0.8, rng.uniform(1e-3, 5e-3)
        for controller in (asked, quiet):
            controller.observe_step(q, seconds, context)
            controller.observe_draft(name, depth, accepted, depth + 2, draft_s, chosen=chosen)
        if step % 3:
            asked.ranked(context)
            asked.value("draft", 4, context)
    for context in (50, 400, 1500, 5000):
        assert asked.ranked(context) == quiet.ranked(context)


def test_the_optimistic_prior_fades_once_a_drafter_has_been_judged() -> None:
    """Depth 1's optimistic prior keeps its full weight for SHADOW_UNTIL judgements, half of it halfway to
    PRIOR_FADE, and none after: the estimate is then the drafter's own rate."""
    ctl = SpeculationController(["draft"], decay=1.0)  # no ageing: the counts are the judgements
    prior, weight = ctl.prior_alpha, ctl.prior_weight
    accepted = 0
    for judged in range(1, 13):
        hit = judged % 3 == 0
        accepted += hit
        ctl.observe_draft("draft", 1, int(hit), 1, 0.005)
        share = min(1.0, max(0.0, (PRIOR_FADE - judged) / (PRIOR_FADE - SHADOW_UNTIL)))
        expected = (accepted + prior * weight * share) / (judged + weight * share)
        assert ctl.alphas("draft", 1)[0] == pytest.approx(expected)
        if judged <= SHADOW_UNTIL:
            assert share == 1.0  # unchanged while the drafter is still being judged
    assert ctl.alphas("draft", 1)[0] == pytest.approx(4 / 12)  # its own rate


def test_a_draft_model_that_loses_on_the_steps_is_dropped_once_judged() -> None:
    """2,000-token code at 20 ms: one-token steps of 51 ms, 6 ms more per extra token, a draft model at 5 ms a
    token. Judged aside six times (two accepted), then asked on three steps where it was rejected: its rate is
    2 in 9, at which a one-token step is faster. The full optimistic prior (0.7, two observations' worth) would
    still put it near 0.3 and keep asking it."""
    ctl = SpeculationController(["draft"], budgets=(1, 2, 4), step_times=measured_step_times(0.051, 0.006))
    for i in range(6):
        ctl.observe_draft("draft", 2, 1 if i % 3 == 0 else 0, 2, 0.010, chosen=False)
    for _ in range(3):
        ctl.observe_draft("draft", 2, 0, 2, 0.010)
    assert ctl.judged("draft")
    assert ctl.ranked(2000)[0].drafter is None


def step_formula(ctl: SpeculationController, name: str, k: int, n: int, wait: float) -> float:
    """(1 + h E[accepted | k]) / (h (T(k + 1) + c k) + (1 - h) (T(1) + m) + w), from the controller's estimates."""
    stats = ctl._stats[name]
    cost = 0.0 if math.isnan(stats.cost_per_token.value) else stats.cost_per_token.value
    miss = 0.0 if math.isnan(stats.miss_s.value) else stats.miss_s.value
    h, t = ctl.hit_rate(name), ctl.step_time
    return (1 + ctl.expected_accepted(name, k)) / (h * (t(k + 1, n) + cost * k) + (1 - h) * (t(1, n) + miss) + wait)


def test_every_ranked_value_is_the_step_formula() -> None:
    """value() and each drafter's ranked choice are the step formula, at the best budget."""
    rng = random.Random(11)
    for _ in range(30):
        names = ["a", "b", "c"]
        ctl = SpeculationController(names, budgets=(1, 2, 3, 4, 8))
        for _ in range(rng.randint(1, 40)):
            ctl.observe_step(rng.choice([1, 2, 3, 5, 9]), rng.uniform(0.01, 0.1), rng.choice([10, 700, 2100]))
            name, depth = rng.choice(names), rng.randint(0, 6)
            ctl.observe_draft(name, depth, rng.randint(0, depth), depth, rng.uniform(0, 0.01))
        n, waits = rng.choice([10, 700, 2100]), {name: rng.choice([0.0, 0.005, 0.05]) for name in names}
        for choice in ctl.ranked(n, waits):
            if choice.drafter is None:
                assert choice.expected_tokens_per_s == pytest.approx(1 / ctl.step_time(1, n))
                continue
            name = choice.drafter
            budgets = ctl.budgets if ctl.judged(name) else [k for k in ctl.budgets if k <= PROBE_BUDGET]
            values = [step_formula(ctl, name, k, n, waits[name]) for k in budgets]
            assert choice.expected_tokens_per_s == pytest.approx(max(values), rel=1e-12)
            assert step_formula(ctl, name, choice.budget, n, waits[name]) == pytest.approx(max(values), rel=1e-12)
            for k, value in zip(budgets, values, strict=True):
                assert ctl.value(name, k, n, waits[name]) == pytest.approx(value, rel=1e-12)
