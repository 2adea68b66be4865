"""The sampling a checkpoint's publisher meant (generation_config.json), and how a user's choices override it.

transformers' ``generate`` samples only when ``do_sample`` is set; it then takes temperature,
top-k, top-p and min-p from generation_config.json, and its own defaults (1.0, 50, 1.0, off) for what
the file leaves unset. :func:`sampling_settings` does the same for those, and it logs what it chose: a
checkpoint that publishes ``do_sample: false`` is decoded greedily *and says so* (with how to
sample instead), never silently. Any value the user gives wins; ``temperature=0`` is greedy.
The file's ``repetition_penalty`` (Qwen2.5-Instruct sets 1.05) is read too (:class:`PublishedSampling`):
the ``generate``, ``chat`` and ``serve`` commands apply it, as transformers' generate and vLLM do (a logits processor,
:class:`~splitspec.decoding.adjusters.RepetitionPenalty`); the Python API's default sampling does not, and says so.

Other settings that change the publisher's own ``generate`` output (``no_repeat_ngram_size``,
``typical_p``, ...: :data:`UNAPPLIED`, :data:`UNAPPLIED_WHEN_SAMPLING`) are not applied:
where the file sets one, a WARNING names it, so output that differs from that call is never a
surprise.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from splitspec.decoding.sampling import SamplingParams
from splitspec.exceptions import CheckpointError
from splitspec.models.checkpoint import GENERATION_FILE, read_generation_config

log = logging.getLogger(__name__)

# what transformers' generate uses for a setting that neither the checkpoint nor the caller gives
# (GenerationConfig._get_default_generation_params; a test keeps these equal)
HF_DEFAULT_TEMPERATURE = 1.0
HF_DEFAULT_TOP_K = 50
HF_DEFAULT_TOP_P = 1.0

# generation_config.json settings that change what the publisher's generate picks and that splitspec does not
# apply, each with the value that leaves it off (transformers' default; None or an empty list is off too):
# these act whether generate samples or not ...
UNAPPLIED: Mapping[str, object] = {
    "no_repeat_ngram_size": 0,
    "min_length": 0,
    "min_new_tokens": 0,
    "bad_words_ids": None,
    "suppress_tokens": None,
    "begin_suppress_tokens": None,
    "sequence_bias": None,
    "exponential_decay_length_penalty": None,
    "num_beams": 1,
    "penalty_alpha": 0.0,
    "dola_layers": None,
    "guidance_scale": 1.0,
}
# ... and these only when it samples (do_sample)
UNAPPLIED_WHEN_SAMPLING: Mapping[str, object] = {
    "typical_p": 1.0,
    "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0,
    "top_h": None,
}

_warned: set[tuple[str, str]] = set()  # (source, setting) already warned about: once per process


@dataclass(frozen=True)
class PublishedSampling:
    """The sampling fields of generation_config.json (None: not set there)."""

    do_sample: bool  # False (or absent): the publisher's generate decodes greedily
    temperature: float | None
    top_p: float | None
    top_k: int | None
    source: str  # the file they come from, for messages
    max_new_tokens: int | None = None  # tokens its generate produces at most (>= 1); serve's default max_tokens
    min_p: float | None = None  # in [0, 1]; applies when sampling
    repetition_penalty: float | None = None  # > 0; 1 is off; applies whether or not generate samples
    # settings of UNAPPLIED / UNAPPLIED_WHEN_SAMPLING the file turns on, with their values
    unapplied: Mapping[str, Any] = field(default_factory=dict)
    unapplied_when_sampling: Mapping[str, Any] = field(default_factory=dict)


def _turned_on(raw: Mapping[str, Any], neutral: Mapping[str, object]) -> dict[str, Any]:
    """The settings of ``neutral`` that ``raw`` sets to a value that is not off."""
    return {
        key: raw[key]
        for key in neutral
        if raw.get(key) is not None and raw[key] != neutral[key] and raw[key] not in ([], {})
    }


def published_sampling(directory: str | Path) -> PublishedSampling:
    """Read the sampling fields of ``directory``'s generation_config.json (all unset when there is none)."""
    raw = read_generation_config(directory)
    source = str(Path(directory) / GENERATION_FILE)

    def number(key: str) -> float | None:
        value = raw.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise CheckpointError(f"{source}: {key} must be a number, got {value!r:.40}")
        return None if value is None else float(value)

    def integer(key: str, positive: bool = False) -> int | None:
        value = raw.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or (positive and value < 1)):
            kind = "a positive integer" if positive else "an integer"
            raise CheckpointError(f"{source}: {key} must be {kind}, got {value!r:.40}")
        return value

    return PublishedSampling(
        do_sample=raw.get("do_sample") is True,
        temperature=number("temperature"),
        top_p=number("top_p"),
        top_k=integer("top_k"),
        source=source,
        max_new_tokens=integer("max_new_tokens", positive=True),
        min_p=number("min_p"),
        repetition_penalty=_positive(number("repetition_penalty"), "repetition_penalty", source),
        unapplied=_turned_on(raw, UNAPPLIED),
        unapplied_when_sampling=_turned_on(raw, UNAPPLIED_WHEN_SAMPLING),
    )


def _positive(value: float | None, key: str, source: str) -> float | None:
    if value is not None and not value > 0:
        raise CheckpointError(f"{source}: {key} must be above 0, got {value:g}")
    return value


def warn_unapplied(published: PublishedSampling, sampling: bool, repetition: bool = False) -> None:
    """One WARNING naming each setting of the file that changes its publisher's output and is not applied here
    (``repetition``: the caller applies the file's repetition_penalty, as ``serve`` does)."""
    settings = {**published.unapplied, **(published.unapplied_when_sampling if sampling else {})}
    if not repetition and published.repetition_penalty not in (None, 1.0):
        settings["repetition_penalty"] = published.repetition_penalty
    new = {key: value for key, value in settings.items() if (published.source, key) not in _warned}
    if not new:
        return
    _warned.update((published.source, key) for key in new)
    log.warning(
        "%s sets %s, which splitspec does not apply here: output differs from the publisher's own generate call "
        "(splitspec takes temperature, top_p, top_k, min_p and, in its commands, repetition_penalty from the file)",
        published.source,
        ", ".join(f"{key}={value!r:.40}" for key, value in new.items()),
    )


def sampling_settings(
    published: PublishedSampling,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    min_p: float | None = None,
    repetition_applied: bool = False,
) -> SamplingParams:
    """The sampling to run: each value the user gives, else the published one, else transformers' default (min_p:
    off). ``repetition_applied``: the caller applies the file's repetition_penalty (not named as unapplied)."""
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
        min_p=min_p if min_p is not None else published.min_p or 0.0,
    )
    warn_unapplied(published, sampling=not params.greedy, repetition=repetition_applied)
    if params.greedy:
        if top_p is not None or top_k is not None or min_p is not None:
            log.warning("--top-p/--top-k/--min-p have no effect when decoding greedily: pass --temperature above 0")
    else:
        log.info(
            "sampling at temperature %g, top-k %d (0: off), top-p %g, min-p %g (0: off)",
            params.temperature,
            params.top_k,
            params.top_p,
            params.min_p,
        )
    return params
