"""EAGLE drafting on the edge: a small head drafts from the target's own hidden states (Li et al. 2024).

The head (:class:`~splitspec.models.draft_head.DraftHead`) reads what the edge already holds: the
feature f_i of every committed token (the stream after the head's feature layers, kept by the
verifier in a :class:`~splitspec.models.features.FeatureLog`), the embedding and the model's own
final norm and LM head. Drafting costs no round trip and shows the cloud nothing.

Pair convention: the head's query at position i reads (embedding of x_{i+1}, f_i) and predicts the
feature of x_{i+1}; the LM head over that prediction scores x_{i+2}. With a context x_0 .. x_{n-1}
whose last token x_{n-1} is pending (chosen, not yet verified, so without a feature), the head's
cache holds the pairs i = 0 .. n - 2 of committed tokens, and the prediction of the last pair
scores the draft's roots. A draft node y with predicted parent feature ĥ is expanded by the pair
(y, ĥ) one position further: the head runs on its own predictions past the committed prefix.

The tree is EAGLE-2's dynamic tree (:func:`~splitspec.decoding.trees.dynamic_tree`): the most
probable frontier nodes are expanded level by level and the best ``budget`` nodes kept; under
sampling, children are draws from the head's q without replacement, which the verifier's
multi-draft rejection sampling keeps lossless. Each level runs the head over the nodes the builder
expands alone (:mod:`~splitspec.decoding.tree_run`: their inputs, the parents' predicted features,
are known from the level before), in one forward and one LM head per level.

The head attends to the latest committed pairs only (``window``, :data:`HEAD_WINDOW` by default), at their
true positions: the shipped head was trained on windows of 128 tokens, and after 2,000 tokens of third-party
code its teacher-forced first-depth accuracy was 0.346 with the last 512 pairs against 0.289 with all of them
(0.912 either way on prose), while catching up with that prompt fed 512 pairs (16 ms) instead of 2,000
(128 ms; ``benchmarks/head_window.py``). The window moves in steps of half its size, so the cache holds
between half a window and a window of pairs and is fed again once every half window of tokens.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from splitspec.decoding.sampling import SamplingParams
from splitspec.decoding.tree_run import TreeRun
from splitspec.decoding.trees import Draft, SiblingStats, dynamic_tree
from splitspec.exceptions import ConfigError
from splitspec.models.draft_head import DraftHead
from splitspec.models.features import FeatureLog
from splitspec.models.kv_cache import KVCache
from splitspec.models.masks import chain
from splitspec.models.stack import ModelEnds
from splitspec.models.warm_up import WARM_UP_CONTEXT, WARM_UP_WIDTHS
from splitspec.prefix import common_prefix, window_start

HEAD_WINDOW = 512  # committed pairs the head attends to, at most (see the module docstring)


def check_draft_head(head: DraftHead) -> None:
    """Refuse a head :class:`EagleDrafter` cannot draft with (ConfigError): one reading several feature layers
    (the tree feeds the head its own predicted features, H wide, past the committed prefix). A runtime that loads
    a head calls it at start-up, so that no request fails on it later."""
    if len(head.config.feature_layers) != 1:
        raise ConfigError("drafting with a head that reads several feature layers is not supported yet")


class KeepsFeatures(Protocol):
    """A verifier that keeps its committed tokens' features (an edge sequence, a local sequence)."""

    tokens: list[int]
    features: FeatureLog | None


