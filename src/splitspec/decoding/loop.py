"""The one decode loop: prefill, then steps of (draft, verify, emit) over any tree verifier.

``decode`` serves sequential decoding (no drafters: every step is the pending token alone) and
speculative decoding alike. One step: the pending token t (chosen but not yet in the caches) and a
draft tree continuing it go to the verifier together: q = 1 + len(draft) query tokens, t first,
every draft root a child of t. Row 0 of the logits scores the roots, row i + 1 the children of
node i. The acceptance rule picks a path through the tree and the next token; the caches keep t
and that path (the cloud learns it on the next step, at no extra round trip), and the next token
becomes the new pending one. With an empty draft the step is a plain sequential step, so sampled
output with no drafters draws exactly what one-token sampling draws. Drafters with state to build
(a draft model's cache) are prepared for the prompt on the draft executor while the prefill is in
flight (:mod:`splitspec.decoding.warmup`). After a greedy step, drafters not asked are scored
against its tokens (:mod:`splitspec.decoding.shadow`); a lone sequence does that on the drafting
thread during the step's round trip, and judges a draft model there before asking it on a step
(:mod:`splitspec.decoding.aside`).

Each emitted token comes out as an :class:`Emitted`: the token, and when asked its logprob and
the top alternatives, taken from the model's own distribution at that position (log-softmax of
the raw logits, before logits processors and before temperature, top-k and top-p, as vLLM
reports them). Under speculation a token's row is the one its verification read, so logprobs are
those of one-token decoding. A :class:`PromptLogprobs` passed as ``prompt_logprobs`` is filled
with the prompt's own logprobs (row i of the prefill scores prompt token i + 1), in chunks of
rows so the extra memory stays bounded, on a worker thread (off the event loop), before the first
token is yielded.

Logits processors (:class:`~splitspec.decoding.processors.LogitsProcessor`: a grammar, say) see
every row before a token is chosen from it, in verification as in the prefill, each row along its own path
(a draft tree goes to them one root-to-leaf chain at a time). A draft loses every node whose path a processor
forbids before it is sent (no round trip is spent on it). Output under processors is then what
one-token constrained decoding gives: identical tokens when greedy; when sampling, the drafts are
deterministic (q one-hot: n-grams, prompt lookup, the draft model's greedy tree), so the
acceptance rule stays exact. A sampled draft (one that carries q) under processors while the target
samples is refused with a ``ValueError``: cutting it where a processor forbids a token would not
be lossless.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Collection, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Protocol, runtime_checkable

import torch

from splitspec.decoding.acceptance import greedy_verify_tree, sample_verify_tree
from splitspec.decoding.aside import (
    AsidePlan,
    AsideProposal,
    DraftExecutor,
    plan_aside,
    score_aside,
    score_aside_when_done,
    start_aside,
    timed_propose,
)
from splitspec.decoding.controller import BlindPolicy, Choice, SpeculationPolicy
from splitspec.decoding.drafters import Draft, Drafter, is_cheap, is_dear, max_depth
from splitspec.decoding.processors import LogitsProcessor
from splitspec.decoding.sampling import SamplingParams, choose_token
from splitspec.decoding.shadow import score_shadows
from splitspec.decoding.trees import draft_depth
from splitspec.decoding.warmup import abandon_prepare, catching_up, finish_prepare, start_catch_up, start_prepare
from splitspec.models.masks import chain

MAX_TOP_LOGPROBS = 20  # most alternatives a token may carry (OpenAI's limit)
PROMPT_ROWS_PER_CHUNK = 256  # prefill rows turned into logprobs at once: bounds the (rows, V) float32 copies
SAMPLED_DRAFT_UNDER_PROCESSORS = (
    "drafter {!r} drafted by sampling (its draft carries q) while logits processors constrain a sampled decode: "
    "cutting such a draft at a forbidden token would bias the output; give the drafters greedy SamplingParams()"
)


class TreeVerifier(Protocol):
    async def forward(
        self,
        tokens: Sequence[int],
        parents: Sequence[int] | None = None,
        logits_from: int = 0,
        *,
        sent: Callable[[], None] | None = None,
    ) -> torch.Tensor:
        """logits of ``tokens`` (a chain unless ``parents`` says otherwise), rows ``logits_from`` onwards.
        ``sent`` is called once, as soon as the step's own work on this side is done and its reply is what
        is awaited (a split edge: the head forward ran and the step goes on the wire; a local model: at once)."""
        ...

    def keep(self, indices: Sequence[int]) -> None: ...

    def reset(self) -> None: ...


@runtime_checkable
class StepCapped(Protocol):
    """A verifier whose steps carry a limited number of query tokens (a split edge: the trunk's ``max_query_tokens``
    and the frame size). A chain past it goes in several steps, but a draft tree cannot be split: :func:`decode`
    drafts at most ``max_step_tokens() - 1`` tokens (the pending token is the step's first) for such a verifier."""

    def max_step_tokens(self) -> int | None:
        """Most query tokens one step may carry now; None: no limit."""
        ...


def draft_room(verifier: TreeVerifier, tokens_left: int) -> int:
    """Most tokens a step may draft: one fewer than ``tokens_left`` (the step's own token comes on top) and than
    the verifier's step limit (:class:`StepCapped`), if it states one."""
    cap = verifier.max_step_tokens() if isinstance(verifier, StepCapped) else None
    return tokens_left - 1 if cap is None else min(tokens_left, cap) - 1


@dataclass(frozen=True)
class Emitted:
    """One generated token, with its logprob and alternatives when they were asked for."""

    token: int
    logprob: float | None = None  # log-softmax of the model's raw logits at this position; None unless asked
    top: tuple[tuple[int, float], ...] = ()  # the most likely tokens there and their logprobs, best first
    more: bool = False  # another token of the same step follows at once (a consumer may send them together)
    rank: int | None = None  # 1 + how many tokens were likelier there (a prompt token's; None unless asked)


@dataclass
class PromptLogprobs:
    """Asks :func:`decode` for the prompt's logprobs; it fills ``entries`` after the prefill.

    ``entries[i]`` is prompt token i + 1 with its logprob under the prefill's row i, its rank there and ``top``
    alternatives (nothing predicts the first prompt token, so it has no entry).
    """

    top: int = 0
    entries: list[Emitted] = field(default_factory=list)


def prompt_token_logprobs(
    logits: torch.Tensor, prompt_ids: Sequence[int], top: int, rows_per_chunk: int = PROMPT_ROWS_PER_CHUNK
) -> list[Emitted]:
    """The prefill's logits (P, V) -> prompt tokens 1..P-1, each scored by the row before it."""
    out: list[Emitted] = []
    for start in range(0, len(prompt_ids) - 1, rows_per_chunk):
        stop = min(start + rows_per_chunk, len(prompt_ids) - 1)
        out += token_logprobs(logits[start:stop], prompt_ids[start + 1 : stop + 1], top, ranks=True)  # (chunk, V)
    return out


@dataclass(frozen=True)
class SpecStep:
    """What one step of the loop did."""

    drafter: str | None  # None: sequential step
    draft_tokens: int  # tokens drafted (tree nodes)
    accepted: int  # drafted tokens accepted
    emitted: int  # tokens this step added to the output (accepted + 1, less any cut at the end)
    step_s: float  # verifier forward, seconds
    draft_s: float  # drafting, seconds


class SequentialPolicy(BlindPolicy):
    """No drafting: every step is the pending token alone."""

    def ranked(self, context_tokens: int = 0, waits: Mapping[str, float] | None = None) -> list[Choice]:
        return [Choice(None, 0, 0.0)]


def paths(parents: Sequence[int]) -> list[list[int]]:
    """Each node's path from its root, node indices parents first (a node's parent precedes it)."""
    out: list[list[int]] = []
    for i, parent in enumerate(parents):
        out.append([*out[parent], i] if parent >= 0 else [i])
    return out


def prune_draft(draft: Draft, processors: Sequence[LogitsProcessor]) -> Draft:
    """The draft less every node whose path from its root a processor forbids, or whose path a token completes a
    processor (a grammar) before its end: that token then comes from its own row, as one-token decoding makes it,
    and no row is verified past the end, where only a stop token may follow (and ``min_tokens`` may forbid that
    one too). A kept node's ancestors are kept, so the draft stays a tree."""
    kept: list[int] = []
    for path in paths(draft.parents):
        tokens = [draft.tokens[i] for i in path]
        allowed = min((p.validate_draft(tokens) for p in processors), default=len(tokens))
        if _before_completion(tokens[:allowed], processors) == len(tokens):
            kept.append(path[-1])
    if len(kept) == len(draft):
        return draft
    index = {node: k for k, node in enumerate(kept)}
    parents = [index[draft.parents[i]] if draft.parents[i] >= 0 else -1 for i in kept]
    probs = None if draft.probs is None else draft.probs[kept]
    return Draft([draft.tokens[i] for i in kept], parents, probs)


def _before_completion(tokens: Sequence[int], processors: Sequence[LogitsProcessor]) -> int:
    """How many leading ``tokens`` leave every processor unfinished (each accepted in turn, then rolled back)."""
    accepted = 0
    try:
        for token in tokens:
            for processor in processors:
                processor.accept([token])
            accepted += 1
            if any(p.finished for p in processors):
                return accepted - 1
    finally:
        for processor in processors:
            processor.rollback(accepted)
    return len(tokens)


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int], top: int, ranks: bool = False) -> list[Emitted]:
    """logits (n, V), row i scoring ``tokens[i]`` -> each token with its logprob, ``top`` alternatives and, with
    ``ranks``, its rank in its row (vLLM's: 1 + the tokens strictly likelier)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # (n, V)
    chosen_t = logprobs.gather(1, torch.tensor(list(tokens), device=logits.device)[:, None])  # (n, 1)
    chosen = chosen_t[:, 0].tolist()
    rank: list[int | None] = [None] * len(chosen)
    if ranks:
        rank = [int(r) + 1 for r in (logprobs > chosen_t).sum(dim=-1).tolist()]  # (n,)
    if top <= 0:
        return [Emitted(t, lp, rank=r) for t, lp, r in zip(tokens, chosen, rank, strict=True)]
    values, ids = logprobs.topk(top, dim=-1)  # (n, top)
    return [
        Emitted(t, lp, tuple(zip(i, v, strict=True)), rank=r)
        for t, lp, i, v, r in zip(tokens, chosen, ids.tolist(), values.tolist(), rank, strict=True)
    ]


def _emit(logits: torch.Tensor, rows: Sequence[int], tokens: Sequence[int], logprobs: int | None) -> list[Emitted]:
    if logprobs is None:
        return [Emitted(t) for t in tokens]
    return token_logprobs(logits[list(rows)], tokens, logprobs)


def _process(
    logits: torch.Tensor, processors: Sequence[LogitsProcessor], context: Sequence[int], draft: Draft
) -> torch.Tensor:
    """The verified rows (1 + n, V) as the processors make them: row 0 follows the context, row 1 + i the path to
    draft node i. A processor reads one chain at a time, so a tree goes to it one root-to-leaf chain at a time;
    rows that several chains share come out the same from each (a row depends only on its own path)."""
    if not processors:
        return logits
    if draft.parents == chain(len(draft)):  # a chain (or no draft): one pass
        return _process_chain(logits.clone(), processors, context, draft.tokens)
    out = logits.clone()
    leaves = set(range(len(draft))) - set(draft.parents)
    for path in paths(draft.parents):
        if path[-1] in leaves:
            rows = [0, *[i + 1 for i in path]]
            out[rows] = _process_chain(logits[rows], processors, context, [draft.tokens[i] for i in path])
    return out


def _process_chain(
    logits: torch.Tensor, processors: Sequence[LogitsProcessor], context: Sequence[int], draft: Sequence[int]
) -> torch.Tensor:
    for processor in processors:
        logits = processor.process(logits, context, draft)
    return logits


def _drafting_waits(drafters: Mapping[str, Drafter], executor: Executor | None) -> dict[str, float]:
    """Seconds each drafter that proposes on the drafting thread would first wait there (none: the others)."""
    if not isinstance(executor, DraftExecutor):
        return {}
    wait = executor.expected_wait()
    return {name: wait for name, drafter in drafters.items() if not is_cheap(drafter)} if wait > 0.0 else {}


async def decode(
    verifier: TreeVerifier,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    params: SamplingParams,
    generator: torch.Generator,
    drafters: Mapping[str, Drafter] | None = None,
    controller: SpeculationPolicy | None = None,
    stop_token_ids: Collection[int] = (),
    trace: list[SpecStep] | None = None,
    history: Sequence[int] | None = None,
    processors: Sequence[LogitsProcessor] = (),
    logprobs: int | None = None,
    draft_executor: Executor | None = None,
    prompt_logprobs: PromptLogprobs | None = None,
) -> AsyncIterator[Emitted]:
    """Yield up to ``max_new_tokens`` tokens; identical in law (greedy: identical) to sequential decoding.

    ``history`` (tokens already in the verifier's cache) continues that sequence instead of
    starting a new one; the drafters see history + prompt. ``logprobs``: None for none, else how
    many alternatives each token carries (0 for the chosen token's logprob alone).
    ``draft_executor``: where drafters run (None: inline); a sequence's drafts are made one at a time.
    ``prompt_logprobs``: filled with the prompt's own logprobs before the first token is yielded.
    """
    if not prompt_ids:
        raise ValueError("the prompt must hold at least one token")
    if max_new_tokens < 1:  # the prefill's token comes whatever: a caller wanting none drops it (serve's echo)
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
        raise ValueError(f"logprobs must be in 0..{MAX_TOP_LOGPROBS}, got {logprobs}")
    if prompt_logprobs is not None and not 0 <= prompt_logprobs.top <= MAX_TOP_LOGPROBS:
        raise ValueError(f"prompt logprobs must be in 0..{MAX_TOP_LOGPROBS}, got {prompt_logprobs.top}")
    drafters = drafters or {}
    controller = controller if controller is not None and drafters else SequentialPolicy()
    # no acceptance is expected past the depth a drafter's drafts reach, whatever the budget (decoding/controller.py)
    controller.set_max_depths({name: max_depth(drafter) for name, drafter in drafters.items()})
    if history is None:
        verifier.reset()
    context = [*(history or ()), *prompt_ids]
    # prefill: every row when the prompt's own logprobs are wanted, else only its last (1, V)
    logits_from = 0 if prompt_logprobs is not None else len(prompt_ids) - 1
    # the drafters catch up with the prompt (a draft model's cache) while the prefill is in flight: from when the
    # prefill's own work on this side (the edge's head forward over the prompt) is done, which it would slow
    # (on one edge core, a 2,000-token prompt's prefill took 1.1x as long when the preparation started before it)
    preparing: list[asyncio.Future[None] | None] = []  # the preparation, once started

    def prepare() -> None:
        preparing.append(start_prepare(drafters, context, draft_executor))

    adaptive = not isinstance(controller, SequentialPolicy)
    try:
        logits = await verifier.forward(prompt_ids, logits_from=logits_from, sent=prepare if adaptive else None)
        prepared = preparing[0] if preparing else None
        if prompt_logprobs is not None:  # on a worker thread: a long prompt's rows must not stall the event loop
            prompt_logprobs.entries = await asyncio.to_thread(
                prompt_token_logprobs, logits, prompt_ids, prompt_logprobs.top
            )
        last = logits[-1:]  # (1, V)
        pending = choose_token(_process(last, processors, context, Draft.empty())[0], params, generator)
        (first,) = _emit(last, [0], [pending], logprobs)
        for processor in processors:
            processor.accept([pending])
        context.append(pending)
        produced = 1
        # a drafter reading the verifier's features (an EAGLE head) catches up with the prompt's now, during the first
        # decode steps' round trips; no drafter on the drafting thread is asked until it has (decoding/warmup.py)
        catching = (
            None if isinstance(controller, SequentialPolicy) else start_catch_up(drafters, context, draft_executor)
        )
        # the engine's gate on dear drafters under load (decoding/dear_gate.py) counts its output; it gates a choice
        # that holds a dear drafter only (a mode of one drafter asks it, as its user chose)
        gate = draft_executor.gate if isinstance(draft_executor, DraftExecutor) else None
        gateable = gate is not None and len(drafters) > 1 and any(is_dear(d) for d in drafters.values())
        if gate is not None:
            gate.delivered(1)
        yield first
        if pending in stop_token_ids:
            return
        while produced < max_new_tokens:
            if any(p.finished for p in processors):
                return
            # a step follows: the drafters' preparation for the prompt is awaited before it drafts. An answer that
            # ends at its first token does not wait for it (a draft model's pass over a long prompt): the finally
            # abandons it
            await finish_prepare(prepared)
            prepared = None
            # choose and build the draft; a drafter with nothing to offer yields to the next option
            draft, used, draft_s, used_s = Draft.empty(), None, 0.0, 0.0
            # a long context makes wide steps dearer; a queue on the drafting thread makes its drafters dearer
            choices = controller.ranked(len(context), _drafting_waits(drafters, draft_executor))
            asked: set[str] = set()  # drafters asked this step (those that offered nothing were told so)
            # drafted tokens at most, for the step and the proposals scored beside it: the answer's room, and what one
            # step of the verifier carries (a tree larger than that cannot be sent)
            budget_cap = draft_room(verifier, max_new_tokens - produced)
            # what a lone greedy sequence proposes during this step's round trip instead (decoding/aside.py)
            shadowing = params.greedy and not processors
            aside = plan_aside(drafters, controller, draft_executor) if shadowing else AsidePlan()
            # under load, dear drafters are asked only while the engine measures that they pay
            gated = gateable and isinstance(draft_executor, DraftExecutor) and not draft_executor.allows_dear()
            for choice in choices:
                if choice.drafter is None:
                    break
                if choice.drafter in aside.off_step:
                    continue  # not paid for on the critical path until judged aside often enough
                if draft_executor is not None and not is_cheap(drafters[choice.drafter]) and catching_up(catching):
                    continue  # the drafting thread is catching a feature reader up with the prompt: it would wait
                if gated and is_dear(drafters[choice.drafter]):
                    continue
                budget = min(choice.budget, budget_cap)
                if budget < 1:
                    break
                drafter = drafters[choice.drafter]
                asked.add(choice.drafter)
                if draft_executor is None or is_cheap(drafter):  # a lookup: not worth a queue behind a draft model
                    draft, seconds = timed_propose(drafter, context, budget)
                elif isinstance(draft_executor, DraftExecutor):  # the engine's: on a CPU, with other sequences' drafts
                    draft, seconds = await asyncio.wrap_future(draft_executor.propose(drafter, context, budget))
                else:  # a draft model's forwards: off the event loop, which other sequences' I/O needs
                    loop = asyncio.get_running_loop()
                    draft, seconds = await loop.run_in_executor(draft_executor, timed_propose, drafter, context, budget)
                # the drafter's own time, not the wait for the drafting thread: under load that wait belongs to
                # the moment, and a sequence's estimates of its drafter's cost outlive it
                draft_s += seconds
                if processors and draft:
                    if draft.probs is not None and not params.greedy:
                        raise ValueError(SAMPLED_DRAFT_UNDER_PROCESSORS.format(choice.drafter))
                    draft = prune_draft(draft, processors)
                if draft:
                    used, used_s = choice.drafter, seconds
                    break
                controller.observe_draft(choice.drafter, 0, 0, 0, seconds)  # asked, nothing to offer: a miss's cost
            tokens = [pending, *draft.tokens]
            parents = [-1, *[p + 1 for p in draft.parents]]  # draft roots hang off the pending token
            started: list[AsideProposal] = []
            # started once the step is on its way, so that drafting does not slow the edge's own part of it
            propose_aside = partial(
                start_aside,
                drafters,
                aside.shadows,
                asked,
                choices,
                context,
                budget_cap,
                draft_executor,
                timed_propose,
                started,
            )
            t0 = time.perf_counter()
            raw = await verifier.forward(tokens, parents, sent=propose_aside)  # (1 + n, V)
            step_s = time.perf_counter() - t0
            logits = _process(raw, processors, context, draft)
            if params.greedy:
                verdict = greedy_verify_tree(draft.tokens, draft.parents, logits)
            else:
                target = params.probabilities(logits)
                verdict = sample_verify_tree(draft.tokens, draft.parents, draft.probs, target, generator)
            new = [draft.tokens[i] for i in verdict.path] + [verdict.next_token]
            rows = [0, *[i + 1 for i in verdict.path]]  # row r scored new[r]: the pending token's, then each node's
            new = new[: max_new_tokens - produced]
            for i, token in enumerate(new):
                if token in stop_token_ids:
                    new = new[: i + 1]
                    break
            # the caches keep t and the path's tokens that are emitted, all but the last (which, as every step's last
            # token, is not in them yet): a stop token or the length limit inside the path cuts them there too
            kept = verdict.path[: len(new) - 1]
            if len(kept) < len(draft):
                verifier.keep([0, *[i + 1 for i in kept]])
            controller.observe_step(len(tokens), step_s, len(context))
            if used is not None:
                controller.observe_draft(used, draft_depth(draft), len(verdict.path), len(draft), used_s)
            # the target's tokens, which under greedy decoding do not depend on the draft: the others are scored on them
            target_tokens = [draft.tokens[i] for i in verdict.path] + [verdict.next_token]
            if shadowing:
                scored = asked.union(aside.shadows)  # those proposing aside are scored once the tokens are out
                score_shadows(controller, drafters, choices, scored, context, target_tokens, budget_cap)
            if trace is not None:
                trace.append(SpecStep(used, len(draft), len(verdict.path), len(new), step_s, draft_s))
            for processor in processors:
                processor.accept(new)
            try:
                step = _emit(raw, rows[: len(new)], new, logprobs)
                for emitted in step[:-1]:
                    yield replace(emitted, more=True)
                yield step[-1]
            except GeneratorExit:  # the caller went away: the aside proposals are still scored, once done
                score_aside_when_done(started, controller, target_tokens)
                raise
            produced += len(new)
            if gate is not None:
                gate.delivered(len(new))
            context += new
            pending = verdict.next_token
            if new[-1] in stop_token_ids or produced >= max_new_tokens:
                # the answer is complete: its end is not held for the aside proposals, scored once done
                score_aside_when_done(started, controller, target_tokens)
                return
            # scored after the step's tokens are out (an aside proposal may outlast the round trip), before the next
            # step is chosen: the drafting thread would hold that step's proposals until it is done anyway
            await score_aside(started, controller, target_tokens)
    finally:
        for preparation in preparing:  # not awaited: no step drafted (a no-op once awaited)
            abandon_prepare(preparation)
