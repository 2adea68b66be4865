"""The decoding modes a benchmark runs, by name, and the local baselines it compares them with.

:mod:`splitspec.bench.scenario` validates a scenario's ``modes`` against :data:`MODES`; the run
(:mod:`splitspec.bench.harness`) calls them. Importing this module loads neither torch nor the
edge: a scenario file is checked without them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from splitspec.edge import GenerationResult, SplitClient

__all__ = ["BASELINES", "MODES", "ModeRunner", "reference_baseline"]

ModeRunner = Callable[["SplitClient", Sequence[int], int], Awaitable["GenerationResult"]]


async def _sequential(client: SplitClient, prompt_ids: Sequence[int], max_new_tokens: int) -> GenerationResult:
    """Plain greedy decoding: one round trip per token."""
    from splitspec.decoding.sampling import SamplingParams

    return await client.generate(prompt_ids, max_new_tokens, SamplingParams(temperature=0.0), speculate="off")


def _speculative(mode: str) -> ModeRunner:
    async def run(client: SplitClient, prompt_ids: Sequence[int], max_new_tokens: int) -> GenerationResult:
        from splitspec.decoding.sampling import SamplingParams

        return await client.generate(prompt_ids, max_new_tokens, SamplingParams(temperature=0.0), speculate=mode)

    run.__doc__ = f"Greedy speculative decoding, --speculate {mode}."
    return run


MODES: dict[str, ModeRunner] = {
    "sequential": _sequential,
    **{mode: _speculative(mode) for mode in ("ngram", "prompt-lookup", "draft", "mix", "auto")},
}
"""Split decoding modes by name. A mode is ``async (client, prompt_ids, max_new_tokens) ->
GenerationResult`` and must decode greedily (its tokens are checked against :func:`reference_baseline`)."""

BASELINES = ("hf_generate", "hf_prompt_lookup", "local_loop")
"""Local-only baselines: transformers ``generate`` (greedy), transformers prompt-lookup decoding,
and a bare KV-cached greedy loop over the full model (the local compute floor without
``generate()``'s per-call and per-token bookkeeping)."""


def reference_baseline(enabled: Iterable[str]) -> str | None:
    """The baseline every run's tokens are checked against: ``hf_generate``, else ``local_loop`` (both greedy,
    full model); None when neither of them runs."""
    names = set(enabled)
    return next((m for m in ("hf_generate", "local_loop") if m in names), None)
