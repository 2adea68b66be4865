"""The adaptive speculation controller: how much to draft, with what, or not at all.

Each step costs T(q) = RTT + f(q) seconds for q query tokens (measured online, per q), plus the
drafter's own time. A draft of k tokens yields 1 + E[accepted | k] tokens, where
E[accepted | k] = sum_{d=1..k} prod_{j<=d} alpha_j and alpha_j is the drafter's measured
probability of accepting depth j given depth j-1 was accepted. The controller picks the
(drafter, k) with the highest expected tokens per second, and plain sequential steps (1 token in
T(1)) whenever no draft beats them: speculation below break-even makes decoding slower, and the
break-even rises as RTT falls. Estimates decay exponentially so they follow the text.

A cold start must not lose to ``off`` either (a short answer cannot amortise exploring): the first
step is sequential (it measures T(1)); a drafter not yet judged is probed with a short draft; a
proposal that offers nothing costs its search plus a one-token step; a depth never judged is
expected to go as the depth above it (not the optimistic prior), but a depth past the drafter's reach
(the most levels its drafts have, whatever the budget: a draft head's six, an n-gram pool's span) is
expected to accept nothing; and what is known of drafters left unused ages, so one written off early
is asked again. Step times are kept per context band.
A stall (a collection, a busy neighbour, a GPU's first kernels) must not write drafting off either:
durations are estimated robustly (``estimates.Seconds``), and a drafter's cost or a step width
measured once, without which drafting would pay, is measured again after CONFIRM_AFTER one-token steps.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from splitspec.decoding.estimates import Seconds, StepTimes

DEFAULT_BUDGETS = (1, 2, 3, 4, 6, 8, 12, 16)
PROBE_BUDGET = 2  # most tokens a drafter is asked for until its acceptance has been judged
CONFIRM_AFTER = 4  # one-token steps in a row before what was measured once and priced drafting out is probed again
POPULATION_WEIGHT = 8.0  # observations the engine-wide estimates are worth to a new sequence's controller
# a cheap deterministic drafter not chosen is scored against the greedy target's tokens until its first depth
# has been judged this often (decayed count): a cold controller learns it without having to choose it
SHADOW_UNTIL = 4.0
# judgements of a depth (decayed count) after which its prior has no weight left (it fades linearly from SHADOW_UNTIL)
PRIOR_FADE = 8.0


@dataclass
class _DrafterStats:
    # per depth j (1-based): decayed counts of drafts that reached depth j and of acceptances there
    reached: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)
    cost_per_token: Seconds = field(default_factory=Seconds)  # drafting seconds per drafted token
    miss_s: Seconds = field(default_factory=Seconds)  # seconds of a proposal that offered nothing
    proposals: float = 0.0  # decayed count of steps where the drafter was asked
    hits: float = 0.0  # ... and proposed something

    def forget(self, decay: float) -> None:
        """Age the counts by one step in which this drafter was not used (the costs stay as measured)."""
        self.reached = [r * decay for r in self.reached]
        self.accepted = [a * decay for a in self.accepted]
        self.proposals *= decay
        self.hits *= decay

    def scaled_copy(self, weight: float) -> _DrafterStats:
        """These estimates as a prior worth at most ``weight`` observations (the same rates, fewer counts)."""
        factor = min(1.0, weight / max(self.proposals, 1e-9))
        return _DrafterStats(
            reached=[r * factor for r in self.reached],
            accepted=[a * factor for a in self.accepted],
            cost_per_token=self.cost_per_token.scaled_copy(weight),
            miss_s=self.miss_s.scaled_copy(weight),
            proposals=self.proposals * factor,
            hits=self.hits * factor,
        )


def _once_free(times: StepTimes) -> Callable[[int, int], float]:
    """``times.predict`` with a width measured once put at a one-token step's seconds."""

    def predict(q: int, context_tokens: int) -> float:
        return times.predict(1 if times.measured_once(q, context_tokens) else q, context_tokens)

    return predict


