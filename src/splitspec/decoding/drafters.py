"""Drafters: cheap guesses of the next tokens, all computed on the edge (nothing private leaves it).

Every drafter answers ``propose(context, budget)`` with a :class:`Draft`: up to ``budget`` tokens
arranged as a tree whose roots continue ``context`` (parent -1). Deterministic drafters (n-gram
pool, prompt lookup) give no probabilities: their q is one-hot. The draft model gives q.

* :class:`NgramPool` keeps, for every key of ``key_len`` tokens seen in the prompt or the output,
  the most recent continuations (recent ones replace old ones: the reference implementation kept
  its oldest n-grams forever).
* :class:`PromptLookup` copies the continuation of the latest earlier match of the context's last
  n tokens (n from ``max_ngram`` down to ``min_ngram``), like transformers' prompt lookup, but can
  offer several matches as branches.
* :class:`DraftModel` runs a small local model with its own KV cache and grows its tree with the
  one tree builder (:func:`splitspec.decoding.trees.dynamic_tree`: EAGLE-2 dynamic trees, greedy
  or sampled).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Protocol, runtime_checkable

import torch

from splitspec.decoding.local import LocalSequence
from splitspec.decoding.lockstep import Steps, finish
from splitspec.decoding.sampling import SamplingParams
from splitspec.decoding.tree_run import TreeRun
from splitspec.decoding.trees import Draft as Draft
from splitspec.decoding.trees import SiblingStats, StepExpander, dynamic_tree_steps, prune_greedy
from splitspec.models.draft_forward import DraftForward
from splitspec.models.masks import chain
from splitspec.models.stack import FullModel
from splitspec.models.warm_up import WARM_UP_CONTEXT, WARM_UP_WIDTHS
from splitspec.prefix import common_prefix, window_start

PREPARE_CHUNK = 512  # prompt tokens a draft model's prepare feeds at once: bounds its attention masks


def build_tree(chains: Sequence[Sequence[int]], budget: int) -> Draft:
    """Merge candidate continuations into a trie of at most ``budget`` nodes (shared prefixes once)."""
    tokens: list[int] = []
    parents: list[int] = []
    children: dict[tuple[int, int], int] = {}  # (parent index, token) -> node index
    for candidate in chains:
        parent = -1
        for token in candidate:
            node = children.get((parent, token))
            if node is None:
                if len(tokens) >= budget:
                    break
                node = len(tokens)
                tokens.append(token)
                parents.append(parent)
                children[(parent, token)] = node
            parent = node
    return Draft(tokens, parents)


class Drafter(Protocol):
    name: str

    def propose(self, context: Sequence[int], budget: int) -> Draft: ...


def is_cheap(drafter: Drafter) -> bool:
    """Whether ``drafter`` declares itself cheap and deterministic (``shadow = True``: a lookup of microseconds):
    it proposes inline, and is scored against greedy steps it was not chosen for (decoding/shadow.py)."""
    return bool(getattr(drafter, "shadow", False))


def max_depth(drafter: Drafter) -> int | None:
    """The most levels ``drafter``'s drafts reach whatever the budget, as it declares (``max_depth``: a draft model's
    or a draft head's tree depth, an n-gram pool's span); None: as many as the budget's tokens. The speculation
    controller expects nothing accepted past it (decoding/controller.py)."""
    depth = getattr(drafter, "max_depth", None)
    return depth if isinstance(depth, int) and depth >= 1 else None


def is_dear(drafter: Drafter) -> bool:
    """Whether ``drafter`` declares itself dear to ask (``aside = True``: a draft model's forwards), to be judged
    during a lone greedy step's round trip first (decoding/aside.py)."""
    return bool(getattr(drafter, "aside", False))


@runtime_checkable
class Stepwise(Protocol):
    """A drafter whose proposal can run as steps (:mod:`splitspec.decoding.lockstep`): ``propose_steps`` yields
    each of its model's forwards and is sent their logits, so that the engine runs several sequences'
    proposals in lockstep, their forwards batched. ``propose`` is the same proposal with each forward run alone."""

    name: str

    def propose(self, context: Sequence[int], budget: int) -> Draft: ...

    def propose_steps(self, context: Sequence[int], budget: int) -> Steps[Draft]: ...


@runtime_checkable
class Preparable(Protocol):
    """A drafter with state to bring up to a context before its first proposal (a draft model's cache).

    ``prepare(context)`` does now what the first ``propose`` on ``context`` and its continuations
    would otherwise do; it changes no proposal. The decode loop calls it while the prefill's round
    trip is in flight (:mod:`splitspec.decoding.warmup`).
    """

    def prepare(self, context: Sequence[int]) -> None: ...


@runtime_checkable
class PreparesInPieces(Protocol):
    """A :class:`Preparable` drafter that prepares in pieces of its own choosing (a windowed draft model prepares
    only the prompt's last window): ``prepare_pieces(context, tokens)`` does what ``prepare(context)`` does, a
    forward of at most ``tokens`` tokens at a time, yielding the tokens prepared after each."""

    def prepare(self, context: Sequence[int]) -> None: ...

    def prepare_pieces(self, context: Sequence[int], tokens: int) -> Iterator[int]: ...


def prepare_pieces(drafter: Preparable, context: Sequence[int], tokens: int) -> Iterator[int]:
    """``drafter``'s preparation for ``context`` in pieces of about ``tokens`` prompt tokens, yielding after each:
    its own (:class:`PreparesInPieces`), or ``prepare`` on growing prefixes of ``context``."""
    if isinstance(drafter, PreparesInPieces):
        yield from drafter.prepare_pieces(context, tokens)
        return
    for end in range(tokens, len(context) + tokens, tokens):
        drafter.prepare(context[:end])
        yield min(end, len(context))


@runtime_checkable
class CatchesUp(Protocol):
    """A drafter that reads the verifier's features of committed tokens (an EAGLE head), so that it can catch up
    with a prompt only once the prefill's features are in.

    ``catch_up(context)`` feeds it what its first ``propose`` on ``context`` would (the prompt's pairs), reading
    the verifier's features while the verifier's next step may already be in flight; it changes no proposal. The
    decode loop calls it after the prefill, during the first decode steps' round trips
    (:mod:`splitspec.decoding.warmup`).
    """

    def catch_up(self, context: Sequence[int]) -> None: ...


class NgramPool:
    """Recent n-grams of the prompt and output, indexed by their first ``key_len`` tokens."""

    name = "ngram"
    shadow = True  # cheap and deterministic: scored against greedy steps it was not chosen for (decoding/shadow.py)

    def __init__(self, key_len: int = 2, span: int = 8, per_key: int = 4) -> None:
        self.key_len = key_len  # tokens of context that select continuations
        self.span = span  # longest continuation stored, tokens
        self.per_key = per_key  # continuations kept per key (most recent win)
        self._pool: dict[tuple[int, ...], OrderedDict[tuple[int, ...], None]] = {}
        self._seen: list[int] = []  # the context indexed so far

    def _index(self, context: Sequence[int]) -> None:
        common = common_prefix(self._seen, context)
        if common < len(self._seen):  # the context diverged (new prompt): start over
            self._pool.clear()
            self._seen = []
            common = 0
        self._seen = list(context)
        # (re)index every n-gram whose continuation may have grown since last time
        first = max(0, common - self.span - self.key_len)
        for start in range(first, len(context) - self.key_len):
            key = tuple(context[start : start + self.key_len])
            cont = tuple(context[start + self.key_len : start + self.key_len + self.span])
            if not cont:
                continue
            bucket = self._pool.setdefault(key, OrderedDict())
            for shorter in [c for c in bucket if cont[: len(c)] == c and len(c) < len(cont)]:
                del bucket[shorter]  # a longer observation of the same continuation
            bucket[cont] = None
            bucket.move_to_end(cont)
            while len(bucket) > self.per_key:
                bucket.popitem(last=False)  # evict the oldest

    @property
    def max_depth(self) -> int:
        """Levels of its drafts at most (:func:`max_depth`): a continuation is at most ``span`` tokens."""
        return self.span

    def prepare(self, context: Sequence[int]) -> None:
        """Index ``context`` now (a long prompt's n-grams), so the first proposal indexes only what follows."""
        self._index(context)

    def propose(self, context: Sequence[int], budget: int) -> Draft:
        self._index(context)
        if len(context) < self.key_len or budget < 1:
            return Draft.empty()
        bucket = self._pool.get(tuple(context[-self.key_len :]))
        if not bucket:
            return Draft.empty()
        recent_first = list(reversed(bucket))
        return build_tree(recent_first, budget)


class PromptLookup:
    """Copy what followed the latest earlier occurrences of the context's last n tokens."""

    name = "prompt-lookup"
    shadow = True  # cheap and deterministic: scored against greedy steps it was not chosen for (decoding/shadow.py)

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, branches: int = 2) -> None:
        self.max_ngram = max_ngram  # longest suffix matched, tokens
        self.min_ngram = min_ngram  # shortest suffix matched, tokens
        self.branches = branches  # distinct matches offered as branches

    def propose(self, context: Sequence[int], budget: int) -> Draft:
        ctx = list(context)
        size = len(ctx)
        backwards = ctx[::-1]  # the context's tokens from the end: list.index finds the latest occurrences in C
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if size <= n:
                continue
            suffix = ctx[-n:]
            chains: list[list[int]] = []
            # latest match first: a match ends where suffix[-1] occurs, backwards index i <-> position size - 1 - i
            # (i = 0 is the suffix itself); only the occurrences of that token are compared, not every position
            i = 0
            while len(chains) < self.branches:
                try:
                    i = backwards.index(suffix[-1], i + 1)
                except ValueError:
                    break
                end = size - i  # one past the match
                if end < n:
                    break  # a match would start before the context
                if ctx[end - n : end] == suffix:
                    cont = ctx[end : end + budget]
                    if cont not in chains:
                        chains.append(cont)
            if chains:
                return build_tree(chains, budget)
        return Draft.empty()


