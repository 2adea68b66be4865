"""What a request that leaves ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty`` or
``max_tokens`` unset gets.

vLLM's OpenAI server takes those defaults from the checkpoint's generation_config.json
(``--generation-config auto``, its default), so a client that sends no temperature gets the sampling
the publisher tuned (Llama 3.1 Instruct: temperature 0.6, top-p 0.9; Qwen2.5 Instruct: 0.7, 0.8,
top-k 20, repetition penalty 1.05), not OpenAI's temperature 1. ``splitspec serve`` does the same, and
``--generation-config vllm`` keeps the neutral defaults (temperature 1, top-p 1, every token, no penalty) whatever
the file says.

As vLLM, the file's values apply whether or not it sets ``do_sample``: a server has no greedy
default (``splitspec generate`` follows transformers' ``generate`` instead: decoding/published.py).
A value the request sends always wins. The file's ``max_new_tokens`` is the ``max_tokens`` of a
request that sends none (capped by what the context has left), as vLLM: it never caps a value sent.
Settings of the file that splitspec does not apply (``no_repeat_ngram_size``, ``typical_p``, ...) are
named in one WARNING at start-up.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from splitspec.decoding.published import PublishedSampling, warn_unapplied
from splitspec.decoding.sampling import SamplingParams
from splitspec.exceptions import CheckpointError, ConfigError
from splitspec.serve.config import GenerationConfigMode

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SamplingDefaults:
    """The settings a request does not send (OpenAI's and vLLM's neutral ones unless a file gives them)."""

    temperature: float = 1.0  # softmax temperature; OpenAI's default samples at 1
    top_p: float = 1.0  # nucleus mass kept, in (0, 1]
    top_k: int = 0  # the k most likely tokens kept; 0 keeps every token (a file's -1 means the same)
    max_tokens: int | None = None  # completion tokens at most; None: what the context has left
    min_p: float = 0.0  # tokens below min_p x the likeliest one's probability dropped, in [0, 1]; 0: none
    repetition_penalty: float = 1.0  # > 0, over the prompt and the tokens generated; 1: off

    def params(
        self,
        temperature: float | None,
        top_p: float | None,
        top_k: int | None,
        seed: int | None,
        min_p: float | None = None,
    ) -> SamplingParams:
        """A request's sampling: each value it sent (None: not sent), else this default."""
        return SamplingParams(
            temperature=self.temperature if temperature is None else temperature,
            top_p=self.top_p if top_p is None else top_p,
            top_k=self.top_k if top_k is None else max(top_k, 0),  # 0 or -1: every token (vLLM's rule)
            seed=seed,
            min_p=self.min_p if min_p is None else min_p,
        )


def sampling_defaults(published: PublishedSampling, mode: GenerationConfigMode) -> SamplingDefaults:
    """The defaults under ``--generation-config mode`` (checked by :class:`ServeConfig`), logged; a file's out-of-range
    value is a CheckpointError."""
    neutral = SamplingDefaults()
    given = {"temperature": published.temperature, "top_p": published.top_p, "top_k": published.top_k,
             "min_p": published.min_p, "repetition_penalty": published.repetition_penalty,
             "max_tokens": published.max_new_tokens}  # fmt: skip
    set_there = {key: value for key, value in given.items() if value is not None}
    if mode == "vllm":
        if set_there:
            log.info("--generation-config vllm: %s's %s not used as defaults", published.source, _listed(set_there))
        return neutral
    if not set_there:
        warn_unapplied(published, sampling=True, repetition=True)
        return neutral
    defaults = SamplingDefaults(
        temperature=published.temperature if published.temperature is not None else neutral.temperature,
        top_p=published.top_p if published.top_p is not None else neutral.top_p,
        top_k=neutral.top_k if published.top_k in (None, -1) else published.top_k,  # -1: every token, as 0
        max_tokens=published.max_new_tokens,
        min_p=published.min_p if published.min_p is not None else neutral.min_p,
        repetition_penalty=(
            published.repetition_penalty if published.repetition_penalty is not None else neutral.repetition_penalty
        ),
    )
    try:
        sampling = defaults.params(None, None, None, None)
    except ConfigError as exc:
        raise CheckpointError(f"{published.source}: {exc}") from None
    log.info(
        "requests that do not set them get %s (from %s; --generation-config vllm: temperature 1, top_p 1, "
        "max_tokens what the context has left)",
        _listed(set_there),
        published.source,
    )
    warn_unapplied(published, sampling=not sampling.greedy, repetition=True)
    return defaults


def _listed(settings: dict[str, float | int]) -> str:
    return ", ".join(f"{key} {value:g}" for key, value in settings.items())
