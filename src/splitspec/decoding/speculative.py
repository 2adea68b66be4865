"""Speculative decoding over any verifier: draft locally, verify many tokens in one step.

One step (``speculative_step``): the pending token t (chosen but not yet in the caches) and a draft
tree continuing it go to the verifier together: q = 1 + len(draft) query tokens, t first, every
draft root a child of t. Row 0 of the logits scores the roots, row i + 1 the children of node i.
The acceptance rule picks a path through the tree and the next token; the caches keep t and that
path (the cloud learns it on the next step, at no extra round trip), and the next token becomes
the new pending one. With an empty draft the step is a plain sequential step.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from splitspec.decoding.acceptance import greedy_verify_tree, sample_verify_tree
from splitspec.decoding.controller import SpeculationPolicy
from splitspec.decoding.drafters import Draft, Drafter, DraftModel, MixedDrafter, NgramPool, PromptLookup
from splitspec.decoding.sampling import SamplingParams, choose_token
from splitspec.devices import device_generator
from splitspec.exceptions import ConfigError
from splitspec.models.stack import FullModel


class TreeVerifier(Protocol):
    async def forward(self, tokens: Sequence[int], parents: Sequence[int] | None = None) -> torch.Tensor: ...

    def keep(self, indices: Sequence[int]) -> None: ...

    def reset(self) -> None: ...


@dataclass(frozen=True)
class SpecStep:
    """What one speculative step did."""

    drafter: str | None  # None: sequential step
    draft_tokens: int  # tokens drafted (tree nodes)
    accepted: int  # drafted tokens accepted
    emitted: int  # tokens this step added to the output (accepted + 1, less any cut at the end)
    step_s: float  # verifier forward, seconds
    draft_s: float  # drafting, seconds


def draft_depth(draft: Draft) -> int:
    depth: list[int] = []
    for p in draft.parents:
        depth.append(1 if p < 0 else depth[p] + 1)
    return max(depth, default=0)


async def speculative_decode(
    verifier: TreeVerifier,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    params: SamplingParams,
    generator: torch.Generator,
    drafters: Mapping[str, Drafter],
    controller: SpeculationPolicy,
    stop_token_ids: Collection[int] = (),
    trace: list[SpecStep] | None = None,
    history: Sequence[int] | None = None,
) -> AsyncIterator[int]:
    """Yield up to ``max_new_tokens`` tokens; identical in law (greedy: identical) to sequential decoding.

    ``history`` (tokens already in the verifier's cache) continues that sequence instead of
    starting a new one; the drafters see history + prompt.
    """
    if not prompt_ids:
        raise ValueError("the prompt must hold at least one token")
    if history is None:
        verifier.reset()
    logits = await verifier.forward(prompt_ids)  # prefill
    pending = choose_token(logits[-1], params, generator)
    context = [*(history or ()), *prompt_ids, pending]
    produced = 1
    yield pending
    if pending in stop_token_ids:
        return
    while produced < max_new_tokens:
        # choose and build the draft; a drafter with nothing to offer yields to the next option
        draft, used, draft_s = Draft.empty(), None, 0.0
        for choice in controller.ranked():
            if choice.drafter is None:
                break
            budget = min(choice.budget, max_new_tokens - produced - 1)
            if budget < 1:
                break
            t0 = time.perf_counter()
            draft = drafters[choice.drafter].propose(context, budget)
            draft_s += time.perf_counter() - t0
            if draft:
                used = choice.drafter
                break
            controller.observe_draft(choice.drafter, 0, 0, 0, 0.0)  # asked, nothing to offer
        tokens = [pending, *draft.tokens]
        parents = [-1, *[p + 1 for p in draft.parents]]  # draft roots hang off the pending token
        t0 = time.perf_counter()
        logits = await verifier.forward(tokens, parents)  # (1 + n, V)
        step_s = time.perf_counter() - t0
        if params.greedy:
            verdict = greedy_verify_tree(draft.tokens, draft.parents, logits)
        else:
            target = params.probabilities(logits)
            verdict = sample_verify_tree(draft.tokens, draft.parents, draft.probs, target, generator)
        if len(verdict.path) < len(draft):
            verifier.keep([0, *[i + 1 for i in verdict.path]])  # t and the accepted path
        new = [draft.tokens[i] for i in verdict.path] + [verdict.next_token]
        new = new[: max_new_tokens - produced]
        for i, token in enumerate(new):
            if token in stop_token_ids:
                new = new[: i + 1]
                break
        controller.observe_step(len(tokens), step_s)
        if used is not None:
            controller.observe_draft(used, draft_depth(draft), len(verdict.path), len(draft), draft_s)
        if trace is not None:
            trace.append(SpecStep(used, len(draft), len(verdict.path), len(new), step_s, draft_s))
        for token in new:
            yield token
        produced += len(new)
        context += new
        pending = verdict.next_token
        if new[-1] in stop_token_ids:
            return


SPECULATE_MODES = ("off", "ngram", "prompt-lookup", "draft", "mix", "auto")


def make_drafters(
    mode: str, params: SamplingParams, draft_model: FullModel | None, generator: torch.Generator | None = None
) -> dict[str, Drafter]:
    """The drafters a ``--speculate`` mode uses (``auto``: every one available).

    A sampling draft model draws its own seed from ``generator``: drafts must be fresh random
    draws from q in every run, or speculative sampling is no longer lossless.
    """
    if mode not in SPECULATE_MODES:
        raise ConfigError(f"--speculate must be one of {', '.join(SPECULATE_MODES)}, got {mode!r}")
    if mode in ("draft",) and draft_model is None:
        raise ConfigError("--speculate draft needs a draft model (--draft-model DIR)")
    drafters: dict[str, Drafter] = {}
    if mode in ("ngram", "auto"):
        drafters["ngram"] = NgramPool()
    if mode in ("prompt-lookup", "auto"):
        drafters["prompt-lookup"] = PromptLookup()
    if mode in ("draft", "auto") and draft_model is not None:
        seed = (
            int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device))
            if generator is not None
            else None
        )
        drafters["draft"] = DraftModel(
            draft_model, params, None if seed is None else device_generator(draft_model.device, seed)
        )
    if mode in ("mix", "auto"):
        # deterministic sources only: the draft model proposes its greedy tree here
        sources: list[Drafter] = [PromptLookup(), NgramPool()]
        if draft_model is not None:
            sources.append(DraftModel(draft_model, SamplingParams()))
        drafters["mix"] = MixedDrafter(sources)
    return drafters