class DraftModel:
    """A small local model drafting with its own KV cache: a dynamic tree (EAGLE-2) of its guesses.

    Greedy: the ``top_k`` likeliest children of the ``top_k`` best frontier nodes at each depth,
    then the best ``budget`` nodes by the draft model's path probability. Sampling: children drawn
    from q without replacement, q recorded for lossless multi-draft verification. ``top_k`` 1 is a
    single chain; ``depth`` None lets the tree be as deep as the budget.

    It drafts within its own position limit (its config's ``max_position_embeddings``, less room for its tree's
    ``depth``): past it, a model's guesses are noise (vLLM disables a draft model past its ``max_model_len``), so
    a longer context is read through a window of its latest tokens at positions from 0, as the model saw text in
    training (:attr:`window`). The window moves in steps of half its size
    (:func:`~splitspec.prefix.window_start`): its cache is fed again from the new start once every half window.
    The demo draft model was trained on 256-token windows and declares 256 positions. Teacher-forced on held-out
    code, its next token agreed with the base model's at 0.47 of positions 248-1,024 through the window against
    0.29 reading the whole context, and 0.40 against 0.30 at 1,024-2,000 (prose: 0.51 against 0.30, 0.47 against
    0.26; ``benchmarks/draft_window.py``). What a window cannot do is copy from further back: after 2,000 tokens of
    code, whose greedy continuation repeats what came far earlier, reading every token drafted better on some files.
    """

    name = "draft"
    aside = True  # dear to ask: judged during a lone greedy step's round trip first (decoding/aside.py)

    def __init__(
        self,
        model: FullModel,
        params: SamplingParams,
        generator: torch.Generator | None = None,
        top_k: int = 4,
        depth: int | None = 8,
    ) -> None:
        self.sequence = LocalSequence(model)
        self.params = params
        if generator is None and not params.greedy:
            raise ValueError("a sampling draft model needs its own seeded generator")
        if top_k < 1 or (depth is not None and depth < 1):
            raise ValueError(f"top_k ({top_k}) and depth ({depth}) must be >= 1")
        self.generator = generator or torch.Generator()
        self.top_k = top_k  # children per expanded node, and nodes expanded per depth
        self.depth = depth  # levels of the tree at most; None: the budget
        self.siblings = SiblingStats()  # sampling: how often each sibling rank is accepted, measured
        self._last: tuple[list[int], Draft] | None = None  # the last sampled draft and its context
        self.prepare_chunk = PREPARE_CHUNK  # prompt tokens prepare feeds at once
        limit = getattr(model.config, "max_position_embeddings", None)
        self.max_positions = int(limit) if isinstance(limit, int) else None  # the positions it drafts within
        room = None if self.max_positions is None else self.max_positions - (1 if depth is None else depth)
        # context tokens it reads at most, its tree's levels past them within its positions (None: all of them)
        self.window = room if room is not None and room >= 2 else None
        self.start = 0  # the context index of its cache's first token (window_start)
        # greedy: the last tree, its context and budget. ``auto`` asks the draft model twice for one context (alone,
        # and as a source of the mixed tree; both judged during the same round trip): at the same budget or a smaller
        # one the second gets this tree (pruned: trees.prune_greedy)
        self._greedy_memo: tuple[tuple[int, ...], int, Draft] | None = None

    @property
    def max_depth(self) -> int | None:
        """Levels of its trees at most (:func:`max_depth`): ``depth`` (None: the budget's)."""
        return self.depth

    def _windowed(self, context: Sequence[int], start: int) -> Sequence[int]:
        """The tokens of ``context`` from ``start`` on (:func:`~splitspec.prefix.window_start`), the cache emptied
        when its start moves: its entries were computed from the tokens before."""
        if start != self.start:
            self.sequence.reset()
            self.start = start
        return context[start:]

    def _sync(self, context: Sequence[int]) -> Steps[torch.Tensor]:
        """Bring the cache to ``context``'s window (reusing the common prefix); return the next-token logits (V,)."""
        seq = self.sequence
        window = self._windowed(context, window_start(len(context), self.window))
        common = common_prefix(seq.tokens, window, len(window) - 1)  # always re-run the last context token
        seq.truncate(common)
        new = list(window[common:])
        logits = yield seq.step(new, logits_from=len(new) - 1)  # the LM head for the last only
        seq.tokens.extend(new)
        return logits[-1]

    def prepare(self, context: Sequence[int]) -> None:
        """Bring the cache to all of ``context``'s window (the prompt's), without computing logits: the first
        :meth:`propose` on ``context`` plus the first token then runs that token alone."""
        for _ in self.prepare_pieces(context, self.prepare_chunk):
            pass

    def prepare_pieces(self, context: Sequence[int], tokens: int) -> Iterator[int]:
        """:meth:`prepare`, a forward of at most ``tokens`` tokens at a time; yields the window's tokens in the cache
        after each. Only the window the first proposal reads (the prompt and its first token) is prepared."""
        seq = self.sequence
        window = self._windowed(context, window_start(len(context) + 1, self.window))
        if self.max_positions is not None and len(window) >= self.max_positions:
            return  # it will not draft for this context: nothing to prepare
        common = common_prefix(seq.tokens, window)
        seq.truncate(common)
        model = seq.model
        step = max(1, min(tokens, self.prepare_chunk))
        for start in range(common, len(window), step):
            part = list(window[start : start + step])
            positions = torch.arange(start, start + len(part), dtype=torch.int32)
            parents = torch.tensor(chain(len(part)), dtype=torch.int32)
            ids = torch.tensor(part, dtype=torch.long)[None]  # (1, q)
            with torch.inference_mode():  # (1, q, H) discarded: the cache is the point
                model.layers(model.embed(ids), positions, parents, seq.cache)
            seq.tokens.extend(part)
            yield len(seq.tokens)

    def _expander(self, context_len: int, root: torch.Tensor) -> StepExpander:
        """Scores a tree by running, after the context, only the nodes asked for that have not run
        (:class:`~splitspec.decoding.tree_run.TreeRun`), one forward per wave."""
        run = TreeRun(context_len)
        model, cache = self.sequence.model, self.sequence.cache
        rows: dict[int, torch.Tensor] = {-1: root.float()}  # (V,) scoring the children of each node run

        def expand(tokens: list[int], parents: list[int], expanding: list[int]) -> Steps[torch.Tensor]:
            for wave in run.waves(parents, expanding):
                ids = torch.tensor([tokens[j] for j in wave.nodes], dtype=torch.long)
                logits = yield DraftForward(
                    model, cache, ids, wave.positions, visible=wave.visible, key_positions=wave.key_positions
                )  # (q, V)
                rows.update(zip(wave.nodes, logits.float(), strict=True))
            return torch.stack([rows[j] for j in expanding])  # (len(expanding), V)

        return expand

    def propose(self, context: Sequence[int], budget: int) -> Draft:
        return finish(self.propose_steps(context, budget))

    def propose_steps(self, context: Sequence[int], budget: int) -> Steps[Draft]:
        """:meth:`propose` as steps: each of the draft model's forwards is yielded (a :class:`DraftForward`)."""
        read = len(context) - window_start(len(context), self.window)  # the context tokens it reads: its window
        if self.max_positions is not None:  # drafts sit at positions read .. read + depth - 1
            budget = min(budget, self.max_positions - read)
        if budget < 1 or not context:
            return Draft.empty()
        key = tuple(context) if self.params.greedy else None  # the context a greedy tree is kept for
        memo = self._greedy_memo
        if memo is not None and memo[0] == key:
            # a greedy tree depends on the context and the budget alone; at a fixed depth, one of a smaller budget is
            # the larger one's best nodes
            if memo[1] == budget:
                return memo[2]
            if self.depth is not None and budget < memo[1] and memo[2].scores is not None:
                return prune_greedy(memo[2], budget)  # the larger tree is kept: it serves any smaller budget
        if self._last is not None:  # what the verifier made of the last tree, if this context follows it
            before, last = self._last
            if len(context) > len(before) and list(context[: len(before)]) == before:
                self.siblings.observe(last, context[len(before) :])
        root = yield from self._sync(context)  # (V,); a failed forward is rolled back, its tokens not kept
        depth = budget if self.depth is None else self.depth
        expand = self._expander(read, root)
        rates = self.siblings.rates()
        try:
            draft = yield from dynamic_tree_steps(expand, budget, self.params, self.generator, self.top_k, depth, rates)
        finally:
            self.sequence.truncate(read)  # the tree's entries go: the next draft runs what was accepted
        self._last = (list(context), draft) if draft.probs is not None and len(draft) else None
        self._greedy_memo = None if key is None else (key, budget, draft)
        return draft