class EagleDrafter:
    """Drafts a dynamic tree with a draft head over the verifier's features (see the module docstring)."""

    name = "eagle"
    # dear to ask (a head's forwards at each level of its tree): judged during a lone greedy step's round trip
    # first (decoding/aside.py), and gated under load (decoding/dear_gate.py), as a draft model is
    aside = True

    def __init__(
        self,
        head: DraftHead,
        ends: Callable[[], ModelEnds],
        source: KeepsFeatures | None,
        params: SamplingParams,
        generator: torch.Generator | None = None,
        top_k: int = 4,
        depth: int = 6,
        window: int | None = HEAD_WINDOW,
    ) -> None:
        if generator is None and not params.greedy:
            raise ValueError("a sampling draft head needs its own seeded generator")
        check_draft_head(head)
        if top_k < 1 or depth < 1:
            raise ValueError(f"top_k ({top_k}) and depth ({depth}) must be >= 1")
        if window is not None and window < 2:
            raise ValueError(f"the head's window must hold at least 2 pairs, got {window}")
        self.window = window  # committed pairs the head attends to, at most (None: all)
        self.top_k = top_k  # children per expanded node, and nodes expanded per level (EAGLE-2)
        self.depth = depth  # levels of the tree at most (EAGLE-2's default 6)
        self.siblings = SiblingStats()  # sampling: how often each sibling rank is accepted, measured
        self._last: tuple[list[int], Draft] | None = None  # the last sampled tree and its context
        self.head = head
        # the target's embedding, final norm and LM head (shared, never copied), read at each draft: an auto
        # edge may load its model again in the trunk's dtype at the first Welcome
        self._ends = ends
        self.source = source  # where the committed tokens' features are read; None: nothing to draft from
        self.params = params
        self.generator = generator
        self.cache = KVCache()  # the head's own keys and values, one entry per committed pair from self.start
        self.start = 0  # the position of the first pair in the cache (window_start)
        self._fed: list[int] = []  # x_{i+1} of every pair i in the cache

    @property
    def ends(self) -> ModelEnds:
        return self._ends()

    @property
    def max_depth(self) -> int:
        """Levels of its trees at most (:func:`~splitspec.decoding.drafters.max_depth`): ``depth``."""
        return self.depth

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.head.config.feature_layers

    def catch_up(self, context: Sequence[int]) -> None:
        """Feed the head the committed pairs of ``context`` (what the first proposal on it would), on the drafting
        thread while the verifier's next step is in flight: its features of those tokens are settled, and the
        step may commit more (the log only grows past them, or its last step's rows are kept)."""
        self._sync(context, in_flight=True)

    def _sync(self, context: Sequence[int], in_flight: bool = False) -> torch.Tensor | None:
        """Feed the pairs of committed tokens the cache lacks; the last pair's predicted feature (H,), or None
        when the verifier has no features for the context. ``in_flight``: the verifier may have committed more
        tokens since ``context`` (a catch-up); only the context's own must be there."""
        source = self.source
        committed = len(context) - 1  # the last context token is pending: no feature yet
        log = None if source is None else source.features
        if source is None or log is None or committed < 1:
            return None
        tokens, features = len(source.tokens), len(log)
        ready = tokens >= committed and features >= committed if in_flight else tokens == features == committed
        if not ready or source.tokens[committed - 1] != context[-2]:
            return None  # the verifier's features are not this context's (tokens committed before they were kept)
        start = window_start(committed, self.window)
        if start != self.start:  # the window moved: its pairs are fed again from its new start (common is 0)
            self._fed, self.start = [], start
        wanted = list(context[start + 1 :])  # x_{i+1} for pairs i = start .. committed - 1
        # always run the last pair again: its output is the root feature
        common = common_prefix(self._fed, wanted, len(wanted) - 1)  # pairs kept, from start
        self.cache.truncate(common)
        ids = torch.tensor(wanted[common:], dtype=torch.long)  # (m,)
        feats = log.rows(start + common, committed).to(self.ends.device)  # (m, F * H)
        positions = torch.arange(start + common, committed, dtype=torch.int32)
        parents = torch.tensor(chain(committed - start - common), dtype=torch.int32)
        with torch.inference_mode():
            out = self.head.forward(self.ends, ids, feats, positions, parents, self.cache)  # (m, H)
        self._fed = wanted
        return out[-1]

    def propose(self, context: Sequence[int], budget: int) -> Draft:
        if budget < 1:
            return Draft.empty()
        if self._last is not None:  # what the verifier made of the last sampled tree, if this context follows it
            before, last = self._last
            if len(context) > len(before) and list(context[: len(before)]) == before:
                self.siblings.observe(last, context[len(before) :])
            self._last = None
        # in flight: proposed aside, the verifier's step may commit more tokens meanwhile (their features are
        # appended past the context's own, which stay put)
        root = self._sync(context, in_flight=True)
        if root is None:
            return Draft.empty()
        committed = len(context) - 1
        ends = self.ends
        with torch.inference_mode():
            root_logits = self.head.logits(ends, root[None])  # (1, V)
        expand = _HeadExpander(self.head, ends, self.cache, TreeRun(committed, self.start), root, root_logits)
        try:
            draft = dynamic_tree(
                expand, budget, self.params, self.generator, self.top_k, self.depth, self.siblings.rates()
            )
        finally:
            # the tree's entries go: the next draft starts from the committed pairs
            self.cache.truncate(committed - self.start)
        self._last = (list(context), draft) if draft.probs is not None and len(draft) else None
        return draft


