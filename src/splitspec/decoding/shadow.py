"""Shadow proposals: cheap deterministic drafters scored against a greedy step's tokens without being chosen.

Under greedy decoding the tokens a step emits do not depend on the draft: they are the target's
greedy continuation. So once a step is verified, what any deterministic drafter would have had
accepted there is known exactly: the longest path of its tree along those tokens. A cold
controller asks first the drafter its optimistic prior ranks first (a draft model always offers
something), and a cheap drafter it never asks is never judged: prompt lookup's matches then go
unused behind a draft model's guesses. Scoring the cheap ones in the shadow, until their first
depth has been judged :data:`~splitspec.decoding.controller.SHADOW_UNTIL` times, lets the
controller rank them on evidence. Only drafters that declare themselves cheap and deterministic
(``shadow = True``: prompt lookup, n-grams) are scored, and only drafters not asked this step.

A path that matched every emitted token is censored: the depth after it was not judged.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING

from splitspec.decoding.drafters import Drafter, is_cheap
from splitspec.decoding.trees import Draft, draft_depth

if TYPE_CHECKING:
    from splitspec.decoding.controller import Choice, SpeculationPolicy


def matched_depth(draft: Draft, tokens: Sequence[int]) -> int:
    """Length of the longest root path of ``draft`` that spells a prefix of ``tokens``."""
    children: dict[tuple[int, int], int] = {}
    for node, (token, parent) in enumerate(zip(draft.tokens, draft.parents, strict=True)):
        children.setdefault((parent, token), node)
    node, matched = -1, 0
    for token in tokens:
        nxt = children.get((node, token))
        if nxt is None:
            break
        node, matched = nxt, matched + 1
    return matched


def score_shadows(
    controller: SpeculationPolicy,
    drafters: Mapping[str, Drafter],
    choices: Sequence[Choice],
    asked: Collection[str],
    context: Sequence[int],
    target: Sequence[int],
    budget_cap: int,
) -> None:
    """Score every cheap deterministic drafter of ``choices`` not ``asked`` this step (at its ranked budget, at
    most ``budget_cap``) against ``target``, the tokens the greedy step emitted after ``context``."""
    for choice in choices:
        name = choice.drafter
        if name is None or name in asked or not is_cheap(drafters[name]):
            continue
        budget = min(choice.budget, budget_cap)
        if budget < 1 or not controller.wants_shadow(name):
            continue
        t0 = time.perf_counter()
        draft = drafters[name].propose(context, budget)
        score_proposal(controller, name, draft, time.perf_counter() - t0, target)


def score_proposal(
    controller: SpeculationPolicy, name: str, draft: Draft, seconds: float, target: Sequence[int]
) -> None:
    """Tell ``controller`` how ``name``'s ``draft`` (made in ``seconds``) fared against ``target``, the tokens the
    greedy step emitted, as a proposal not chosen."""
    if not draft:
        controller.observe_draft(name, 0, 0, 0, seconds, chosen=False)
        return
    matched = matched_depth(draft, target)
    depth = draft_depth(draft)
    judged = matched if matched == len(target) else depth  # censored: nothing past the tokens was judged
    controller.observe_draft(name, min(depth, judged), matched, len(draft), seconds, chosen=False)