def warm_up_draft_model(model: FullModel) -> float:
    """One greedy proposal at the largest budget after a short context, on a scratch cache; returns the seconds.

    A draft model's first proposal on a GPU pays its kernels' cold start (821 ms on an H200, 5-8 ms once warm),
    which the speculation controller would take for what the drafter costs (see :mod:`splitspec.models.warm_up`).
    """
    t0 = time.perf_counter()
    DraftModel(model, SamplingParams()).propose(list(range(WARM_UP_CONTEXT)), WARM_UP_WIDTHS[-1] - 1)
    return time.perf_counter() - t0


def leaf_chains(draft: Draft) -> list[list[int]]:
    """Every root-to-leaf token chain of a draft tree, in node order."""
    has_child = {p for p in draft.parents if p >= 0}
    chains = []
    for node in range(len(draft)):
        if node in has_child:
            continue
        chain = []
        while node >= 0:
            chain.append(draft.tokens[node])
            node = draft.parents[node]
        chains.append(chain[::-1])
    return chains


class MixedDrafter:
    """One tree from several deterministic drafters: their candidates merged, by priority, into a trie.

    Deterministic candidates keep speculative sampling exact (q one-hot for each branch), so the
    mix serves greedy and sampled decoding alike.
    """

    name = "mix"

    def __init__(self, sources: Sequence[Drafter]) -> None:
        self.sources = list(sources)
        # dear to ask when a source is (a draft model): judged during a lone greedy step's round trip first
        # (decoding/aside.py)
        self.aside = any(is_dear(source) for source in self.sources)
        # a mix of lookups only is a lookup too: it proposes inline, not behind other sequences' drafts on the
        # drafting thread, and is scored against greedy steps it was not chosen for
        self.shadow = all(is_cheap(source) for source in self.sources)

    @property
    def max_depth(self) -> int | None:
        """Levels of its tree at most (:func:`max_depth`): its deepest source's (None when a source has no limit)."""
        depths = [max_depth(source) for source in self.sources]
        return None if None in depths else max((d for d in depths if d is not None), default=None)

    def prepare(self, context: Sequence[int]) -> None:
        for source in self.sources:
            if isinstance(source, Preparable):
                source.prepare(context)

    def prepare_pieces(self, context: Sequence[int], tokens: int) -> Iterator[int]:
        for source in self.sources:
            if isinstance(source, Preparable):
                yield from prepare_pieces(source, context, tokens)

    def propose(self, context: Sequence[int], budget: int) -> Draft:
        return finish(self.propose_steps(context, budget))

    def propose_steps(self, context: Sequence[int], budget: int) -> Steps[Draft]:
        """:meth:`propose` as steps: a stepwise source's forwards are yielded (:class:`Stepwise`)."""
        chains: list[list[int]] = []
        tree = Draft.empty()
        for source in self.sources:
            if isinstance(source, Stepwise):
                draft = yield from source.propose_steps(context, budget)
            else:
                draft = source.propose(context, budget)
            if draft.probs is not None:
                raise ValueError(f"drafter {source.name!r} is not deterministic; it cannot join a mixed tree")
            chains.extend(leaf_chains(draft))
            tree = build_tree(chains, budget)
            if len(tree) >= budget:
                # full: a later source's chains would only walk nodes the trie has, so they cannot change it
                # (and a draft model's forwards are not paid for nothing)
                break
        return tree