@dataclass(frozen=True)
class Choice:
    drafter: str | None  # None = a plain sequential step
    budget: int  # draft tokens requested (0 for sequential)
    expected_tokens_per_s: float


class SpeculationPolicy(Protocol):
    """Decides each step's drafter and budget; told what happened afterwards."""

    def ranked(self, context_tokens: int = 0, waits: Mapping[str, float] | None = None) -> list[Choice]: ...

    def observe_step(self, query_tokens: int, seconds: float, context_tokens: int = 0) -> None: ...

    def observe_draft(
        self,
        drafter: str,
        proposed_depth: int,
        accepted: int,
        draft_tokens: int,
        draft_seconds: float,
        *,
        chosen: bool = True,
    ) -> None: ...

    def wants_shadow(self, drafter: str) -> bool: ...

    def set_max_depths(self, depths: Mapping[str, int | None]) -> None: ...


class BlindPolicy:
    """A policy that learns nothing: every observation is dropped (a base for fixed policies)."""

    def observe_step(self, query_tokens: int, seconds: float, context_tokens: int = 0) -> None:
        return None

    def observe_draft(
        self,
        drafter: str,
        proposed_depth: int,
        accepted: int,
        draft_tokens: int,
        draft_seconds: float,
        *,
        chosen: bool = True,
    ) -> None:
        return None

    def wants_shadow(self, drafter: str) -> bool:
        return False

    def set_max_depths(self, depths: Mapping[str, int | None]) -> None:
        return None


class FixedPolicy(BlindPolicy):
    """Always draft ``budget`` tokens with ``drafter`` (sequential only when it has nothing)."""

    def __init__(self, drafter: str, budget: int) -> None:
        self.choice = Choice(drafter, budget, math.inf)

    def ranked(self, context_tokens: int = 0, waits: Mapping[str, float] | None = None) -> list[Choice]:
        return [self.choice, Choice(None, 0, 0.0)]


