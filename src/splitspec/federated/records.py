"""What a SpecFed generation records: per worker and round, per round, and the whole result.

The coordinator (:mod:`splitspec.federated.coordinator`) fills these in; the CLI and the
benchmarks print and save them (``FedResult.to_json``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class WorkerRound:
    """One worker's part of one round."""

    url: str
    status: str  # "ok", "rejoined" (reconnected and re-prefilled this round), "dropped", "down"
    weight: float  # weight used this round after renormalisation; 0 when absent
    k: list[int] = field(default_factory=list)  # tokens sent per position
    epsilon: list[float] = field(default_factory=list)  # ε = ‖p − p̃‖₁ per position, as the worker reported it
    residual: list[float] = field(default_factory=list)  # 1 − Σ p̃ per position as received (≈ tail mass τ)
    bytes_up: int = 0  # request frame(s), bytes
    bytes_down: int = 0  # reply frame(s), bytes
    payload_bytes: int = 0  # top-K bit stream in the reply, bytes
    worker_ms: float = 0.0  # model compute on the worker, milliseconds
    roundtrip_ms: float = 0.0  # request sent to reply parsed, milliseconds
    error: str | None = None  # why the worker was dropped (status "rejoined": dropped earlier this round, back since)


@dataclass(frozen=True)
class AuditRound:
    """Audit figures of one round, per scored position."""

    delta: list[float]  # Δ = ‖p − p̂‖₁ of the aggregate
    bound: list[float]  # 2 Σ w_i ε_i with the exact ε_i = ‖p_i − p̃_i‖₁
    weighted_epsilon: list[float]  # Σ w_i ε_i with the exact ε
    drift: list[float]  # |α − α̂| per drafted position
    violations: list[str]  # failed bound checks (empty when all hold)


@dataclass(frozen=True)
class RoundStats:
    """Accounting of one round."""

    index: int
    drafted: int  # γ used this round, tokens
    accepted: int  # draft tokens kept, tokens
    emitted: list[int]  # token ids emitted this round
    workers: list[WorkerRound]
    weighted_epsilon: list[float]  # Σ w_i ε_i per position, as seen by the coordinator
    draft_ms: float  # drafting time, milliseconds
    round_ms: float  # whole round, milliseconds
    audit: AuditRound | None = None


@dataclass(frozen=True)
class FedResult:
    """A finished generation."""

    token_ids: list[int]
    text: str
    seed: int
    rounds: list[RoundStats]

    def summary(self) -> dict[str, Any]:
        rounds = self.rounds
        drafted = sum(r.drafted for r in rounds)
        accepted = sum(r.accepted for r in rounds)
        urls = sorted({w.url for r in rounds for w in r.workers})
        per_worker = {
            url: {
                "rounds_ok": sum(
                    1 for r in rounds for w in r.workers if w.url == url and w.status in ("ok", "rejoined")
                ),
                "rounds_missed": sum(
                    1 for r in rounds for w in r.workers if w.url == url and w.status in ("dropped", "down")
                ),
                "bytes_up": sum(w.bytes_up for r in rounds for w in r.workers if w.url == url),
                "bytes_down": sum(w.bytes_down for r in rounds for w in r.workers if w.url == url),
                "mean_k": _mean([k for r in rounds for w in r.workers if w.url == url for k in w.k]),
                "mean_epsilon": _mean([e for r in rounds for w in r.workers if w.url == url for e in w.epsilon]),
            }
            for url in urls
        }
        audits = [r.audit for r in rounds if r.audit is not None]
        out: dict[str, Any] = {
            "rounds": len(rounds),
            "tokens": len(self.token_ids),
            "drafted": drafted,
            "accepted": accepted,
            "acceptance": accepted / drafted if drafted else None,
            "tokens_per_round": len(self.token_ids) / len(rounds) if rounds else None,
            "workers": per_worker,
        }
        if audits:
            out["audit"] = {
                "mean_delta": _mean([d for a in audits for d in a.delta]),
                "mean_bound": _mean([b for a in audits for b in a.bound]),
                "max_drift": max([d for a in audits for d in a.drift], default=0.0),
                "violations": sum(len(a.violations) for a in audits),
            }
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "token_ids": self.token_ids,
            "text": self.text,
            "seed": self.seed,
            "summary": self.summary(),
            "rounds": [asdict(r) for r in self.rounds],
        }


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None
