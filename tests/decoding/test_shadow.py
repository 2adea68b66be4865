"""Shadow proposals: a cheap deterministic drafter not chosen is judged against the greedy step's tokens."""

from __future__ import annotations

from collections.abc import Sequence

from splitspec.decoding.controller import SHADOW_UNTIL, Choice, SpeculationController
from splitspec.decoding.drafters import Draft, build_tree
from splitspec.decoding.shadow import matched_depth, score_shadows


class Chains:
    """A drafter proposing fixed chains (``shadow`` as given), counting its calls."""

    def __init__(self, name: str, chains: list[list[int]], shadow: bool = True) -> None:
        self.name, self.chains, self.shadow, self.calls = name, chains, shadow, 0

    def propose(self, context: Sequence[int], budget: int) -> Draft:
        self.calls += 1
        return build_tree(self.chains, budget)


def test_matched_depth_follows_the_tokens_down_the_tree() -> None:
    tree = Draft([5, 6, 7, 8], [-1, 0, 1, 0])  # 5 -> 6 -> 7, and 5 -> 8
    assert matched_depth(tree, [5, 8, 1]) == 2
    assert matched_depth(tree, [5, 6, 7, 9]) == 3
    assert matched_depth(tree, [4]) == 0
    assert matched_depth(Draft.empty(), [5]) == 0


def test_an_unasked_cheap_drafter_is_judged_and_the_others_are_not() -> None:
    controller = SpeculationController(["draft", "prompt-lookup", "slow"])
    lookup = Chains("prompt-lookup", [[5, 6, 7, 8]])
    slow = Chains("slow", [[5, 6]], shadow=False)
    drafters = {"draft": Chains("draft", [[9]]), "prompt-lookup": lookup, "slow": slow}
    choices = [Choice("draft", 4, 1.0), Choice("prompt-lookup", 4, 0.9), Choice("slow", 2, 0.5), Choice(None, 0, 0.1)]
    # the draft model was chosen; the target's greedy tokens were 5, 6, 3: prompt lookup would have had 2 accepted
    score_shadows(controller, drafters, choices, {"draft"}, [1, 2], [5, 6, 3], budget_cap=8)
    assert (lookup.calls, slow.calls, drafters["draft"].calls) == (1, 0, 0)
    stats = controller._stats["prompt-lookup"]
    assert stats.reached[:3] == [1.0, 1.0, 1.0]  # depths 1, 2 accepted, depth 3 judged and rejected
    assert stats.accepted[:3] == [1.0, 1.0, 0.0]
    assert controller._stats["draft"].reached == []  # the chosen drafter is told by the loop, not here
    # a path that matched every emitted token is censored: the depth after it was not judged
    score_shadows(controller, drafters, choices, {"draft"}, [1, 2], [5, 6], budget_cap=8)
    assert stats.reached[2] == 1.0  # depth 3 not judged this time: neither counted nor aged
    assert stats.accepted[1] == 1.97  # depth 2 accepted again (after aging by 0.97)


def test_shadow_scoring_stops_once_the_drafter_is_judged() -> None:
    controller = SpeculationController(["draft", "ngram"])
    ngram = Chains("ngram", [[5]])
    choices = [Choice("draft", 2, 1.0), Choice("ngram", 2, 0.9)]
    assert SHADOW_UNTIL == 4.0  # the count worked out below
    calls = 0
    while controller.wants_shadow("ngram"):
        score_shadows(controller, {"draft": Chains("draft", [[9]]), "ngram": ngram}, choices, {"draft"}, [1], [5, 1], 4)
        calls += 1
        assert calls < 20
    assert calls == 5  # judged 1 + .97 + .97^2 + .97^3 < SHADOW_UNTIL (4) times after four, 4.8 after five
    score_shadows(controller, {"draft": Chains("draft", [[9]]), "ngram": ngram}, choices, {"draft"}, [1], [5, 1], 4)
    assert ngram.calls == calls  # judged enough: no more shadow proposals
