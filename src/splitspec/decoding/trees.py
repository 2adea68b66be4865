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
  node gets is decided before they are drawn, never from their values, and no drawn node is pruned
  afterwards (a pruning that looked at the draws would bias them). The budget goes best-first to
  the slots the verifier is likeliest to reach and accept: the j-th sampled sibling is accepted
  with a rate that falls fast with j (it is tried only once those before it were rejected), so
  depth usually beats width; the rates are a prior or measured by the drafter
  (:class:`SiblingStats`), the deeper levels are forecast from them so a wide level does not take
  the budget a deeper one would use better, and the ``top_k`` frontier nodes to expand are the
  likeliest reached (ties: the highest cumulative q).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from splitspec.decoding.lockstep import Steps, at_once, finish
from splitspec.decoding.sampling import SamplingParams

# prior chance that the j-th sampled sibling is accepted once the ones before it were rejected
SIBLING_ACCEPTANCE = (0.6, 0.3, 0.2, 0.15)


@dataclass(frozen=True)
class Draft:
    """Drafted tokens as a tree. ``parents[i]`` is an earlier index, or -1 for a root."""

    tokens: list[int]
    parents: list[int]
    probs: torch.Tensor | None = None  # (len(tokens), V): q of each token; None = deterministic
    # a greedy dynamic tree's cumulative path log-probability of each node (see prune_greedy); None: not kept
    scores: list[float] | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def empty(cls) -> Draft:
        return cls([], [])


def draft_depth(draft: Draft) -> int:
    """Levels of a draft tree (0: empty)."""
    depth: list[int] = []
    for p in draft.parents:
        depth.append(1 if p < 0 else depth[p] + 1)
    return max(depth, default=0)


class TreeExpander(Protocol):
    """Scores a draft tree: the drafter's side of :func:`dynamic_tree`."""

    def __call__(self, tokens: list[int], parents: list[int], expanding: list[int]) -> torch.Tensor:
        """logits (len(expanding), V) float32: row i scores the children of node ``expanding[i]`` (-1: the
        roots, the token after the context) of a draft tree of n nodes (``parents[i] < i``, -1 = root).

        Each call's tree extends the previous call's (same nodes first, new ones after), and every
        node expanded is a child of the context or of a node an earlier call expanded. So an
        expander need run only the nodes it is asked to expand (EAGLE-2 runs the frontier alone);
        the rest of the tree is never scored.
        """
        ...


class StepExpander(Protocol):
    """A :class:`TreeExpander` that runs its forwards as steps (:mod:`~splitspec.decoding.lockstep`): it yields
    each forward it needs and is sent its logits, so several sequences' trees can grow in lockstep."""

    def __call__(self, tokens: list[int], parents: list[int], expanding: list[int]) -> Steps[torch.Tensor]:
        """As :meth:`TreeExpander.__call__`, the logits returned once the forwards have run."""
        ...


def stepwise(expand: TreeExpander) -> StepExpander:
    """``expand`` as a :class:`StepExpander` that yields no forward (it runs its own)."""

    def steps(tokens: list[int], parents: list[int], expanding: list[int]) -> Steps[torch.Tensor]:
        return at_once(expand(tokens, parents, expanding))

    return steps


class SiblingStats:
    """Measured chance that the j-th sampled sibling is accepted once the ones before it were rejected.

    A drafter shows it each sampled draft with the tokens the verifier emitted after the context
    it drafted for (the accepted path, then the next token: what the next context adds). A rejected
    sibling's token is never emitted at its place (the residual gives it no mass), so the emitted
    token names the accepted sibling, or none.
    """

    def __init__(self, prior: Sequence[float] = SIBLING_ACCEPTANCE, prior_weight: float = 4.0, decay: float = 0.97):
        self.prior = list(prior)
        self.prior_weight = prior_weight  # pseudo-observations behind the prior
        self.decay = decay  # per-observation decay: the rates follow the text
        self.tried = [0.0] * len(self.prior)  # decayed counts of siblings tried, by rank
        self.accepted = [0.0] * len(self.prior)  # ... and accepted

    def observe(self, draft: Draft, emitted: Sequence[int]) -> None:
        children: dict[int, list[int]] = {}
        for node, parent in enumerate(draft.parents):
            children.setdefault(parent, []).append(node)
        node = -1
        for token in emitted:
            kids = children.get(node, [])
            if not kids:
                return
            node = -2  # none accepted, unless a child matches
            for rank, child in enumerate(kids[: len(self.prior)]):
                hit = draft.tokens[child] == token
                self.tried[rank] = self.decay * self.tried[rank] + 1.0
                self.accepted[rank] = self.decay * self.accepted[rank] + float(hit)
                if hit:
                    node = child
                    break
            if node == -2:
                return

    def rates(self) -> list[float]:
        w = self.prior_weight
        return [
            (a + p * w) / (t + w) if t + w > 0 else p
            for a, p, t in zip(self.accepted, self.prior, self.tried, strict=True)
        ]


