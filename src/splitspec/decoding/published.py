"""The sampling a checkpoint's publisher meant (generation_config.json), and how a user's choices override it.

transformers' ``generate`` samples only when ``do_sample`` is set; it then takes temperature,
top-k and top-p from generation_config.json, and its own defaults (1.0, 50, 1.0) for what the file
leaves unset. :func:`sampling_settings` does the same, so the CLI and ``SplitClient`` decode a
checkpoint the way its publisher's own ``generate`` call would, and it logs what it chose: a
checkpoint that publishes ``do_sample: false`` is decoded greedily *and says so* (with how to
sample instead), never silently. Any value the user gives wins; ``temperature=0`` is greedy.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from splitspec.decoding.sampling import SamplingParams
from splitspec.exceptions import CheckpointError
from splitspec.models.checkpoint import GENERATION_FILE, read_generation_config

log = logging.getLogger(__name__)

# what transformers' generate uses for a setting that neither the checkpoint nor the caller gives
# (GenerationConfig._get_default_generation_params; a test keeps these equal)
HF_DEFAULT_TEMPERATURE = 1.0
HF_DEFAULT_TOP_K = 50
HF_DEFAULT_TOP_P = 1.0


@dataclass(frozen=True)
class PublishedSampling:
    """The sampling fields of generation_config.json (None: not set there)."""

    do_sample: bool  # False (or absent): the publisher's generate decodes greedily
    temperature: float | None
    top_p: float | None
    top_k: int | None
    source: str  # the file they come from, for messages


def published_sampling(directory: str | Path) -> PublishedSampling:
    """Read the sampling fields of ``directory``'s generation_config.json (all unset when there is none)."""
    raw = read_generation_config(directory)
    source = str(Path(directory) / GENERATION_FILE)

    def number(key: str) -> float | None:
        value = raw.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise CheckpointError(f"{source}: {key} must be a number, got {value!r:.40}")
        return None if value is None else float(value)

    top_k = raw.get("top_k")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int)):
        raise CheckpointError(f"{source}: top_k must be an integer, got {top_k!r:.40}")
    return PublishedSampling(
        do_sample=raw.get("do_sample") is True,
        temperature=number("temperature"),
        top_p=number("top_p"),
        top_k=top_k,
        source=source,
    )


def sampling_settings(
    published: PublishedSampling,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
) -> SamplingParams:
    """The sampling to run: each value the user gives, else the published one, else transformers' default."""
    if temperature is None:
        if published.do_sample:
            temperature = published.temperature if published.temperature is not None else HF_DEFAULT_TEMPERATURE
        else:
            temperature = 0.0
            unused = (
                f" (its temperature {published.temperature:g} applies only when sampling)"
                if (published.temperature is not None)
                else ""
            )
            log.info(
                "decoding greedily: %s does not set do_sample%s; pass --temperature (temperature=) to sample",
                published.source,
                unused,
            )
    params = SamplingParams(
        temperature=temperature,
        top_p=top_p if top_p is not None else published.top_p if published.top_p is not None else HF_DEFAULT_TOP_P,
        top_k=top_k if top_k is not None else published.top_k if published.top_k is not None else HF_DEFAULT_TOP_K,
        seed=seed,
    )
    if params.greedy:
        if top_p is not None or top_k is not None:
            log.warning("--top-p/--top-k have no effect when decoding greedily: pass --temperature above 0")
    else:
        log.info(
            "sampling at temperature %g, top-k %d (0: off), top-p %g", params.temperature, params.top_k, params.top_p
        )
    return params
