"""The one draft-tree builder: EAGLE-2 greedy trees, sampled trees that keep the target's law."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch
from scipy.stats import chisquare

from splitspec.decoding.acceptance import sample_verify_tree
from splitspec.decoding.controller import FixedPolicy
from splitspec.decoding.drafters import Draft, DraftModel
from splitspec.decoding.local import LocalSequence
from splitspec.decoding.sampling import SamplingParams, probabilities
from splitspec.decoding.speculative import SpecStep, speculative_decode
from splitspec.decoding.trees import (
    SiblingStats,
    TreeExpander,
    dynamic_tree,
    gumbel_top_k,
    prune_greedy,
    rank_values,
)
from splitspec.models.checkpoint import Checkpoint
from splitspec.models.loading import load_full
from splitspec.models.stack import FullModel
from tests.conftest import joint_law_pvalue, law_fit_pvalue, local_greedy
from tests.decoding.test_speculative import PromptOnceSequence

PROMPT = [5, 9, 17, 3, 44, 2, 8, 5, 9, 17, 3, 61, 30, 12, 7, 5, 9]

# A Markov drafter over 6 tokens: ROOT scores the roots, NEXT[a] the children of a node holding a.
ROOT = [0.5, 0.3, 0.1, 0.05, 0.03, 0.02]
NEXT = [
    [0.01, 0.02, 0.62, 0.3, 0.03, 0.02],
    [0.01, 0.01, 0.01, 0.02, 0.9, 0.05],
    [0.4, 0.5, 0.04, 0.03, 0.02, 0.01],
    [0.1, 0.1, 0.1, 0.1, 0.1, 0.5],
    [0.8, 0.1, 0.04, 0.03, 0.02, 0.01],
    [1 / 6] * 6,
]


class MarkovExpander:
    """Logits log(q) by each node's last token; checks each call keeps the expander's contract."""

    def __init__(self, root: Sequence[float], table: Sequence[Sequence[float]]) -> None:
        self.root = torch.tensor(root).log()  # (V,)
        self.table = torch.tensor(table).log()  # (V, V)
        self.calls: list[list[int]] = []  # each call's tree tokens
        self.expanded: list[list[int]] = []  # each call's nodes to expand

    def __call__(self, tokens: list[int], parents: list[int], expanding: list[int]) -> torch.Tensor:
        assert all(-1 <= p < i for i, p in enumerate(parents)), "parents must come first"
        if self.calls:
            previous = self.calls[-1]
            assert tokens[: len(previous)] == previous, "a call's tree must extend the previous one"
        done = {-1, *(n for call in self.expanded for n in call)}
        assert all(n == -1 or parents[n] in done for n in expanding), "a node expanded is an expanded node's child"
        self.calls.append(list(tokens))
        self.expanded.append(list(expanding))
        return torch.stack([self.root if n < 0 else self.table[tokens[n]] for n in expanding])  # (len(expanding), V)

    def clear(self) -> None:
        self.calls.clear()
        self.expanded.clear()


def test_greedy_tree_is_eagle2() -> None:
    """Level 1: roots 0 (.5), 1 (.3). Level 2 expands both: 0->2 (.31), 0->3 (.15), 1->4 (.27), 1->5 (.015).
    Level 3 expands the best two frontier nodes, 2 and 4: 2->1 (.155), 2->0 (.124), 4->0 (.216), 4->1 (.027).
    Best five by path probability: .5, .31, .3, .27, .216."""
    expand = MarkovExpander(ROOT, NEXT)
    draft = dynamic_tree(expand, 5, SamplingParams(), None, top_k=2, depth=3)
    assert draft.tokens == [0, 1, 2, 4, 0]
    assert draft.parents == [-1, -1, 0, 1, 3]
    assert draft.probs is None
    assert len(expand.calls) == 3  # one call per depth
    assert expand.calls[-1] == [0, 1, 2, 3, 4, 5]
    assert expand.expanded == [[-1], [0, 1], [2, 4]]  # each level asks for its frontier's rows alone


def test_greedy_tree_stops_when_nothing_can_join() -> None:
    """Budget 2: after level 2 the second best node (.31) scores as high as the best frontier node."""
    expand = MarkovExpander(ROOT, NEXT)
    draft = dynamic_tree(expand, 2, SamplingParams(), None, top_k=2, depth=6)
    assert (draft.tokens, draft.parents) == ([0, 2], [-1, 0])
    assert len(expand.calls) == 2


@pytest.mark.parametrize("seed", range(4))
def test_a_pruned_greedy_tree_is_the_tree_of_the_smaller_budget(seed: int) -> None:
    """Every smaller budget's tree is the larger tree pruned, though the smaller run stops levels earlier."""
    torch.manual_seed(seed)
    vocab = 10
    root, table = torch.rand(vocab).softmax(0).tolist(), (3 * torch.randn(vocab, vocab)).softmax(1).tolist()
    large = dynamic_tree(MarkovExpander(root, table), 16, SamplingParams(), None, top_k=3, depth=5)
    stopped_early = False
    for budget in range(1, 17):
        expand = MarkovExpander(root, table)
        small = dynamic_tree(expand, budget, SamplingParams(), None, top_k=3, depth=5)
        stopped_early |= len(expand.calls) < 5
        pruned = prune_greedy(large, budget)
        assert (pruned.tokens, pruned.parents) == (small.tokens, small.parents)
        assert pruned.scores == pytest.approx(small.scores)
    assert stopped_early  # the case the pruning must get right: a smaller run that grew fewer levels
    with pytest.raises(ValueError, match="kept its scores"):
        prune_greedy(Draft([1], [-1]), 1)


