"""Speculative decoding over any verifier: which drafters a mode uses, and the loop that drives them.

The step itself (draft, verify a tree in one forward, keep the accepted path) is the one decode
loop's (:func:`splitspec.decoding.loop.decode`); this module builds the drafters of a
``--speculate`` mode and keeps the token-id view of the loop.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Collection, Mapping, Sequence

import torch

from splitspec.decoding.controller import SpeculationPolicy
from splitspec.decoding.drafters import Drafter, DraftModel, MixedDrafter, NgramPool, PromptLookup
from splitspec.decoding.eagle import EagleDrafter, KeepsFeatures
from splitspec.decoding.loop import SpecStep, TreeVerifier, decode
from splitspec.decoding.modes import SPECULATE_MODES
from splitspec.decoding.sampling import SamplingParams
from splitspec.decoding.trees import draft_depth
from splitspec.devices import device_generator
from splitspec.exceptions import ConfigError
from splitspec.models.draft_head import DraftHead
from splitspec.models.stack import FullModel, ModelEnds

__all__ = ["SPECULATE_MODES", "SpecStep", "TreeVerifier", "draft_depth", "make_drafters", "speculative_decode"]


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
    """Yield up to ``max_new_tokens`` token ids: :func:`splitspec.decoding.loop.decode` with drafters.

    ``history`` (tokens already in the verifier's cache) continues that sequence instead of
    starting a new one; the drafters see history + prompt.
    """
    async for emitted in decode(
        verifier, prompt_ids, max_new_tokens, params, generator, drafters, controller, stop_token_ids, trace, history
    ):
        yield emitted.token


def _seed(generator: torch.Generator | None) -> int | None:
    if generator is None:
        return None
    return int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device))


def make_drafters(
    mode: str,
    params: SamplingParams,
    draft_model: FullModel | None,
    generator: torch.Generator | None = None,
    draft_head: DraftHead | None = None,
    ends: Callable[[], ModelEnds] | None = None,
    features: KeepsFeatures | None = None,
    tree_width: int = 4,
) -> dict[str, Drafter]:
    """The drafters a ``--speculate`` mode uses (``auto``: every one available).

    A sampling draft model (or head) draws its own seed from ``generator``: drafts must be fresh
    random draws from q in every run, or speculative sampling is no longer lossless. A draft head
    (``eagle``) drafts from the target's ``ends`` (embedding, final norm, LM head) and the
    verifier's ``features`` (see :mod:`splitspec.decoding.eagle`); without features it offers nothing.
    ``tree_width``: children per expanded node of the draft model's and the head's trees (1: a chain).
    """
    if mode not in SPECULATE_MODES:
        raise ConfigError(f"--speculate must be one of {', '.join(SPECULATE_MODES)}, got {mode!r}")
    if mode in ("draft",) and draft_model is None:
        raise ConfigError("--speculate draft needs a draft model (--draft-model DIR)")
    if mode in ("eagle",) and (draft_head is None or ends is None):
        raise ConfigError("--speculate eagle needs a draft head (--draft-head DIR)")
    drafters: dict[str, Drafter] = {}
    if mode in ("eagle", "auto") and draft_head is not None and ends is not None:
        seed = _seed(generator)
        head_generator = None if seed is None or params.greedy else device_generator(ends().device, seed)
        drafters["eagle"] = EagleDrafter(draft_head, ends, features, params, head_generator, top_k=tree_width)
    if mode in ("ngram", "auto"):
        drafters["ngram"] = NgramPool()
    if mode in ("prompt-lookup", "auto"):
        drafters["prompt-lookup"] = PromptLookup()
    if mode in ("draft", "auto") and draft_model is not None:
        seed = _seed(generator)
        drafters["draft"] = DraftModel(
            draft_model, params, None if seed is None else device_generator(draft_model.device, seed), tree_width
        )
    if mode in ("mix", "auto"):
        # deterministic sources only: the draft model proposes its greedy tree here
        sources: list[Drafter] = [PromptLookup(), NgramPool()]
        if draft_model is not None:
            # a greedy "draft" drafter is this one already: share it (one cache to fill, not two)
            shared = drafters.get("draft") if params.greedy else None
            sources.append(
                shared if shared is not None else DraftModel(draft_model, SamplingParams(), top_k=tree_width)
            )
        drafters["mix"] = MixedDrafter(sources)
    return drafters
