"""Speculative decoding: greedy output is token-identical, sampling keeps the model's law."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch
from scipy.stats import chisquare

from splitspec.decoding.controller import FixedPolicy, SpeculationController, SpeculationPolicy
from splitspec.decoding.drafters import (
    Draft,
    Drafter,
    DraftModel,
    MixedDrafter,
    NgramPool,
    PromptLookup,
    build_tree,
    leaf_chains,
    max_depth,
)
from splitspec.decoding.eagle import EagleDrafter
from splitspec.decoding.local import LocalSequence
from splitspec.decoding.loop import decode
from splitspec.decoding.sampling import SamplingParams, probabilities
from splitspec.decoding.speculative import SpecStep, make_drafters, speculative_decode
from splitspec.edge.config import EdgeConfig
from splitspec.exceptions import ConfigError
from splitspec.models import draft_forward
from splitspec.models.checkpoint import Checkpoint
from splitspec.models.draft_forward import DraftForward
from splitspec.models.draft_head import DraftHead, default_config
from splitspec.models.loading import load_full
from splitspec.models.masks import depths
from splitspec.models.stack import FullModel
from splitspec.prefix import window_start
from tests.conftest import greedy_reference

PROMPT = [5, 9, 17, 3, 44, 2, 8, 5, 9, 17, 3, 61, 30, 12, 7, 5, 9]


def full(directory: Path) -> FullModel:
    return load_full(Checkpoint(directory), torch.float32)


class PromptOnceSequence(LocalSequence):
    """A :class:`LocalSequence` for many decodes of one prompt (the sampled-law tests' thousand runs), whose prompt is
    run once. :meth:`reset` rolls the cache back to the prompt's entries, and the prefill the decode loop then asks
    for (the prompt, its last row) returns that step's logits again. A fresh sequence would compute the same entries
    and the same row: every run draws exactly what it draws on a fresh ``LocalSequence(model)``, with one forward
    fewer. Any other first step after a reset runs on an emptied cache, as a fresh sequence's would."""

    def __init__(self, model: FullModel, prompt: Sequence[int], feature_layers: Sequence[int] | None = None) -> None:
        super().__init__(model)
        if feature_layers is not None:
            self.keep_features(feature_layers)
        self.prompt = list(prompt)
        self.prefill = self.run(self.prompt, logits_from=len(self.prompt) - 1)  # (1, V), as the loop asks for it
        self.rolled_back = False  # reset since the last step: the cache holds the prompt alone

    def reset(self) -> None:
        self.truncate(len(self.prompt))
        self.rolled_back = True

    async def forward(
        self,
        tokens: Sequence[int],
        parents: Sequence[int] | None = None,
        logits_from: int = 0,
        *,
        sent: Callable[[], None] | None = None,
    ) -> torch.Tensor:
        first, self.rolled_back = self.rolled_back, False
        if first and list(tokens) == self.prompt and parents is None and logits_from == len(self.prompt) - 1:
            if sent is not None:
                sent()
            return self.prefill.clone()
        if first:
            super().reset()
        return await super().forward(tokens, parents, logits_from, sent=sent)


async def run(
    model: FullModel,
    mode: str,
    prompt: list[int],
    n: int,
    params: SamplingParams,
    seed: int = 0,
    draft: FullModel | None = None,
    trace: list[SpecStep] | None = None,
    budget: int = 4,
    read: int | None = None,
    verifier: LocalSequence | None = None,
) -> list[int]:
    """``auto`` runs the adaptive controller; a single drafter always drafts ``budget`` tokens.

    ``read``: stop after that many tokens (no step runs for the ones after them). ``verifier``: the
    sequence to decode on (default: a fresh ``LocalSequence(model)``).
    """
    generator = torch.Generator().manual_seed(seed)
    drafters = make_drafters(mode, params, draft, generator)
    policy: SpeculationPolicy = SpeculationController(list(drafters)) if mode == "auto" else FixedPolicy(mode, budget)
    verifier = LocalSequence(model) if verifier is None else verifier
    out = speculative_decode(verifier, prompt, n, params, generator, drafters, policy, trace=trace)
    tokens = []
    async for token in out:
        tokens.append(token)
        if len(tokens) == read:
            break
    return tokens


def test_drafters_declare_the_depth_their_drafts_reach(make_checkpoint: Callable[..., Path]) -> None:
    """What the controller credits no acceptance past: a tree's depth, an n-gram pool's span, a mix's deepest
    source's; none for prompt lookup (as deep as the budget) or a draft model of unbounded depth."""
    directory = make_checkpoint("llama", layers=4)
    model = full(directory)
    draft = DraftModel(model, SamplingParams(), depth=5)
    head = DraftHead(default_config(Checkpoint(directory)), torch.device("cpu"), torch.float32).eval()
    assert max_depth(EagleDrafter(head, lambda: model, None, SamplingParams())) == 6
    assert max_depth(EagleDrafter(head, lambda: model, None, SamplingParams(), depth=3)) == 3
    assert (max_depth(draft), max_depth(DraftModel(model, SamplingParams(), depth=None))) == (5, None)
    assert (max_depth(NgramPool()), max_depth(NgramPool(span=3)), max_depth(PromptLookup())) == (8, 3, None)
    assert max_depth(MixedDrafter([NgramPool(span=3), draft])) == 5
    assert max_depth(MixedDrafter([NgramPool(), PromptLookup()])) is None


async def test_decode_tells_the_controller_how_deep_each_drafter_reaches(make_checkpoint: Callable[..., Path]) -> None:
    directory = make_checkpoint("llama")
    drafters: dict[str, Drafter] = {"ngram": NgramPool(span=3), "prompt-lookup": PromptLookup()}
    ctl = SpeculationController(list(drafters), budgets=(1, 2, 4, 8, 16))
    generator = torch.Generator()
    out = speculative_decode(LocalSequence(full(directory)), PROMPT, 12, SamplingParams(), generator, drafters, ctl)
    assert [token async for token in out] == greedy_reference(directory, tuple(PROMPT), 12)
    assert (ctl.reach("ngram"), ctl.reach("prompt-lookup")) == (3, None)
    assert ctl.alphas("ngram", 16)[3:] == [0.0] * 13
    assert ctl.expected_accepted("ngram", 16) == pytest.approx(ctl.expected_accepted("ngram", 4))


def test_build_tree_merges_shared_prefixes() -> None:
    draft = build_tree([[1, 2, 3], [1, 2, 4], [5]], budget=10)
    assert draft.tokens == [1, 2, 3, 4, 5]
    assert draft.parents == [-1, 0, 1, 1, -1]
    assert build_tree([[1, 2, 3], [4, 5]], budget=4).tokens == [1, 2, 3, 4]


def test_ngram_pool_prefers_recent_continuations() -> None:
    pool = NgramPool(key_len=2, span=3, per_key=1)
    assert pool.propose([1, 2, 3, 4, 1, 2], 3).tokens == [3, 4, 1]
    assert pool.propose([1, 2, 3, 4, 1, 2, 9, 9, 1, 2], 3).tokens == [9, 9, 1]  # the recent one replaced it
    assert len(pool.propose([7, 8], 3)) == 0


def test_prompt_lookup_branches_on_distinct_matches() -> None:
    lookup = PromptLookup(max_ngram=2, min_ngram=1, branches=2)
    draft = lookup.propose([1, 2, 3, 1, 2, 4, 1, 2], 4)  # budget: 4 tree nodes in all
    assert draft.tokens == [4, 1, 2, 3]
    assert draft.parents == [-1, 0, 1, -1]
    assert len(lookup.propose([1, 2, 3], 4)) == 0


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
@pytest.mark.parametrize("mode", ["ngram", "prompt-lookup", "draft", "mix", "auto"])
async def test_greedy_speculation_is_token_identical(
    make_checkpoint: Callable[..., Path], family: str, mode: str
) -> None:
    directory = make_checkpoint(family)
    draft = full(make_checkpoint(family, layers=2, seed=99))
    trace: list[SpecStep] = []
    out = await run(full(directory), mode, PROMPT, 40, SamplingParams(), draft=draft, trace=trace)
    assert out == greedy_reference(directory, tuple(PROMPT), 40)
    assert any(s.draft_tokens > 0 for s in trace), "the drafter never drafted"
    if mode in ("ngram", "prompt-lookup", "mix"):
        assert sum(s.accepted for s in trace) > 0  # repetitive random-model output is easy to draft


async def test_a_steps_tokens_are_marked_as_coming_together(make_checkpoint: Callable[..., Path]) -> None:
    """Every token of a verified step but its last says another follows at once (``more``): what lets ``serve`` send
    a step as one chunk. The first token (the prefill's) stands alone; the marks follow the trace's steps."""
    directory = make_checkpoint("llama")
    drafters = {"ngram": NgramPool()}
    trace: list[SpecStep] = []
    gen = decode(
        LocalSequence(full(directory)), PROMPT, 40, SamplingParams(), torch.Generator(), drafters,
        FixedPolicy("ngram", 4), trace=trace,
    )  # fmt: skip
    out = [e async for e in gen]
    assert [e.token for e in out] == greedy_reference(directory, tuple(PROMPT), 40)
    steps = [1] + [s.emitted for s in trace]
    assert sum(steps) == 40
    assert max(steps) > 1
    assert [e.more for e in out] == [i < n - 1 for n in steps for i in range(n)]


async def test_tree_shapes_are_token_identical(make_checkpoint: Callable[..., Path]) -> None:
    """Prompt lookup with several branches and deep budgets: still exactly greedy."""
    directory = make_checkpoint("llama")
    model = full(directory)
    drafters = {"prompt-lookup": PromptLookup(max_ngram=2, min_ngram=1, branches=4)}
    controller = FixedPolicy("prompt-lookup", 16)
    trace: list[SpecStep] = []
    gen = speculative_decode(
        LocalSequence(model), PROMPT, 40, SamplingParams(), torch.Generator(), drafters, controller, trace=trace
    )
    assert [t async for t in gen] == greedy_reference(directory, tuple(PROMPT), 40)
    assert max(s.draft_tokens for s in trace) >= 8


@pytest.mark.parametrize("mode", ["draft", "prompt-lookup", "mix"])
async def test_speculative_sampling_keeps_the_model_law(make_checkpoint: Callable[..., Path], mode: str) -> None:
    """Joint law of the first two tokens (the second one comes out of a verified draft)."""
    directory = make_checkpoint("llama", vocab=16, logit_scale=5.0)
    model = full(directory)
    draft = full(make_checkpoint("llama", vocab=16, layers=2, seed=7, logit_scale=3.0))
    params = SamplingParams(temperature=0.9, top_p=0.95)
    prompt = [0, 13, 2, 8, 0, 0, 15, 12, 11, 15]  # chosen for power: see below
    with torch.no_grad():
        seq = LocalSequence(model)
        p1 = probabilities(seq.run(prompt)[-1], params.temperature, params.top_p)
        p2 = torch.stack(
            [
                probabilities(LocalSequence(model).run([*prompt, t])[-1], params.temperature, params.top_p)
                for t in range(16)
            ]
        )
    joint = p1[:, None] * p2  # (16, 16)
    # Power, measured with the bug put in (3,000 runs a mode): the classic bug of resampling a rejected
    # draft from p instead of norm(max(0, p - q)) shifts this law by a chi-square noncentrality of
    # ~157 (draft model), ~102 (prompt-lookup) and ~109 (mix) at n = 1000 over 30 degrees of freedom:
    # rejected at p < 1e-3 with probability 0.99997 or more in every mode. The prompt is chosen for it:
    # a deterministic draft x shifts the law by about p(x)(1 - p(x)) per sample, so the lookups here must
    # propose tokens p neither dismisses nor takes for granted (with 3,1,4,1,5,9,2,6,3,1 prompt-lookup
    # and mix caught the bug 7 % and 19 % of the time). False alarm: 1e-3 a case (the threshold).
    # Accepting every draft token puts mass outside the law's support and fails the support check.
    n = 1000
    counts: Counter[tuple[int, int]] = Counter()
    drafted = 0
    verifier = PromptOnceSequence(model, prompt)  # each run draws what it would on a fresh LocalSequence(model)
    for seed in range(n):
        trace: list[SpecStep] = []
        # 3 tokens leave room for a draft of 1 after the first; the law of the first two needs no step after theirs
        out = await run(
            model, mode, prompt, 3, params, seed=seed, draft=draft, trace=trace, budget=2, read=2, verifier=verifier
        )
        counts[(out[0], out[1])] += 1
        drafted += trace[0].draft_tokens > 0
    assert drafted > n // 2, "the second token must mostly come from a verified draft"
    cells = [(a, b) for a in range(16) for b in range(16) if joint[a, b] * n >= 5]
    observed = [counts[c] for c in cells]
    expected = [float(joint[c]) * n for c in cells]
    observed.append(n - sum(observed))
    expected.append(max(0.0, n - sum(expected)))
    expected = [e * n / sum(expected) for e in expected]
    assert all(joint[c] > 0 for c in counts), "sampled a token pair outside the law's support"
    assert chisquare(observed, expected).pvalue > 1e-3


def test_make_drafters_errors() -> None:
    with pytest.raises(ConfigError):
        make_drafters("bogus", SamplingParams(), None)
    with pytest.raises(ConfigError):
        make_drafters("draft", SamplingParams(), None)
    assert set(make_drafters("auto", SamplingParams(), None)) == {"ngram", "prompt-lookup", "mix"}
    assert make_drafters("off", SamplingParams(), None) == {}


def test_tree_width_one_drafts_chains(make_checkpoint: Callable[..., Path]) -> None:
    """--draft-tree-width: the draft model drafts trees by default, a single chain at width 1."""
    draft = full(make_checkpoint("llama", layers=2, seed=99))
    for width, chain_only in ((4, False), (1, True)):
        drafters = make_drafters("draft", SamplingParams(), draft, tree_width=width)
        tree = drafters["draft"].propose(PROMPT, 8)  # the draft model's trees are 8 deep at most
        assert len(tree) == 8
        assert (tree.parents == list(range(-1, 7))) is chain_only
    with pytest.raises(ConfigError, match="draft tree width must be at least 1"):
        EdgeConfig(model_dir=Path("unused"), cloud_url="ws://unused", draft_tree_width=0)


def test_draft_model_reuses_its_cache(make_checkpoint: Callable[..., Path]) -> None:
    drafter = DraftModel(full(make_checkpoint("llama", layers=2, seed=99)), SamplingParams(), top_k=1, depth=None)
    first = drafter.propose(PROMPT, 4)
    again = drafter.propose([*PROMPT, *first.tokens[:2]], 2)
    fresh = DraftModel(full(make_checkpoint("llama", layers=2, seed=99)), SamplingParams(), top_k=1, depth=None)
    assert again.tokens == fresh.propose([*PROMPT, *first.tokens[:2]], 2).tokens
    assert again.tokens == first.tokens[2:4]  # greedy drafting is consistent with itself


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[Sequence[int]]:
    """The tokens of every forward a draft model runs alone (``draft_forward.run_draft_forward``), from now on."""
    seen: list[Sequence[int]] = []
    run = draft_forward.run_draft_forward

    def counted(request: DraftForward) -> torch.Tensor:
        seen.append(request.ids.tolist())
        return run(request)

    monkeypatch.setattr(draft_forward, "run_draft_forward", counted)
    return seen


def test_a_greedy_draft_model_asked_again_for_the_same_context_runs_no_forward(
    make_checkpoint: Callable[..., Path], calls: list[Sequence[int]]
) -> None:
    """``auto`` asks the draft model alone and as a source of the mix for one context: the second ask, at the same
    budget or a smaller one, costs no forward and gets the tree a fresh model would grow."""
    checkpoint = make_checkpoint("llama", layers=2, seed=99)
    drafter = DraftModel(full(checkpoint), SamplingParams(), top_k=2, depth=4)
    fresh = DraftModel(full(checkpoint), SamplingParams(), top_k=2, depth=4)
    first = drafter.propose(PROMPT, 6)
    calls.clear()
    assert drafter.propose(list(PROMPT), 6) is first
    mixed = MixedDrafter([drafter]).propose(PROMPT, 6)  # as the mix's source: the same tree's branches
    assert sorted(leaf_chains(mixed)) == sorted(leaf_chains(first))
    smaller = drafter.propose(PROMPT, 3)  # pruned from the tree of 6
    assert calls == []
    expected = fresh.propose(PROMPT, 3)
    assert (smaller.tokens, smaller.parents) == (expected.tokens, expected.parents)
    calls.clear()
    larger = drafter.propose(PROMPT, 8)  # more than the kept tree: drafted
    assert calls
    assert (larger.tokens, larger.parents) == (fresh.propose(PROMPT, 8).tokens, fresh.propose(PROMPT, 8).parents)
    calls.clear()
    drafter.propose([*PROMPT, 1], 2)  # another context: drafted
    assert calls


def test_a_greedy_chain_drafter_drafts_a_smaller_budget_again(
    make_checkpoint: Callable[..., Path], calls: list[Sequence[int]]
) -> None:
    """Depth None (as deep as the budget): a smaller budget's chain is not the larger tree's best nodes in general,
    so it is drafted, and equals a fresh model's."""
    checkpoint = make_checkpoint("llama", layers=2, seed=99)
    drafter = DraftModel(full(checkpoint), SamplingParams(), top_k=2, depth=None)
    drafter.propose(PROMPT, 8)
    calls.clear()
    smaller = drafter.propose(PROMPT, 3)
    assert calls
    fresh = DraftModel(full(checkpoint), SamplingParams(), top_k=2, depth=None).propose(PROMPT, 3)
    assert (smaller.tokens, smaller.parents) == (fresh.tokens, fresh.parents)


def test_a_sampling_draft_model_draws_again_for_the_same_context(make_checkpoint: Callable[..., Path]) -> None:
    params = SamplingParams(temperature=1.0)
    drafter = DraftModel(full(make_checkpoint("llama", layers=2, seed=99)), params, torch.Generator().manual_seed(0))
    draws = {tuple(drafter.propose(PROMPT, 4).tokens) for _ in range(8)}
    assert len(draws) > 1  # fresh draws each time, never a kept tree


def test_greedy_draft_model_grows_a_dynamic_tree(make_checkpoint: Callable[..., Path]) -> None:
    """The draft model's greedy tree holds its greedy chain as the first branch, and branches beside it."""
    model = full(make_checkpoint("llama", layers=2, seed=99))
    tree = DraftModel(model, SamplingParams(), top_k=4, depth=6).propose(PROMPT, 12)
    chain = DraftModel(model, SamplingParams(), top_k=1, depth=None).propose(PROMPT, 12)
    assert len(tree) == 12
    assert all(p < i for i, p in enumerate(tree.parents))
    assert tree.parents.count(-1) >= 2 or len(set(tree.parents)) < len(tree.parents)  # a real tree
    first = leaf_chains(tree)[0]
    assert first == chain.tokens[: len(first)]  # root 0, its first child, ...: the argmax chain


class Fixed:
    """A deterministic drafter proposing fixed chains, counting its calls."""

    name = "fixed"

    def __init__(self, *chains: list[int]) -> None:
        self.chains = chains
        self.calls = 0

    def propose(self, context: Sequence[int], budget: int) -> Draft:
        self.calls += 1
        return build_tree(self.chains, budget)


def test_a_full_mixed_tree_asks_no_further_source() -> None:
    """Once the earlier sources fill the budget the later ones could not change the trie, so they are not asked
    (a draft model's forwards are saved); the tree is what merging them all gives."""
    first, second = Fixed([1, 2, 3], [1, 4]), Fixed([1, 2, 5], [6])
    full = MixedDrafter([first, second]).propose([0], 4)
    assert (first.calls, second.calls) == (1, 0)
    assert (full.tokens, full.parents) == ([1, 2, 3, 4], [-1, 0, 1, 0])
    merged = build_tree([[1, 2, 3], [1, 4], [1, 2, 5], [6]], 4)
    assert (full.tokens, full.parents) == (merged.tokens, merged.parents)
    wide = MixedDrafter([first, second]).propose([0], 6)  # room left: the second source is asked
    assert second.calls == 1
    assert (wide.tokens, wide.parents) == ([1, 2, 3, 4, 5, 6], [-1, 0, 1, 0, 1, -1])


def test_the_draft_model_drafts_within_its_own_positions(make_checkpoint: Callable[..., Path]) -> None:
    """A draft model trained to 24 positions drafts up to position 23; with no room for a tree past a window of
    its context, nothing for a longer context."""
    model = full(make_checkpoint("llama", layers=2, seed=99, max_positions=24))
    drafter = DraftModel(model, SamplingParams(), top_k=1, depth=None)
    context = (PROMPT * 2)[:20]
    assert drafter.window == 23  # room for one drafted token past its window
    assert len(drafter.propose(context, 8)) == 4  # positions 20 .. 23
    cramped = DraftModel(model, SamplingParams(), top_k=1, depth=23)
    assert cramped.window is None  # 24 positions leave no window with 23 levels of tree past it
    assert len(cramped.propose(context, 8)) == 4
    assert len(cramped.propose((PROMPT * 2)[:24], 8)) == 0
    cramped.prepare((PROMPT * 2)[:30])  # past its positions: nothing to prepare, nothing run
    assert cramped.sequence.tokens == context


def test_the_draft_model_reads_a_long_context_through_a_window(make_checkpoint: Callable[..., Path]) -> None:
    """Past its positions the draft model reads its context's latest tokens at positions from 0 (as it saw text in
    training): its draft equals a fresh draft model's on those tokens alone. The window moves by half its size, and
    a prompt's preparation feeds only the window the first proposal reads."""
    model = full(make_checkpoint("llama", layers=2, seed=99, max_positions=24))
    text = (PROMPT * 4)[:45]
    drafter = DraftModel(model, SamplingParams(), top_k=2, depth=4)
    assert drafter.window == 20  # 24 positions, 4 of them for the tree's levels
    for length in (18, 30, 31, 40, 41, 45):
        start = window_start(length, 20)  # 0, 20, 20, 30, 30, 30
        draft = drafter.propose(text[:length], 6)
        alone = DraftModel(model, SamplingParams(), top_k=2, depth=4).propose(text[start:length], 6)
        assert (draft.tokens, draft.parents) == (alone.tokens, alone.parents)
        assert (drafter.start, drafter.sequence.tokens) == (start, text[start:length])
        assert len(text[start:length]) + int(depths(torch.tensor(draft.parents)).max()) < 24  # its positions
    prepared = DraftModel(model, SamplingParams(), top_k=2, depth=4)
    assert list(prepared.prepare_pieces(text[:39], 4)) == [4, 8, 9]  # the window of 40 tokens starts at 30
    assert prepared.sequence.tokens == text[30:39]
    draft = prepared.propose(text[:40], 6)
    alone = DraftModel(model, SamplingParams(), top_k=2, depth=4).propose(text[30:40], 6)
    assert (draft.tokens, draft.parents) == (alone.tokens, alone.parents)


def lookup_by_scanning(
    context: list[int], budget: int, max_ngram: int, min_ngram: int, branches: int
) -> list[list[int]]:
    """Prompt lookup's chains as first written: every start position compared, latest first."""
    for n in range(max_ngram, min_ngram - 1, -1):
        if len(context) <= n:
            continue
        suffix, chains = context[-n:], []
        for start in range(len(context) - n - 1, -1, -1):
            if context[start : start + n] == suffix:
                cont = context[start + n : start + n + budget]
                if cont and cont not in chains:
                    chains.append(cont)
                    if len(chains) == branches:
                        break
        if chains:
            return chains
    return []


def test_prompt_lookup_finds_what_a_scan_of_every_position_finds() -> None:
    rng = random.Random(7)
    for trial in range(400):
        vocab = rng.choice([3, 6, 20, 200])  # few tokens: many matches; many: few or none
        context = [rng.randrange(vocab) for _ in range(rng.randrange(1, 120))]
        budget, branches = rng.randrange(1, 9), rng.randrange(1, 5)
        max_ngram = rng.randrange(1, 5)
        min_ngram = rng.randrange(1, max_ngram + 1)
        got = PromptLookup(max_ngram, min_ngram, branches).propose(context, budget)
        want = lookup_by_scanning(context, budget, max_ngram, min_ngram, branches)
        expected = build_tree(want, budget) if want else Draft.empty()
        assert (got.tokens, got.parents) == (expected.tokens, expected.parents), trial
