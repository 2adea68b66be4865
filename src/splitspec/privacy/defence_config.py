"""The defence settings of a diverged edge (:mod:`.defences` applies them), importable without torch: the
command line's parser reads the defaults."""

from __future__ import annotations

import math
from dataclasses import dataclass

DEFAULT_MAX_SCALE = 1.5  # the scale cap every divergence trains under unless told otherwise


@dataclass(frozen=True)
class DefenceConfig:
    """The defence knobs of a diverged edge (all off = the plain weight divergence)."""

    noise_scale: float = 0.0  # σ: send-noise std relative to each token's RMS activation (0 = off)
    adversary_weight: float = 0.0  # λ: weight of each side's probe-beats-prior hinge (nats; 0 = off)
    adversary_steps: int = 2  # probe updates per edge update
    adversary_lr: float = 2e-3  # probe Adam learning rate
    adversary_width: int = 256  # probe hidden width
    adversary_classes: int = 512  # probe outputs: the most frequent training tokens, plus one "other" class
    max_scale: float = DEFAULT_MAX_SCALE  # c: cap on each state's RMS relative to the published model's (inf = off)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.noise_scale) and self.noise_scale >= 0):
            raise ValueError(f"noise_scale must be a finite number >= 0, got {self.noise_scale}")
        if not (math.isfinite(self.adversary_weight) and self.adversary_weight >= 0):
            raise ValueError(f"adversary_weight must be a finite number >= 0, got {self.adversary_weight}")
        if not self.max_scale > 1:  # also refuses NaN
            raise ValueError(f"max_scale must be > 1 (inf = no cap), got {self.max_scale}")
        if self.adversary_steps < 1 or self.adversary_width < 1 or self.adversary_lr <= 0 or self.adversary_classes < 2:
            raise ValueError("adversary_steps, adversary_width, adversary_lr must be positive, adversary_classes >= 2")

    @property
    def label(self) -> str:
        """Short name of the setting, e.g. ``noise=0.5``, ``adv=1+noise=0.25``, ``adv=1+cap=inf`` or ``none``."""
        parts = []
        if self.adversary_weight > 0:
            parts.append(f"adv={self.adversary_weight:g}")
        if self.noise_scale > 0:
            parts.append(f"noise={self.noise_scale:g}")
        if self.max_scale != DEFAULT_MAX_SCALE:
            parts.append(f"cap={self.max_scale:g}")
        return "+".join(parts) or "none"


# What `splitspec diverge` trains by default: the recommended setting of benchmarks/results/privacy_frontier/report.md
# (demo base model, two seeds): the adversary at 0.1 costs what the plain divergence costs (+6.2 vs +6.0 % perplexity)
# and recovers 1-2 points less against T1/T2 on both sides and seeds. Noise 0.25-0.5 cost more and bought less.
DEFAULT_DEFENCE = DefenceConfig(adversary_weight=0.1)


def parse_defence(text: str) -> DefenceConfig:
    """``"none"``, ``"noise=0.5"``, ``"adv=1"``, ``"adv=1+noise=0.25"``, ``"adv=1+cap=inf"`` -> DefenceConfig."""
    if text.strip() == "none":
        return DefenceConfig()
    knobs = {"noise": "noise_scale", "adv": "adversary_weight", "cap": "max_scale"}
    values: dict[str, float] = {}
    for part in text.split("+"):
        name, sep, value = part.strip().partition("=")
        if not sep or name not in knobs or knobs[name] in values:
            raise ValueError(f"defence must look like none, noise=S, adv=W, adv=W+noise=S (+cap=C); got {text!r}")
        try:
            values[knobs[name]] = float(value)
        except ValueError:
            raise ValueError(f"defence knob {name} needs a number, got {value!r}") from None
    return DefenceConfig(
        noise_scale=values.get("noise_scale", 0.0),
        adversary_weight=values.get("adversary_weight", 0.0),
        max_scale=values.get("max_scale", DEFAULT_MAX_SCALE),
    )