def dynamic_tree(
    expand: TreeExpander,
    budget: int,
    params: SamplingParams,
    generator: torch.Generator | None,
    top_k: int = 4,
    depth: int = 6,
    acceptance: Sequence[float] = SIBLING_ACCEPTANCE,
) -> Draft:
    """A draft tree of at most ``budget`` nodes and ``depth`` levels, ``top_k`` children per node at most.

    Nodes come parents first. Greedy: ``probs`` is None. Sampling (``params`` not greedy, a
    ``generator`` required): ``probs`` (n, V) holds for every node the q it was drawn from (its
    parent's row, shared by siblings, which are draws without replacement in node order), and the
    budget goes where the verifier is likeliest to accept: ``acceptance[j]`` is the chance the j-th
    sibling is accepted once those before it were rejected (a drafter may measure it: see
    :class:`SiblingStats`).
    """
    return finish(dynamic_tree_steps(stepwise(expand), budget, params, generator, top_k, depth, acceptance))


def dynamic_tree_steps(
    expand: StepExpander,
    budget: int,
    params: SamplingParams,
    generator: torch.Generator | None,
    top_k: int = 4,
    depth: int = 6,
    acceptance: Sequence[float] = SIBLING_ACCEPTANCE,
) -> Steps[Draft]:
    """:func:`dynamic_tree` as steps: the expander's forwards are yielded (:mod:`~splitspec.decoding.lockstep`)."""
    if top_k < 1 or depth < 1:
        raise ValueError(f"top_k ({top_k}) and depth ({depth}) must be >= 1")
    if budget < 1:
        return Draft.empty()
    if params.greedy:
        return (yield from _greedy_tree(expand, budget, top_k, depth))
    if generator is None:
        raise ValueError("a sampled draft tree needs a generator")
    return (yield from _sampled_tree(expand, budget, params, generator, top_k, depth, acceptance))


def _rows(expand: StepExpander, tokens: list[int], parents: list[int], expanding: list[int]) -> Steps[torch.Tensor]:
    logits = yield from expand(list(tokens), list(parents), list(expanding))  # (len(expanding), V)
    if logits.dim() != 2 or logits.shape[0] != len(expanding):
        raise ValueError(f"the expander returned logits of shape {tuple(logits.shape)} for {len(expanding)} nodes")
    return logits


def _best(nodes: Sequence[int], scores: Sequence[float], count: int) -> list[int]:
    """The ``count`` best of ``nodes`` by score, ties to the earlier node; in that order."""
    return sorted(nodes, key=lambda i: (-scores[i], i))[:count]


def _greedy_tree(expand: StepExpander, budget: int, top_k: int, depth: int) -> Steps[Draft]:
    tokens: list[int] = []
    parents: list[int] = []
    scores: list[float] = []  # cumulative log-probability of each node's path
    frontier = [-1]  # nodes whose children this level adds (-1: the context)
    for level in range(depth):
        logits = yield from _rows(expand, tokens, parents, frontier)  # (F, V)
        logp = torch.log_softmax(logits.float(), dim=-1)  # (F, V)
        values, ids = logp.topk(min(top_k, logp.shape[-1]), dim=-1)  # (F, k): every frontier node's at once
        added: list[int] = []
        for node, node_values, node_ids in zip(frontier, values.tolist(), ids.tolist(), strict=True):
            base = 0.0 if node < 0 else scores[node]
            for value, token in zip(node_values, node_ids, strict=True):
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
    return _kept(tokens, parents, scores, budget)


def _kept(tokens: list[int], parents: list[int], scores: list[float], budget: int) -> Draft:
    """The best ``budget`` nodes by score (ties to the earlier node), in node order (parents first), with scores."""
    keep = sorted(_best(range(len(tokens)), scores, budget))
    index = {old: new for new, old in enumerate(keep)}
    parent_of = [-1 if parents[i] < 0 else index[parents[i]] for i in keep]
    return Draft([tokens[i] for i in keep], parent_of, scores=[scores[i] for i in keep])


def prune_greedy(draft: Draft, budget: int) -> Draft:
    """A greedy tree of ``budget`` nodes from a greedy tree of more, grown with the same ``top_k`` and ``depth``.

    Exactly the tree :func:`dynamic_tree` grows at ``budget``: a run at a smaller budget expands the same levels in
    the same order, and stops early only once its budget-th best node scores at least every frontier node, so no
    node the larger run adds afterwards (each scores at most its frontier ancestor, and loses ties to earlier
    nodes) is among the best ``budget``; both keep the best ``budget`` of the nodes they grew."""
    if draft.scores is None:
        raise ValueError("only a greedy tree that kept its scores can be pruned")
    if budget >= len(draft):
        return draft
    return _kept(draft.tokens, draft.parents, draft.scores, budget)