@pytest.mark.parametrize("budget", [1, 3, 7, 12, 30])
def test_greedy_tree_keeps_budget_and_ancestors(budget: int) -> None:
    torch.manual_seed(0)
    vocab = 12
    expand = MarkovExpander(torch.rand(vocab).softmax(0).tolist(), (3 * torch.randn(vocab, vocab)).softmax(1).tolist())
    draft = dynamic_tree(expand, budget, SamplingParams(), None, top_k=3, depth=5)
    assert len(draft) == min(budget, 3 + 4 * 9)  # 3 roots, then 3 nodes x 3 children per level
    assert all(-1 <= p < i for i, p in enumerate(draft.parents))
    kids = Counter(draft.parents)
    assert max(kids.values()) <= 3
    chain = dynamic_tree(
        MarkovExpander(expand.root.exp().tolist(), expand.table.exp().tolist()),
        budget,
        SamplingParams(),
        None,
        top_k=1,
        depth=budget,
    )
    assert chain.parents == list(range(-1, budget - 1))  # top_k 1: the greedy chain
    assert chain.tokens[0] == draft.tokens[0] == int(expand.root.argmax())


def test_sampled_tree_draws_without_replacement() -> None:
    expand = MarkovExpander(ROOT, NEXT)
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        draft = dynamic_tree(expand, 8, SamplingParams(temperature=1.0), gen, top_k=3, depth=4)
        expand.clear()
        assert 0 < len(draft) <= 8
        assert draft.probs is not None
        assert draft.probs.shape == (len(draft), 6)
        siblings: dict[int, list[int]] = {}
        for i, p in enumerate(draft.parents):
            assert -1 <= p < i
            siblings.setdefault(p, []).append(i)
            want = torch.tensor(ROOT if p < 0 else NEXT[draft.tokens[p]])
            torch.testing.assert_close(draft.probs[i], want)  # the q it was drawn from: its parent's row
        for group in siblings.values():
            assert len(group) <= 3
            assert len({draft.tokens[i] for i in group}) == len(group)  # no token twice among siblings


