"""The one draft-tree builder (EAGLE-2 dynamic trees), for greedy and for lossless sampled drafting.

A drafter hands :func:`dynamic_tree` a :class:`TreeExpander`: a callback that scores a draft tree
(the draft model over its own cache, an EAGLE head over the target's features). The builder grows
the tree one depth per expander call and returns a :class:`Draft` (the tree every drafter proposes).

* **Greedy** (EAGLE-2, Li et al. 2024): at each depth the ``top_k`` frontier nodes with the
  highest cumulative path log-probability (the drafter's own softmax) get their ``top_k`` most
  likely children. After ``depth`` levels, or once no new node could enter the tree, the best
  ``budget`` nodes by cumulative log-probability are kept. A child never scores above its parent
  and ties go to the earlier node, so every kept node's ancestors are kept too.
* **Sampling**: children are *draws* from the drafter's warped distribution q without replacement
  (Gumbel-top-k), so multi-draft verification
  (:func:`~splitspec.decoding.acceptance.sample_verify_tree`) stays lossless. How many children a
  node gets is decided from what is known before they are drawn (the frontier's cumulative q and
  its own q rows), never from the children's values, and no drawn node is pruned afterwards: a
  pruning that looked at the draws would bias them. The budget is spread over the levels by
  best-first allocation on the expected value of each slot (its parent's cumulative q times the
  j-th largest q of the parent's row), with the deeper levels forecast from this level's rows so
  that a wide shallow level does not eat the budget a deep chain would use better.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from splitspec.decoding.sampling import SamplingParams


@dataclass(frozen=True)
class Draft:
    """Drafted tokens as a tree. ``parents[i]`` is an earlier index, or -1 for a root."""

    tokens: list[int]
    parents: list[int]
    probs: torch.Tensor | None = None  # (len(tokens), V): q of each token; None = deterministic

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def empty(cls) -> Draft:
        return cls([], [])


class TreeExpander(Protocol):
    """Scores a draft tree: the drafter's side of :func:`dynamic_tree`."""

    def __call__(self, tokens: list[int], parents: list[int]) -> torch.Tensor:
        """logits (1 + n, V) float32 for a draft tree of n nodes (``parents[i] < i``, -1 = root).

        Row 0 scores the roots (the token after the context), row i + 1 scores the children of
        node i. Each call's tree extends the previous call's (same nodes first, new ones after), so
        an expander may recompute the whole tree every call (simplest) or cache; the builder only
        reads the rows of the nodes it is expanding.
        """
        ...


def dynamic_tree(
    expand: TreeExpander,
    budget: int,
    params: SamplingParams,
    generator: torch.Generator | None,
    top_k: int = 4,
    depth: int = 6,
) -> Draft:
    """A draft tree of at most ``budget`` nodes and ``depth`` levels, ``top_k`` children per node at most.

    Nodes come parents first. Greedy: ``probs`` is None. Sampling (``params`` not greedy, a
    ``generator`` required): ``probs`` (n, V) holds for every node the q it was drawn from (its
    parent's row, shared by siblings, which are draws without replacement in node order).
    """
    if top_k < 1 or depth < 1:
        raise ValueError(f"top_k ({top_k}) and depth ({depth}) must be >= 1")
    if budget < 1:
        return Draft.empty()
    if params.greedy:
        return _greedy_tree(expand, budget, top_k, depth)
    if generator is None:
        raise ValueError("a sampled draft tree needs a generator")
    return _sampled_tree(expand, budget, params, generator, top_k, depth)


def _rows(expand: TreeExpander, tokens: list[int], parents: list[int]) -> torch.Tensor:
    logits = expand(list(tokens), list(parents))  # (1 + n, V)
    if logits.dim() != 2 or logits.shape[0] != len(tokens) + 1:
        raise ValueError(f"the expander returned logits of shape {tuple(logits.shape)} for {len(tokens)} nodes")
    return logits


def _best(nodes: Sequence[int], scores: Sequence[float], count: int) -> list[int]:
    """The ``count`` best of ``nodes`` by score, ties to the earlier node; in that order."""
    return sorted(nodes, key=lambda i: (-scores[i], i))[:count]


def _greedy_tree(expand: TreeExpander, budget: int, top_k: int, depth: int) -> Draft:
    tokens: list[int] = []
    parents: list[int] = []
    scores: list[float] = []  # cumulative log-probability of each node's path
    frontier = [-1]  # nodes whose children this level adds (-1: the context)
    for level in range(depth):
        logits = _rows(expand, tokens, parents)
        added: list[int] = []
        for node in frontier:
            logp = torch.log_softmax(logits[node + 1].float(), dim=-1)  # (V,)
            values, ids = logp.topk(min(top_k, logp.shape[0]))
            base = 0.0 if node < 0 else scores[node]
            for value, token in zip(values.tolist(), ids.tolist(), strict=True):
                if value == -math.inf:
                    break  # an impossible token, and so are the rest
                added.append(len(tokens))
                tokens.append(token)
                parents.append(node)
                scores.append(base + value)
        frontier = _best(added, scores, top_k)
        if not frontier or level + 1 == depth:
            break
        if len(tokens) >= budget:
            # a child scores at most its parent and loses ties to every existing node: once the
            # budget-th best node scores at least the best frontier node, no child could get in
            kth = scores[_best(range(len(tokens)), scores, budget)[-1]]
            if kth >= scores[frontier[0]]:
                break
    keep = sorted(_best(range(len(tokens)), scores, budget))  # node order: parents first
    index = {old: new for new, old in enumerate(keep)}
    return Draft([tokens[i] for i in keep], [-1 if parents[i] < 0 else index[parents[i]] for i in keep])