def gumbel_top_k(q: torch.Tensor, count: int, generator: torch.Generator) -> list[int]:
    """``count`` draws from q (V,) without replacement, in draw order (Gumbel-top-k); only q > 0."""
    u = torch.rand(q.shape, generator=generator, device=q.device).clamp_min(torch.finfo(torch.float32).tiny)
    keys = q.float().log() - (-u.log()).log()  # log q + Gumbel(0, 1)
    keys = keys.masked_fill(q <= 0, -math.inf)
    count = min(count, int((q > 0).sum()))
    return [int(i) for i in keys.topk(count).indices.tolist()] if count > 0 else []


def rank_values(acceptance: Sequence[float], top_k: int) -> list[float]:
    """log P(the j-th sibling is the one accepted), j < top_k, from each rank's acceptance rate.

    ``acceptance[j]``: the chance the j-th drawn sibling is accepted once the ones before it were
    rejected (the last rate serves the ranks past the end).
    """
    out: list[float] = []
    rejected = 1.0
    for j in range(top_k):
        a = min(1.0, max(1e-6, acceptance[min(j, len(acceptance) - 1)]))
        out.append(math.log(max(1e-30, rejected * a)))
        rejected *= 1 - a
    return out


def _allocate(
    reach: Sequence[float], support: Sequence[int], ranks: Sequence[float], room: int, levels_after: int
) -> list[int]:
    """Children for each expanding node: best-first over slots by the chance they are accepted.

    Slot j of node v is worth ``reach[v] + ranks[j]`` (log chance the verifier reaches v, then
    takes its j-th child); ``support[v]`` caps v's slots (tokens q can draw). Every slot taken
    forecasts the tree below it by the same rank values, and a forecast node taken reserves budget
    for a later level, so a wide level does not take what a deeper one would use better.
    Returns each node's count.
    """
    top_k = len(ranks)
    counts = [0] * len(reach)
    # heap entries: (-value, tie, is forecast, node or parent's value, rank j, levels left below)
    heap: list[tuple[float, int, bool, float, int, int]] = []
    tie = 0
    for v in range(len(reach)):
        if support[v] > 0:
            heap.append((-(reach[v] + ranks[0]), tie, False, float(v), 0, levels_after))
            tie += 1
    heapq.heapify(heap)
    taken = 0
    while heap and taken < room:
        neg, _, forecast, ref, j, below = heapq.heappop(heap)
        taken += 1
        if not forecast:  # a real slot of node ref at this level
            v = int(ref)
            counts[v] += 1
            if j + 1 < min(top_k, support[v]):
                heapq.heappush(heap, (-(reach[v] + ranks[j + 1]), tie, False, ref, j + 1, below))
                tie += 1
        elif j + 1 < top_k:  # a forecast node: its next sibling
            heapq.heappush(heap, (-(ref + ranks[j + 1]), tie, True, ref, j + 1, below))
            tie += 1
        if below > 0:  # its forecast first child, one level down
            heapq.heappush(heap, (neg - ranks[0], tie, True, -neg, 0, below - 1))
            tie += 1
    return counts


def _sampled_tree(
    expand: StepExpander,
    budget: int,
    params: SamplingParams,
    generator: torch.Generator,
    top_k: int,
    depth: int,
    acceptance: Sequence[float],
) -> Steps[Draft]:
    ranks = rank_values(acceptance, top_k)
    tokens: list[int] = []
    parents: list[int] = []
    reach: list[float] = []  # log chance the verifier reaches each node (by sibling ranks)
    scores: list[float] = []  # cumulative log q of each node's path: breaks ties in reach
    rows: list[torch.Tensor] = []  # (V,) the q each node was drawn from
    frontier = [-1]  # the nodes this level may expand (-1: the context), best first
    for level in range(depth):
        room = budget - len(tokens)
        if room <= 0 or not frontier:
            break
        logits = yield from _rows(expand, tokens, parents, frontier)  # (F, V)
        probs = params.probabilities(logits)  # (F, V): every frontier row at once
        qs = list(probs)  # each (V,)
        base = [0.0 if node < 0 else reach[node] for node in frontier]
        # decided before any child is drawn: from the frontier's own standing and rows only
        counts = _allocate(base, (probs > 0).sum(-1).tolist(), ranks, room, depth - level - 1)
        added: list[int] = []
        for node, q, node_reach, count in zip(frontier, qs, base, counts, strict=True):
            node_score = 0.0 if node < 0 else scores[node]
            for rank, token in enumerate(gumbel_top_k(q, count, generator)):  # draws without replacement
                added.append(len(tokens))
                tokens.append(token)
                parents.append(node)
                reach.append(node_reach + ranks[rank])
                scores.append(node_score + math.log(float(q[token])))
                rows.append(q)
        frontier = sorted(added, key=lambda i: (-reach[i], -scores[i], i))[:top_k]
    if not tokens:
        return Draft.empty()
    return Draft(tokens, parents, torch.stack(rows))  # probs (n, V)