def test_sampled_tree_spends_the_budget_on_depth_first() -> None:
    """The j-th sibling is tried only after the ones before it failed: with rates (.6, .3, ...) the
    first draws chain deep, and side branches come where they beat the next level."""
    expand = MarkovExpander(ROOT, NEXT)
    gen = torch.Generator().manual_seed(1)
    params = SamplingParams(temperature=1.0)
    draft = dynamic_tree(expand, 8, params, gen, top_k=4, depth=8)
    depth = [0] * len(draft)
    for i, p in enumerate(draft.parents):
        depth[i] = 1 if p < 0 else depth[p] + 1
    assert len(draft) == 8
    assert max(depth) == 5  # values .6, .36, .22, .13, .078 down the chain, .12 and .072 for the side branches
    assert draft.parents.count(-1) == 2
    expand.clear()
    wide = dynamic_tree(expand, 8, params, gen, top_k=4, depth=8, acceptance=(0.2, 0.6, 0.6, 0.6))
    assert wide.parents.count(-1) == 4  # siblings worth more than depth: the roots fill up first
    assert rank_values((0.5, 0.5), 3) == pytest.approx([math.log(0.5), math.log(0.25), math.log(0.125)])


def test_sibling_stats_read_the_accepted_rank() -> None:
    # roots 7 (node 0) and 8 (node 1); node 0's children 3 (node 2) and 4 (node 3)
    draft = Draft([7, 8, 3, 4], [-1, -1, 0, 0])
    stats = SiblingStats(prior=(0.5, 0.5, 0.5), prior_weight=0.0, decay=1.0)
    stats.observe(draft, [7, 4, 9])  # root rank 0 taken, then rank 1 below it, then a bonus token
    assert stats.tried == [2.0, 1.0, 0.0]
    assert stats.accepted == [1.0, 1.0, 0.0]
    stats.observe(draft, [5])  # both roots rejected, a residual token emitted
    assert stats.tried == [3.0, 2.0, 0.0]
    assert stats.accepted == [1.0, 1.0, 0.0]
    assert stats.rates()[:2] == pytest.approx([1 / 3, 1 / 2])


async def test_draft_model_measures_its_sibling_ranks(make_checkpoint: Callable[..., Path]) -> None:
    directory = make_checkpoint("llama", vocab=16, logit_scale=5.0)
    model = full(directory)
    params = SamplingParams(temperature=0.9)
    drafter = DraftModel(model, SamplingParams(temperature=0.5), torch.Generator().manual_seed(0), top_k=3, depth=4)
    out = speculative_decode(
        LocalSequence(model),
        [0, 13, 2, 8],
        40,
        params,
        torch.Generator().manual_seed(0),
        {"draft": drafter},
        FixedPolicy("draft", 6),
    )
    assert len([t async for t in out]) == 40
    assert drafter.siblings.tried[0] > 5  # every step's tree was read back from the next context
    assert drafter.siblings.accepted[0] > 0


def gumbel_first_token_counts(p: torch.Tensor, q: torch.Tensor, children: int, n: int) -> Counter[int]:
    gen = torch.Generator().manual_seed(3)
    counts: Counter[int] = Counter()
    target = torch.stack([p, *[torch.full_like(p, 1 / len(p))] * children])  # (1 + n, V)
    for _ in range(n):
        tokens = gumbel_top_k(q, children, gen)
        verdict = sample_verify_tree(tokens, [-1] * len(tokens), q.expand(len(tokens), -1), target, gen)
        counts[tokens[verdict.path[0]] if verdict.path else verdict.next_token] += 1
    return counts


@pytest.mark.parametrize("children", [1, 2, 3])
def test_without_replacement_siblings_keep_p(children: int) -> None:
    """Roots drawn without replacement from q (q far from p): the first emitted token follows p.

    Power: verifying the same draws with the rule for independent siblings (q not renormalised
    without the rejected token) gives p-values below 1e-10 here at 2 and 3 children.
    """
    p = torch.tensor([0.1, 0.1, 0.2, 0.3, 0.3])
    q = torch.tensor([0.6, 0.25, 0.1, 0.05, 0.0])
    n = 6000
    counts = gumbel_first_token_counts(p, q, children, n)
    assert law_fit_pvalue(counts, p, n) > 1e-3