def gumbel_top_k(q: torch.Tensor, count: int, generator: torch.Generator) -> list[int]:
    """``count`` draws from q (V,) without replacement, in draw order (Gumbel-top-k); only q > 0."""
    u = torch.rand(q.shape, generator=generator, device=q.device).clamp_min(torch.finfo(torch.float32).tiny)
    keys = q.float().log() - (-u.log()).log()  # log q + Gumbel(0, 1)
    keys = keys.masked_fill(q <= 0, -math.inf)
    count = min(count, int((q > 0).sum()))
    return [int(i) for i in keys.topk(count).indices.tolist()] if count > 0 else []


def _allocate(
    bases: Sequence[float], sorted_logq: Sequence[list[float]], room: int, levels_after: int, top_k: int
) -> list[int]:
    """Children for each expanding node: best-first over slots by expected log value, deeper levels forecast.

    Slot j of node v is worth ``bases[v] + sorted_logq[v][j]`` (its j-th likeliest child). Every
    slot taken forecasts a subtree below it, each level worth the mean sorted q profile of this
    level's rows; a forecast node taken reserves budget for a later level. Returns each node's count.
    """
    profile = [
        math.log(max(1e-30, sum(math.exp(r[j]) for r in sorted_logq if j < len(r)) / len(sorted_logq)))
        for j in range(top_k)
    ]
    counts = [0] * len(bases)
    # heap entries: (-value, tie, kind, node or parent value, j, levels left below this slot)
    heap: list[tuple[float, int, int, float, int, int]] = []
    tie = 0
    for v, row in enumerate(sorted_logq):
        if row and row[0] > -math.inf:
            heap.append((-(bases[v] + row[0]), tie, 0, float(v), 0, levels_after))
            tie += 1
    heapq.heapify(heap)
    taken = 0
    while heap and taken < room:
        neg, _, kind, ref, j, below = heapq.heappop(heap)
        value = -neg
        taken += 1
        if kind == 0:  # a real slot of node ref at this level
            v = int(ref)
            counts[v] += 1
            if j + 1 < len(sorted_logq[v]) and sorted_logq[v][j + 1] > -math.inf:
                heapq.heappush(heap, (-(bases[v] + sorted_logq[v][j + 1]), tie, 0, ref, j + 1, below))
                tie += 1
        elif j + 1 < top_k:  # a forecast node: its next sibling
            heapq.heappush(heap, (-(ref + profile[j + 1]), tie, 1, ref, j + 1, below))
            tie += 1
        if below > 0:  # its forecast first child, one level down
            heapq.heappush(heap, (-(value + profile[0]), tie, 1, value, 0, below - 1))
            tie += 1
    return counts


def _sampled_tree(
    expand: TreeExpander, budget: int, params: SamplingParams, generator: torch.Generator, top_k: int, depth: int
) -> Draft:
    tokens: list[int] = []
    parents: list[int] = []
    scores: list[float] = []  # cumulative log q of each node's path
    rows: list[torch.Tensor] = []  # (V,) the q each node was drawn from
    frontier = [-1]  # the nodes this level may expand (-1: the context), best first
    for level in range(depth):
        room = budget - len(tokens)
        if room <= 0 or not frontier:
            break
        logits = _rows(expand, tokens, parents)
        qs = [params.probabilities(logits[node + 1]) for node in frontier]  # each (V,)
        sorted_logq = [q.topk(min(top_k, q.shape[0])).values.log().tolist() for q in qs]
        bases = [0.0 if node < 0 else scores[node] for node in frontier]
        # decided before any child is drawn: from the frontier's own scores and rows only
        counts = _allocate(bases, sorted_logq, room, depth - level - 1, top_k)
        added: list[int] = []
        for node, q, base, count in zip(frontier, qs, bases, counts, strict=True):
            for token in gumbel_top_k(q, count, generator):  # siblings: draws without replacement
                added.append(len(tokens))
                tokens.append(token)
                parents.append(node)
                scores.append(base + math.log(float(q[token])))
                rows.append(q)
        frontier = _best(added, scores, top_k)
    if not tokens:
        return Draft.empty()
    return Draft(tokens, parents, torch.stack(rows))  # probs (n, V)
