"""The coordinator's configuration: one frozen dataclass, built once by the CLI."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from splitspec.exceptions import ConfigError
from splitspec.federated.topk import RECONSTRUCTIONS, Reconstruction, normalize_weights
from splitspec.protocol.choices import DEFAULT_QUANT_BUDGET
from splitspec.protocol.fed import (
    DEFAULT_MAX_K,
    EPSILON_SCOPES,
    MAX_QUANT_BUDGET,
    MAX_SCORED_POSITIONS,
    MAX_TEMPERATURE,
    VALUE_CODECS,
    EpsilonScope,
    ValueCodec,
)


@dataclass(frozen=True)
class CoordinatorConfig:
    """Everything a coordinator needs, built once by the CLI."""

    draft_dir: Path  # HF checkpoint directory of the draft model, with tokenizer
    worker_urls: tuple[str, ...]  # ws:// URLs of the workers
    weights: tuple[float, ...] | None = None  # aggregation weight per worker (renormalised); None = equal
    top_k: int | None = 320  # fixed K per position, tokens; None = adaptive (target_epsilon)
    target_epsilon: float | None = None  # adaptive K: largest residual mass 1 − Σ top-K, probability
    epsilon_scope: EpsilonScope = "position"  # adaptive K: target on every position, or on each round's mean
    max_k: int = DEFAULT_MAX_K  # cap on adaptive K, tokens
    reconstruct: Reconstruction = "renorm"  # top-K only, or top-K plus the residual spread uniformly
    gamma: int = 4  # draft tokens per round (at most MAX_SCORED_POSITIONS - 1: workers score γ + 1 positions)
    prob_codec: ValueCodec = "quantized"  # how top-K probabilities travel
    quant_budget: float = DEFAULT_QUANT_BUDGET  # ρ: quantization error allowed per position, fraction of its tail mass
    audit: bool = False  # workers also send full laws; rounds record Δ, drift and bound checks
    auth_token: str | None = None  # shared secret for the workers
    tls_ca_file: Path | None = None  # PEM CA bundle to verify wss:// workers (e.g. behind a TLS proxy); None = system
    round_timeout_s: float = 30.0  # a worker slower than this to answer a message is dropped for the round, seconds
    connect_timeout_s: float = 10.0  # connecting and handshaking, seconds
    rejoin_interval_s: float = 0.5  # first wait before reconnecting a dropped worker, seconds (doubles, <= 10)
    max_message_bytes: int = 64 * 1024 * 1024  # largest frame sent or accepted, bytes
    device: str = "auto"  # draft model's device: auto, cpu, cuda, cuda:N or mps (sampling stays on the host)
    dtype: str = "auto"  # draft model's compute dtype: auto (models.precision: per device) or a pinned one

    def __post_init__(self) -> None:
        if not self.worker_urls:
            raise ConfigError("give at least one worker URL")
        if self.weights is not None:
            if len(self.weights) != len(self.worker_urls):
                raise ConfigError(f"{len(self.weights)} weights for {len(self.worker_urls)} workers")
            normalize_weights(self.weights)
        if (self.top_k is None) == (self.target_epsilon is None):
            raise ConfigError("give exactly one of --top-k and --target-epsilon")
        if self.top_k is not None and self.top_k < 1:
            raise ConfigError("--top-k must be at least 1")
        if self.max_k < 1:
            raise ConfigError("--max-k must be at least 1")
        if self.target_epsilon is not None and not 0 <= self.target_epsilon < 1:
            raise ConfigError("--target-epsilon must be in [0, 1)")
        if self.reconstruct not in RECONSTRUCTIONS:
            raise ConfigError(f"--reconstruct must be one of {RECONSTRUCTIONS}")
        if self.prob_codec not in VALUE_CODECS:
            raise ConfigError(f"probability codec must be one of {VALUE_CODECS}")
        if self.epsilon_scope not in EPSILON_SCOPES:
            raise ConfigError(f"--epsilon-scope must be one of {EPSILON_SCOPES}")
        if self.epsilon_scope != "position" and self.target_epsilon is None:
            raise ConfigError("--epsilon-scope applies to adaptive K: give --target-epsilon")
        if not 0 < self.quant_budget <= MAX_QUANT_BUDGET:
            raise ConfigError(f"--quant-budget must be in (0, {MAX_QUANT_BUDGET}]")
        if self.prob_codec != "quantized" and self.quant_budget != DEFAULT_QUANT_BUDGET:
            raise ConfigError(f"--quant-budget applies to the quantized codec, not --prob-codec {self.prob_codec}")
        if not 0 <= self.gamma < MAX_SCORED_POSITIONS:
            # a round scores γ + 1 positions, and a worker scores at most MAX_SCORED_POSITIONS a request
            raise ConfigError(
                f"--gamma must be in [0, {MAX_SCORED_POSITIONS - 1}]: workers score at most {MAX_SCORED_POSITIONS}"
                " positions a round (γ + 1)"
            )
        # every comparison with NaN is false: `<= 0` let it through, and asyncio.timeout(nan) never fires
        if not all(math.isfinite(t) and t > 0 for t in (self.round_timeout_s, self.connect_timeout_s)):
            raise ConfigError("timeouts must be finite and positive")
        if not (math.isfinite(self.rejoin_interval_s) and self.rejoin_interval_s >= 0):
            raise ConfigError(f"the rejoin interval must be a finite number >= 0, got {self.rejoin_interval_s}")

    def rejoin_wait_s(self) -> float:
        """How long a round whose every worker failed waits for one to rejoin, seconds: the first reconnection's
        backoff (rejoin_interval_s) plus one whole connection attempt (connect_timeout_s)."""
        return self.rejoin_interval_s + self.connect_timeout_s

    def k_cap(self, vocab_size: int) -> int:
        """The most tokens a worker may send per scored position: K, or the adaptive cap, at most the vocabulary."""
        return min(self.top_k if self.top_k is not None else self.max_k, vocab_size)

    def weight_list(self) -> list[float]:
        return list(self.weights) if self.weights is not None else [1.0] * len(self.worker_urls)


def check_temperature(temperature: float) -> None:
    """Refuse a sampling temperature the workers refuse (FedScore carries at most MAX_TEMPERATURE)."""
    if not temperature <= MAX_TEMPERATURE:
        raise ConfigError(f"--temperature must be at most {MAX_TEMPERATURE:g} (the workers' limit), got {temperature}")