class SpeculationController:
    """Online estimates of step time and acceptance; chooses each step's drafter and budget."""

    def __init__(
        self,
        drafters: Sequence[str],
        budgets: Sequence[int] = DEFAULT_BUDGETS,
        prior_alpha: float = 0.7,  # optimistic acceptance prior: untried drafters get tried
        prior_weight: float = 2.0,  # pseudo-observations behind that prior
        decay: float = 0.97,  # per-observation decay of every estimate
        probe_every: int = 24,  # sequential steps before a drafter is re-tried with a short draft
        step_times: StepTimes | None = None,  # shared with other sequences on the same link; None = its own
        # the engine-wide estimates: a new sequence starts from them (as a prior worth at most
        # POPULATION_WEIGHT observations, not the optimistic one) and every observation also goes to them
        population: SpeculationController | None = None,
        # levels each drafter's drafts reach at most, whatever the budget (see set_max_depths); None or not
        # named: as many as the budget's tokens
        max_depths: Mapping[str, int | None] | None = None,
    ) -> None:
        self.drafters = list(drafters)
        self.budgets = sorted(set(budgets))
        self.prior_alpha = prior_alpha
        self.prior_weight = prior_weight
        self.decay = decay
        self.probe_every = probe_every
        self.step_times = step_times if step_times is not None else StepTimes(decay)
        self.population = population
        if population is not None and population.drafters != self.drafters:
            raise ValueError(f"the population's drafters {population.drafters} are not {self.drafters}")
        self._stats: dict[str, _DrafterStats] = {
            name: _DrafterStats() if population is None else population.prior(name) for name in self.drafters
        }
        self._since_speculation = 0
        # (drafter, depth 1's prior) -> expected accepted tokens by budget, until the next draft is observed
        self._accepted_sums: dict[tuple[str, float | None], list[float]] = {}
        self._max_depths: dict[str, int | None] = dict.fromkeys(self.drafters)  # as declared (set_max_depths)
        if max_depths is not None:
            self.set_max_depths(max_depths)

    def set_max_depths(self, depths: Mapping[str, int | None]) -> None:
        """The most levels each named drafter's drafts reach, whatever the budget (None: as many as the budget's
        tokens): a draft head's or a draft model's tree depth, an n-gram pool's span
        (:func:`~splitspec.decoding.drafters.max_depth`). No acceptance is expected past it (:meth:`alphas`): a
        draft that was accepted whole leaves the depth below it unjudged, and that depth would otherwise be expected
        to go as the deepest one judged, and every depth past it too (a head of depth 6 accepted whole 40 times was
        asked for 16 tokens, 17-token steps for 7 tokens at most). The population is told too."""
        for name, depth in depths.items():
            if name not in self._max_depths:
                continue  # not one of this controller's drafters
            if depth is not None and depth < 1:
                raise ValueError(f"drafter {name!r}'s drafts must reach a depth of 1 at least, got {depth}")
            self._max_depths[name] = depth
        self._accepted_sums.clear()
        if self.population is not None:
            self.population.set_max_depths(depths)

    def reach(self, drafter: str) -> int | None:
        """The most levels ``drafter``'s drafts reach (None: unbounded): as declared (:meth:`set_max_depths`), or
        deeper where its drafts were seen deeper (a declaration that undersells it is not believed)."""
        declared = self._max_depths.get(drafter)
        return None if declared is None else max(declared, len(self._stats[drafter].reached))

    # -- estimates ---------------------------------------------------------------------------------

    def prior(self, drafter: str) -> _DrafterStats:
        """This controller's estimates of ``drafter`` as a new sequence's prior (:data:`POPULATION_WEIGHT`)."""
        return self._stats[drafter].scaled_copy(POPULATION_WEIGHT)

    def step_time(self, q: int, context_tokens: int = 0) -> float:
        """Predicted seconds for a step of q query tokens after ``context_tokens`` tokens."""
        return self.step_times.predict(q, context_tokens)

    def alphas(self, drafter: str, depth: int, prior_alpha: float | None = None) -> list[float]:
        """Acceptance estimates of depths 1..depth. Depth 1's prior is ``prior_alpha`` (the controller's
        optimistic one unless given); each deeper depth's is the estimate of the depth above it, so a
        drafter rejected at depth 1 is not still expected to go deep (a depth is judged only when the
        one above it was accepted).

        The prior's weight fades once the depth has been judged :data:`SHADOW_UNTIL` times, to nothing at
        :data:`PRIOR_FADE` judgements:
        the optimistic prior is there to get a drafter tried, not to outvote what its drafts showed (on
        long code, a draft model judged six times at 0.3 was still estimated at 0.4-0.5 and asked on
        steps it lost). What is known ages, so a drafter left unused regains its prior and is tried again.

        Past the drafter's :meth:`reach` nothing is accepted: 0. A budget counts a tree's nodes, and the
        expected acceptance sums these depth by depth, as along a chain: a budget is thereby credited with the
        depths it can reach, min(budget, reach). Its width is not modelled (what a wider tree gains at each depth
        is in the estimates only as far as the trees drafted so far had it)."""
        stats = self._stats[drafter]
        out = []
        prior = self.prior_alpha if prior_alpha is None else prior_alpha
        reach = self.reach(drafter)
        for j in range(depth):
            if reach is not None and j >= reach:
                out.append(0.0)  # no draft of this drafter has a node this deep
                continue
            reached = stats.reached[j] if j < len(stats.reached) else 0.0
            accepted = stats.accepted[j] if j < len(stats.accepted) else 0.0
            weight = self.prior_weight * min(1.0, max(0.0, (PRIOR_FADE - reached) / (PRIOR_FADE - SHADOW_UNTIL)))
            prior = (accepted + prior * weight) / (reached + weight)
            out.append(prior)
        return out

    def expected_accepted(self, drafter: str, budget: int) -> float:
        return self.hit_rate(drafter) * self._accepted_if_offered(drafter, budget)

    def _accepted_if_offered(self, drafter: str, budget: int, prior_alpha: float | None = None) -> float:
        """Expected accepted tokens of a ``budget``-deep draft of ``drafter``: the sum over depths of the product of
        their acceptance estimates."""
        return self._accepted_sums_to(drafter, budget, prior_alpha)[budget]

    def _accepted_sums_to(self, drafter: str, budget: int, prior_alpha: float | None = None) -> list[float]:
        """:meth:`_accepted_if_offered` of every depth 0..``budget`` at least, kept until the next observation of
        a draft (a ranking asks for each drafter at every budget: the same products again)."""
        key = (drafter, prior_alpha)
        sums = self._accepted_sums.get(key)
        if sums is None or len(sums) <= budget:
            total, run, sums = 0.0, 1.0, [0.0]
            for alpha in self.alphas(drafter, max(budget, self.budgets[-1]), prior_alpha):
                run *= alpha
                total += run
                sums.append(total)
            self._accepted_sums[key] = sums
        return sums

    def value_if_offered(
        self,
        drafter: str,
        budget: int,
        context_tokens: int = 0,
        prior_alpha: float | None = None,
        wait_s: float = 0.0,
    ) -> float:
        """Expected tokens per second of a step with ``drafter``'s draft, given that it offers one
        (``prior_alpha``: depth 1's prior, the optimistic one unless given; ``wait_s``: seconds the
        proposal first waits for the drafting thread)."""
        cost = self._stats[drafter].cost_per_token.value
        draft_s = 0.0 if math.isnan(cost) else cost * budget
        wide = self.step_time(budget + 1, context_tokens)
        return (1.0 + self._accepted_if_offered(drafter, budget, prior_alpha)) / (wide + draft_s + wait_s)

    def asking_value(self, drafter: str, budget: int, context_tokens: int = 0, wait_s: float = 0.0) -> float:
        """What orders the drafters worth asking: a drafter not yet judged by its optimistic prior (so it
        gets asked), a judged one with depth 1's prior no higher than its own acceptance rate there, so
        one judged on a few poor drafts is not asked before drafters whose drafts were judged better.
        The rate is a ratio of two counts that age together, so it survives while the drafter is not
        asked: a good drafter kept waiting keeps its place (a prior of 0 would age it towards 0 and lock
        it out behind whichever drafter got ahead early)."""
        stats = self._stats[drafter]
        if not self.judged(drafter):
            return self.value_if_offered(drafter, budget, context_tokens, wait_s=wait_s)
        rate = stats.accepted[0] / stats.reached[0]
        return self.value_if_offered(drafter, budget, context_tokens, min(self.prior_alpha, rate), wait_s)

    def value(self, drafter: str | None, budget: int, context_tokens: int = 0, wait_s: float = 0.0) -> float:
        """Expected tokens per second of one step.

        Asked for ``budget`` tokens, the drafter offers some with its hit rate h: the step is then
        budget + 1 tokens wide and costs the drafting too. Otherwise the proposal's time is lost and
        the step is a one-token one: seconds = h (T(budget + 1) + drafting) + (1 - h) (T(1) + miss),
        each plus ``wait_s``, the wait for the drafting thread before the proposal starts (under load,
        other sequences' drafts queue there: the drafter's own seconds are what it costs alone).
        """
        if drafter is None or budget == 0:
            return 1.0 / self.step_time(1, context_tokens)
        return self._values(drafter, [budget], context_tokens, wait_s)[0]

    def _values(
        self, drafter: str, budgets: Sequence[int], context_tokens: int, wait_s: float, *, once_free: bool = False
    ) -> list[float]:
        """:meth:`value` of ``drafter`` at each of ``budgets`` (a ranking's inner loop: the drafter's terms once).
        ``once_free``: with what was measured once put at nothing (its drafting cost; a step width's extra cost)."""
        stats, times = self._stats[drafter], self.step_times
        cost, miss = stats.cost_per_token.value, stats.miss_s.value
        per_token = 0.0 if math.isnan(cost) or (once_free and stats.cost_per_token.measured_once) else cost
        miss_s = 0.0 if math.isnan(miss) else miss
        hit = self.hit_rate(drafter)
        n = context_tokens
        lost = (1.0 - hit) * (times.predict(1, n) + miss_s)  # a miss: its search, then a one-token step
        sums = self._accepted_sums_to(drafter, max(budgets))
        # a width measured once costs what a one-token step does when ``once_free``
        predict: Callable[[int, int], float] = _once_free(times) if once_free else times.predict
        return [(1.0 + hit * sums[k]) / (hit * (predict(k + 1, n) + per_token * k) + lost + wait_s) for k in budgets]

    def judged(self, drafter: str) -> bool:
        """Whether the verifier has judged about one of ``drafter``'s drafts, at least (the counts age:
        a drafter left unused long enough is probed again)."""
        reached = self._stats[drafter].reached
        return bool(reached) and reached[0] >= 0.5

    def hit_rate(self, drafter: str) -> float:
        """Estimated share of proposals where ``drafter`` offers something."""
        stats = self._stats[drafter]
        return (stats.hits + 1.0) / (stats.proposals + 1.0)

    # -- decisions ---------------------------------------------------------------------------------

    def ranked(self, context_tokens: int = 0, waits: Mapping[str, float] | None = None) -> list[Choice]:
        """Each drafter at its best budget, and sequential, best first (the loop asks them in turn until one
        offers a draft: a drafter that offered nothing would offer nothing at a smaller budget either).

        Until a step time is measured, only sequential: the first step measures T(1), against which
        every draft is judged (one-token steps are what ``off`` does; drafting blind at a flat T(q)
        would draft as deep as the budgets allow). A drafter none of whose drafts was judged yet is
        offered at :data:`PROBE_BUDGET` tokens at most: a probe costs little even when the drafter
        is slow or wrong (a short answer cannot amortise a deep miss), and measures its cost and
        its first depths, from which the deeper ones are estimated.

        ``waits``: seconds a drafter's proposal would first wait for the drafting thread, by name (none
        for one not named): under load, other sequences' drafts queue there.
        """
        n = context_tokens
        wait = waits or {}
        options = [Choice(None, 0, self.value(None, 0, n))]
        if not self.step_times.measured:
            return options
        for name in self.drafters:
            budgets = self.budgets if self.judged(name) else [k for k in self.budgets if k <= PROBE_BUDGET]
            budgets = budgets or self.budgets[:1]
            values = self._values(name, budgets, n, wait.get(name, 0.0))
            best = max(range(len(budgets)), key=values.__getitem__)  # the first of equals: the smaller budget
            options.append(Choice(name, budgets[best], values[best]))
        options.sort(key=lambda c: c.expected_tokens_per_s, reverse=True)
        # the drafters worth asking (above sequential) are asked in turn until one offers a draft, and a
        # miss costs only its search: ask first the one whose draft is best when it offers one (prompt
        # lookup's long matches before a draft model's guesses, which then fill in where it has none)
        cut = next(i for i, c in enumerate(options) if c.drafter is None)
        ask = sorted(
            options[:cut],
            key=lambda c: self.asking_value(str(c.drafter), c.budget, n, wait.get(str(c.drafter), 0.0)),
            reverse=True,
        )
        options = ask + options[cut:]
        if options[0].drafter is None and self.drafters:
            probe = self._probe(n, wait)
            if probe is not None:
                options.insert(0, probe)
        return options

    def _probe(self, context_tokens: int, waits: Mapping[str, float]) -> Choice | None:
        """A short draft to measure again with, when one-token steps have won ``probe_every`` times in a row
        (estimates of a drafter we stopped using cannot improve otherwise), or :data:`CONFIRM_AFTER` times while
        what priced drafting out was measured once: a drafter's cost or a step width, without which it would pay.
        A first proposal or wide step stalls the most (a cold cache, a kernel plan built on a GPU, a collection),
        and a stall read as their cost once priced drafting out for the rest of a short answer."""
        n, run, k0 = context_tokens, self.sequential_run(), self.budgets[0]
        if run >= self.probe_every:
            values = {name: self.value(name, k0, n, waits.get(name, 0.0)) for name in self.drafters}
            best = max(values, key=values.__getitem__)  # the first of equals, as the drafters are listed
            return Choice(best, k0, values[best])
        if run < CONFIRM_AFTER:
            return None
        sequential = self.value(None, 0, n)
        unconfirmed = [
            (value, name, k)
            for name in self.drafters
            for k in self.budgets  # the cheapest draft, or a short one whose step width was measured once
            if k == k0 or (k <= PROBE_BUDGET and self.step_times.measured_once(k + 1, n))
            if (value := self._value_unconfirmed(name, k, n, waits.get(name, 0.0))) > sequential
        ]
        if not unconfirmed:
            return None
        _, name, k = max(unconfirmed)
        return Choice(name, k, self.value(name, k, n, waits.get(name, 0.0)))

    def _value_unconfirmed(self, drafter: str, budget: int, context_tokens: int, wait_s: float) -> float:
        """:meth:`value` with what was measured once put at nothing (0 when nothing was: nothing to confirm)."""
        if not (
            self._stats[drafter].cost_per_token.measured_once
            or self.step_times.measured_once(budget + 1, context_tokens)
        ):
            return 0.0
        return self._values(drafter, [budget], context_tokens, wait_s, once_free=True)[0]

    # -- observations ------------------------------------------------------------------------------

    def sequential_run(self) -> int:
        """One-token steps since the last draft: this sequence's, or the engine's (its population's) when longer.

        The engine's count lets short answers re-probe too. A drafter judged too dear from a few slow
        observations (a GPU's cold start; the H200s here also drop from 1,980 to 345 MHz when idle) is otherwise
        never measured again by answers shorter than ``probe_every`` tokens, each starting from those estimates."""
        population = 0 if self.population is None else self.population.sequential_run()
        return max(self._since_speculation, population)

    def observe_step(self, query_tokens: int, seconds: float, context_tokens: int = 0) -> None:
        self.step_times.observe(query_tokens, seconds, context_tokens)
        self._count_step(query_tokens)
        if self.population is not None:  # the engine's run (its step times are observed by whoever holds them)
            self.population._count_step(query_tokens)

    def _count_step(self, query_tokens: int) -> None:
        self._since_speculation = self._since_speculation + 1 if query_tokens == 1 else 0

    def wants_shadow(self, drafter: str) -> bool:
        """Whether ``drafter``, cheap and deterministic but not chosen, should be scored against this greedy
        step's tokens anyway (see :data:`SHADOW_UNTIL`)."""
        reached = self._stats[drafter].reached
        return not reached or reached[0] < SHADOW_UNTIL

    def observe_draft(
        self,
        drafter: str,
        proposed_depth: int,
        accepted: int,
        draft_tokens: int,
        draft_seconds: float,
        *,
        chosen: bool = True,
    ) -> None:
        """A drafter proposed a tree ``proposed_depth`` deep; ``accepted`` of its tokens were kept (or would
        have been: ``chosen`` False, a shadow proposal scored against a greedy step's tokens)."""
        self._accepted_sums.clear()  # every drafter's estimates may move (the others age)
        if self.population is not None:
            self.population.observe_draft(drafter, proposed_depth, accepted, draft_tokens, draft_seconds, chosen=chosen)
        for name, other in self._stats.items():
            # what is known of the others ages too: the text they failed on has moved on (once per step)
            if name != drafter and chosen:
                other.forget(self.decay)
        stats = self._stats[drafter]
        stats.proposals = self.decay * stats.proposals + 1.0
        stats.hits = self.decay * stats.hits + (1.0 if draft_tokens else 0.0)
        if draft_tokens:
            stats.cost_per_token.update(draft_seconds / draft_tokens, self.decay)
        else:
            stats.miss_s.update(draft_seconds, self.decay)
        while len(stats.reached) < proposed_depth:
            stats.reached.append(0.0)
            stats.accepted.append(0.0)
        for j in range(proposed_depth):
            stats.reached[j] *= self.decay
            stats.accepted[j] *= self.decay
        for j in range(min(proposed_depth, accepted + 1)):  # depths the verifier actually judged
            stats.reached[j] += 1.0
            if j < accepted:
                stats.accepted[j] += 1.0