def test_two_level_sampled_tree_keeps_the_joint_law() -> None:
    """A sampled tree from :func:`dynamic_tree`, verified: the first two tokens follow p1(a) p2(b | a)."""
    vocab = 5
    q_root = [0.5, 0.2, 0.15, 0.1, 0.05]
    q_next = [
        [0.4, 0.3, 0.1, 0.1, 0.1],
        [0.1, 0.6, 0.1, 0.1, 0.1],
        [0.2] * 5,
        [0.05, 0.05, 0.1, 0.3, 0.5],
        [0.7, 0.1, 0.1, 0.05, 0.05],
    ]
    p1 = torch.tensor([0.1, 0.35, 0.2, 0.25, 0.1])
    p2 = torch.tensor(
        [
            [0.1, 0.5, 0.1, 0.2, 0.1],
            [0.3, 0.1, 0.3, 0.2, 0.1],
            [0.6, 0.1, 0.1, 0.1, 0.1],
            [0.2, 0.2, 0.2, 0.2, 0.2],
            [0.05, 0.05, 0.1, 0.4, 0.4],
        ]
    )
    expand = MarkovExpander(q_root, q_next)
    params = SamplingParams(temperature=1.0)
    gen = torch.Generator().manual_seed(11)
    n = 5000
    counts: Counter[tuple[int, int]] = Counter()
    branched = 0
    for _ in range(n):
        draft = dynamic_tree(expand, 6, params, gen, top_k=2, depth=2)
        expand.clear()
        assert draft.probs is not None
        branched += draft.parents.count(-1) > 1
        # the target's rows: p1 at the root, p2 below a root, uniform below depth 2
        rows = [p1] + [
            p2[t] if par < 0 else torch.full((vocab,), 0.2) for t, par in zip(draft.tokens, draft.parents, strict=True)
        ]
        verdict = sample_verify_tree(draft.tokens, draft.parents, draft.probs, torch.stack(rows), gen)
        out = [draft.tokens[i] for i in verdict.path] + [verdict.next_token]
        if len(out) < 2:  # the next step (no draft) draws the second token from p2
            out.append(int(torch.multinomial(p2[out[0]], 1, generator=gen)))
        counts[(out[0], out[1])] += 1
    assert branched > n // 2, "the trees must mostly branch at the root"
    joint = p1[:, None] * p2  # (V, V)
    cells = [(a, b) for a in range(vocab) for b in range(vocab)]
    expected = [float(joint[c]) for c in cells]
    assert chisquare([counts[c] for c in cells], [e * n / sum(expected) for e in expected]).pvalue > 1e-3


def full(directory: Path) -> FullModel:
    return load_full(Checkpoint(directory), torch.float32)


class Recording:
    """A drafter that remembers what the draft model proposed."""

    name = "draft"

    def __init__(self, inner: DraftModel) -> None:
        self.inner = inner
        self.drafts: list[Draft] = []

    def propose(self, context: Sequence[int], budget: int) -> Draft:
        draft = self.inner.propose(context, budget)
        self.drafts.append(draft)
        return draft


def branches(draft: Draft) -> bool:
    return len(set(draft.parents)) < len(draft.parents)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
async def test_greedy_dynamic_trees_are_token_identical(make_checkpoint: Callable[..., Path], family: str) -> None:
    directory = make_checkpoint(family)
    drafter = Recording(DraftModel(full(make_checkpoint(family, layers=2, seed=99)), SamplingParams(), top_k=4))
    trace: list[SpecStep] = []
    gen = speculative_decode(
        LocalSequence(full(directory)),
        PROMPT,
        40,
        SamplingParams(),
        torch.Generator(),
        {"draft": drafter},
        FixedPolicy("draft", 12),
        trace=trace,
    )
    assert [t async for t in gen] == local_greedy(directory, PROMPT, 40)
    assert sum(branches(d) for d in drafter.drafts) > len(drafter.drafts) // 2
    assert max(s.draft_tokens for s in trace) == 12