@dataclass
class _Committed:
    """A verifier's committed tokens and their features, made up (a warm-up's)."""

    tokens: list[int]
    features: FeatureLog | None


def warm_up_draft_head(head: DraftHead, ends: ModelEnds) -> float:
    """One greedy proposal at the largest budget after a short context of zero features, on a scratch cache (see
    :mod:`splitspec.models.warm_up`: a GPU's cold kernels would otherwise be taken for what the head costs).
    Returns the seconds it took."""
    t0 = time.perf_counter()
    log = FeatureLog(head.config.feature_layers)
    log.append(torch.zeros(WARM_UP_CONTEXT, head.config.feature_width, dtype=head.dtype, device=head.device))
    source = _Committed(list(range(WARM_UP_CONTEXT)), log)
    drafter = EagleDrafter(head, lambda: ends, source, SamplingParams())
    drafter.propose(list(range(WARM_UP_CONTEXT + 1)), WARM_UP_WIDTHS[-1] - 1)
    return time.perf_counter() - t0


class _HeadExpander:
    """The head's expander for one draft: each call runs only the nodes asked for that have not run.

    Node j's query reads (its token, its parent's predicted feature; the root's for a root) at position
    committed + depth(j), and sees the committed pairs, its ancestors and itself
    (:class:`~splitspec.decoding.tree_run.TreeRun`). The drafter truncates the head's cache back to
    the committed pairs.
    """

    def __init__(
        self,
        head: DraftHead,
        ends: ModelEnds,
        cache: KVCache,
        run: TreeRun,
        root: torch.Tensor,
        root_logits: torch.Tensor,
    ) -> None:
        self.head, self.ends, self.cache = head, ends, cache
        self.run = run  # the committed pairs the cache holds, and the nodes run
        self.root = root  # (H,): the last committed pair's predicted feature, the roots' parent
        self.root_logits = root_logits  # (1, V): scores the roots
        self.predicted: dict[int, torch.Tensor] = {}  # ĥ (H,) of every node run
        self.logits: dict[int, torch.Tensor] = {}  # (V,) scoring the children of every node run

    @torch.inference_mode()
    def __call__(self, tokens: list[int], parents: list[int], expanding: list[int]) -> torch.Tensor:
        for wave in self.run.waves(parents, expanding):  # one per level: a node's input is its parent's prediction
            inputs = torch.stack([self.root if parents[j] < 0 else self.predicted[parents[j]] for j in wave.nodes])
            ids = torch.tensor([tokens[j] for j in wave.nodes], dtype=torch.long)
            out = self.head.forward_visible(
                self.ends, ids, inputs, wave.positions, wave.visible, wave.key_positions, self.cache, predicted=True
            )  # (q, H): every input is a prediction of the head's (the root's or a parent's)
            for j, predicted, row in zip(wave.nodes, out, self.head.logits(self.ends, out), strict=True):
                self.predicted[j], self.logits[j] = predicted, row
        return torch.stack([self.root_logits[0] if j < 0 else self.logits[j] for j in expanding])  # (len(expanding), V)