@pytest.mark.parametrize("drafter_kind", ["small", "sharpened"])
async def test_sampled_draft_model_trees_keep_the_model_law(
    make_checkpoint: Callable[..., Path], drafter_kind: str
) -> None:
    """Joint law of the first two tokens with the draft model's sampled trees (second from a verified tree).

    ``small``: a 2-layer draft model; ``sharpened``: the target itself drafting at temperature 0.5,
    so q piles onto p's mode and the first root is often rejected. Power, measured: verifying these
    trees with the rule for independent siblings (q not renormalised without the rejected token)
    fails ``sharpened`` at p ~ 1e-37; ``small``'s q is too flat for it (p ~ 0.1), so it guards the
    plumbing (q rows, node order, the tree through the loop) more than the rule.
    """
    directory = make_checkpoint("llama", vocab=16, logit_scale=5.0)
    model = full(directory)
    params = SamplingParams(temperature=0.9, top_p=0.95)
    if drafter_kind == "small":
        draft, draft_params = full(make_checkpoint("llama", vocab=16, layers=2, seed=7, logit_scale=3.0)), params
    else:
        draft, draft_params = model, SamplingParams(temperature=0.5, top_p=0.95)
    prompt = [0, 13, 2, 8, 0, 0, 15, 12, 11, 15]
    with torch.no_grad():
        p1 = probabilities(LocalSequence(model).run(prompt)[-1], params.temperature, params.top_p)
        p2 = torch.stack(
            [
                probabilities(LocalSequence(model).run([*prompt, t])[-1], params.temperature, params.top_p)
                for t in range(16)
            ]
        )
    joint = p1[:, None] * p2  # (16, 16)
    n = 1000
    counts: Counter[tuple[int, int]] = Counter()
    branched = 0
    verifier = PromptOnceSequence(model, prompt)  # each run draws what it would on a fresh LocalSequence(model)
    for seed in range(n):
        generator = torch.Generator().manual_seed(seed)
        drafter = Recording(
            DraftModel(draft, draft_params, torch.Generator().manual_seed(10_000 + seed), top_k=3, depth=3)
        )
        out = speculative_decode(verifier, prompt, 6, params, generator, {"draft": drafter}, FixedPolicy("draft", 4))
        tokens = []
        async for token in out:  # 6 tokens leave room for a tree of 4 after the first; read two, no step after
            tokens.append(token)
            if len(tokens) == 2:
                break
        counts[(tokens[0], tokens[1])] += 1
        branched += bool(drafter.drafts) and drafter.drafts[0].parents.count(-1) > 1
    assert branched > n // 2, "the second token must mostly come from a verified tree with several roots"
    assert all(joint[c] > 0 for c in counts), "sampled a token pair outside the law's support"
    assert joint_law_pvalue(counts, joint, n) > 1e-3


def whole_tree_rerun(model: FullModel, context: Sequence[int]) -> TreeExpander:
    """An expander that runs the context, then the whole tree so far, afresh on every call."""

    def expand(tokens: list[int], parents: list[int], expanding: list[int]) -> torch.Tensor:
        sequence = LocalSequence(model)
        every = sequence.run(context)[-1:]  # (1, V): scores the roots
        if tokens:
            every = torch.cat([every, sequence.run(tokens, parents)])  # (1 + n, V): ancestors-only tree mask
        return every[torch.tensor(expanding) + 1].float()

    return expand


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_draft_model_runs_the_frontier_alone_and_drafts_the_whole_tree(
    make_checkpoint: Callable[..., Path], family: str
) -> None:
    """The draft model runs only the nodes it expands (level by level over its cache), and drafts what a rerun
    of the whole tree on every level drafts; mistral's window (8) is shorter than the context."""
    model = full(make_checkpoint(family, layers=2, seed=99))
    context = [*PROMPT, 11]
    for params, seed in ((SamplingParams(), None), (SamplingParams(temperature=0.8), 3)):
        gen = None if seed is None else torch.Generator().manual_seed(seed)
        drafter = DraftModel(model, params, gen, top_k=3, depth=4)
        draft = drafter.propose(context, 12)
        ref_gen = None if seed is None else torch.Generator().manual_seed(seed)
        reference = dynamic_tree(whole_tree_rerun(model, context), 12, params, ref_gen, 3, 4)
        assert len(draft) == 12
        assert (draft.tokens, draft.parents) == (reference.tokens, reference.parents)
        assert branches(draft)
        assert drafter.sequence.tokens == context  # the tree's entries are gone
        assert len(drafter.sequence.cache) == len(context)
        if reference.probs is not None:
            assert draft.probs is not None
            torch.testing.assert_close(draft.probs, reference.probs, rtol=1e-4, atol=1e-5)
