"""Top-K selection of next-token distributions, reconstruction, aggregation and error accounting.

Pure torch, no I/O. The pieces of SpecFed's uplink (the byte encoding is :mod:`.codec`):

* :func:`select_topk` keeps, per position, the K most likely tokens: a fixed K; or adaptive K,
  either per position (the smallest K whose residual mass ``1 − Σ top-K`` is at most a target ε)
  or per round (the fewest tokens over all the round's positions whose mean residual mass is at
  most ε: the globally most probable tokens, at least one per position), capped at ``max_k``.
* :func:`reconstruct` rebuilds a full distribution: ``renorm`` (top-K renormalised, zero
  elsewhere) or ``residual`` (top-K kept, the residual mass spread uniformly over the other
  ``|V| − K`` tokens).
* :func:`aggregate` mixes reconstructed worker distributions with weights ``w_i``.
* :func:`bound_report` checks the SpecFed bounds when the exact distributions are known:
  ``‖p_i − p̂_i‖₁ ≤ 2ε_i``, ``Δ = ‖p − p̂‖₁ ≤ 2Σ w_i ε_i`` and ``|α − α̂| ≤ ½Δ`` with
  ``α = Σ_x min(p(x), q(x))`` the speculative acceptance rate against a draft law q.

Here ε_i is the L1 error of what worker i transmitted, ``‖p_i − p̃_i‖₁``: the exact mass outside
the kept ids plus the quantization error ``η_i = Σ_kept |p̃ − p|`` of the kept values. With exact
values it is the paper's residual mass; with quantized values the same proofs go through
unchanged (see :func:`bound_report`), and the worker reports this ε, not the bare tail.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

import torch

from splitspec.decoding.sampling import GREEDY_BELOW, outside_top_k
from splitspec.exceptions import ConfigError
from splitspec.protocol.fed import EPSILON_SCOPES, EpsilonScope

Reconstruction = Literal["renorm", "residual"]  # how a top-K becomes a full distribution
RECONSTRUCTIONS: tuple[Reconstruction, ...] = get_args(Reconstruction)


@dataclass(frozen=True)
class TopKPolicy:
    """How many tokens a worker keeps per position."""

    k: int | None = None  # fixed number of tokens per position; None = adaptive
    target_epsilon: float | None = None  # adaptive: largest residual mass allowed, probability
    max_k: int = 4096  # cap on K per position, tokens (applies to adaptive K; fixed K is capped at |V|)
    scope: EpsilonScope = "position"  # adaptive: target per position, or on the mean over a round's positions

    def __post_init__(self) -> None:
        if (self.k is None) == (self.target_epsilon is None):
            raise ConfigError("give exactly one of a fixed K and a target epsilon")
        if self.k is not None and self.k < 1:
            raise ConfigError(f"K must be at least 1, got {self.k}")
        if self.target_epsilon is not None and not 0.0 <= self.target_epsilon < 1.0:
            raise ConfigError(f"target epsilon must be in [0, 1), got {self.target_epsilon}")
        if self.max_k < 1:
            raise ConfigError(f"max_k must be at least 1, got {self.max_k}")
        if self.scope not in EPSILON_SCOPES:
            raise ConfigError(f"epsilon scope must be one of {EPSILON_SCOPES}, got {self.scope!r}")


@dataclass(frozen=True)
class TopK:
    """Ragged top-K of n positions: ``counts[j]`` ids and probabilities for position j.

    ``ids`` and ``probs`` are flat, position after position, ids ascending within a position.
    """

    vocab_size: int  # |V|, tokens
    counts: torch.Tensor  # (n,) int64, K per position
    ids: torch.Tensor  # (ΣK,) int64, ascending within each position
    probs: torch.Tensor  # (ΣK,) float32 probabilities of those ids (as transmitted)
    epsilon: torch.Tensor | None = None  # (n,) float32 sender's bound on ‖p − p̃‖₁, when it sent one

    @property
    def positions(self) -> int:
        return int(self.counts.numel())

    def residual_mass(self) -> torch.Tensor:
        """(n,) 1 − Σ top-K as received, clamped at 0 (quantized masses may sum slightly above 1)."""
        return (1.0 - _segment_sum(self.probs.double(), self.counts)).clamp_min(0.0).float()

    def transmitted_epsilon(self) -> torch.Tensor:
        """(n,) the sender's ε when it reported one, else the residual mass of the received values."""
        return self.epsilon if self.epsilon is not None else self.residual_mass()

    def segment_index(self) -> torch.Tensor:
        """(ΣK,) the position each flat entry belongs to."""
        return torch.repeat_interleave(torch.arange(self.positions), self.counts)


def _segment_sum(values: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(counts.numel(), dtype=values.dtype)
    return out.index_add_(0, torch.repeat_interleave(torch.arange(counts.numel()), counts), values)


def adaptive_k(probs: torch.Tensor, target_epsilon: float, max_k: int) -> torch.Tensor:
    """(n, V) probabilities -> (n,) smallest K with 1 − Σ top-K <= target ε, in [1, min(max_k, V)]."""
    sorted_p = probs.double().sort(dim=-1, descending=True).values
    residual = 1.0 - sorted_p.cumsum(dim=-1)  # residual[j, k-1] = ε with K = k
    k = (residual > target_epsilon).sum(dim=-1) + 1  # residual is non-increasing in K
    return k.clamp(1, min(max_k, probs.shape[-1]))


def round_budget_k(probs: torch.Tensor, target_epsilon: float, max_k: int) -> torch.Tensor:
    """(n, V) -> (n,) the fewest tokens in all whose mean residual mass over the n rows is <= ε.

    Every row keeps its most likely token; the rest are taken in one global order of probability,
    largest first, until the kept mass reaches n(1 − ε). Taking the largest remaining probability
    first is optimal (an exchange argument), so no allocation keeps fewer tokens in total for the
    same mean ε; fixed K is one such allocation. Rows are capped at ``max_k`` (the target may then
    be missed).
    """
    n, vocab = probs.shape
    cap = min(max_k, vocab)
    sorted_p = probs.double().sort(dim=-1, descending=True).values[:, :cap]  # (n, cap)
    need = n * (1.0 - target_epsilon) - float(sorted_p[:, 0].sum())
    rest = sorted_p[:, 1:].reshape(-1)  # (n·(cap − 1),) candidates beyond each row's first
    order = rest.argsort(descending=True, stable=True)
    taken = int(torch.searchsorted(rest[order].cumsum(0), torch.tensor([need], dtype=torch.float64))) + 1
    taken = min(taken, rest.numel()) if need > 1e-9 * n else 0  # float slack of the sums
    rows = order[:taken] // max(1, cap - 1)
    return 1 + torch.bincount(rows, minlength=n)


def select_topk(probs: torch.Tensor, policy: TopKPolicy) -> TopK:
    """Keep each row's K most likely tokens of ``probs`` (n, V); ids come out ascending."""
    if probs.dim() != 2:
        raise ValueError(f"probs must be (n, V), got {tuple(probs.shape)}")
    n, vocab = probs.shape
    if policy.k is not None:
        counts = torch.full((n,), min(policy.k, vocab), dtype=torch.long)
    elif policy.scope == "round":
        counts = round_budget_k(probs, float(policy.target_epsilon or 0.0), policy.max_k)
    else:
        counts = adaptive_k(probs, float(policy.target_epsilon or 0.0), policy.max_k)
    if n == 0:
        empty = torch.zeros(0, dtype=torch.long)
        return TopK(vocab_size=vocab, counts=empty, ids=empty, probs=torch.zeros(0))
    k_max = int(counts.max())
    top_p, top_i = probs.float().topk(k_max, dim=-1, sorted=True)
    keep = torch.arange(k_max).expand(n, k_max) < counts[:, None]
    # sort the kept ids ascending within each row: push dropped slots to the end with a big key
    key = torch.where(keep, top_i, torch.full_like(top_i, vocab + 1))
    order = key.argsort(dim=-1)
    ids = top_i.gather(-1, order)[keep.gather(-1, order)]
    vals = top_p.gather(-1, order)[keep.gather(-1, order)]
    return TopK(vocab_size=vocab, counts=counts, ids=ids.long(), probs=vals.float())


# -- reconstruction and aggregation ---------------------------------------------------------------


def reconstruct(topk: TopK, method: Reconstruction) -> torch.Tensor:
    """(n, V) float32 distribution rebuilt from ``topk``.

    ``renorm``: top-K probabilities divided by their sum, zero elsewhere. ``residual``: top-K
    probabilities kept, ``ε = 1 − Σ top-K`` spread uniformly over the other ``|V| − K`` tokens
    (when K = |V| or ε = 0 nothing is spread; quantized masses above 1 are renormalised).
    """
    if method not in RECONSTRUCTIONS:
        raise ConfigError(f"reconstruction must be one of {RECONSTRUCTIONS}, got {method!r}")
    n, vocab = topk.positions, topk.vocab_size
    rows = topk.segment_index()
    p = topk.probs.double()
    mass = _segment_sum(p, topk.counts)
    out = torch.zeros(n, vocab, dtype=torch.float64)
    if method == "renorm":
        safe = torch.where(mass > 0, mass, torch.ones_like(mass))
        out[rows, topk.ids] = p / safe[rows]
        # a position whose kept mass is 0 carries no information: fall back to uniform
        out[mass <= 0] = 1.0 / vocab
        return out.float()
    eps = (1.0 - mass).clamp_min(0.0)
    others = (vocab - topk.counts).double()
    fill = torch.where(others > 0, eps / others.clamp_min(1.0), torch.zeros_like(eps))
    out += fill[:, None]
    out[rows, topk.ids] = p
    total = out.sum(dim=-1, keepdim=True)  # 1 unless quantized masses exceeded 1 or K = |V|
    out /= torch.where(total > 0, total, torch.ones_like(total))
    # K = |V| with every probability 0 (a peer's upload, within a loose ε) carries no information: uniform, as for
    # renorm; dividing by its total of 0 made a row of NaN that aborted the round
    out[total[:, 0] <= 0] = 1.0 / vocab
    return out.float()


def normalize_weights(weights: Sequence[float]) -> torch.Tensor:
    """Non-negative weights scaled to sum to 1."""
    w = torch.tensor([float(x) for x in weights], dtype=torch.float64)
    if w.numel() == 0 or bool((w < 0).any()) or not math.isfinite(float(w.sum())) or float(w.sum()) <= 0:
        raise ConfigError(f"weights must be non-negative with a positive sum, got {list(weights)}")
    return w / w.sum()


def aggregate(distributions: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """Σ w_i p_i with the weights renormalised to sum to 1; each p_i is (n, V)."""
    if len(distributions) != len(weights) or not distributions:
        raise ConfigError("one weight per distribution, at least one distribution")
    w = normalize_weights(weights)
    out = torch.zeros_like(distributions[0], dtype=torch.float64)
    for wi, p in zip(w.tolist(), distributions, strict=True):
        out += wi * p.double()
    return out.float()


def scoring_temperature(temperature: float) -> float:
    """The temperature the workers' laws (and the coordinator's draft law) are taken at: a greedy run's
    (below :data:`~splitspec.decoding.sampling.GREEDY_BELOW`, 0 included) at T = 1, since a tiny T would make each
    law one-hot and the aggregate a vote; greedy verification is on the argmax of the T = 1 aggregate."""
    return 1.0 if temperature < GREEDY_BELOW else temperature


def top_k_filter(probs: torch.Tensor, top_k: int) -> torch.Tensor:
    """Top-k on probability rows (..., V): keep each row's ``top_k`` most likely tokens, renormalised; 0 keeps all.

    The rule of :func:`splitspec.decoding.sampling.probabilities` (:func:`~splitspec.decoding.sampling.outside_top_k`:
    ties with the k-th value are kept), which applies it before top-p: so ``nucleus(top_k_filter(p, k), top_p)``.
    """
    drop = outside_top_k(probs, top_k)
    if drop is None:
        return probs
    kept = probs.masked_fill(drop, 0.0)
    return kept / kept.sum(dim=-1, keepdim=True)


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Top-p on probability rows (..., V): keep the smallest set of most likely tokens with mass >= top_p.

    Same rule as :func:`splitspec.decoding.sampling.probabilities` applied to ``log probs``.
    """
    if top_p >= 1.0:
        return probs
    sorted_p, order = torch.sort(probs, dim=-1, descending=False)
    cumulative = sorted_p.cumsum(dim=-1)
    drop_sorted = cumulative <= (1 - top_p)
    drop_sorted[..., -1:] = False
    drop = drop_sorted.scatter(-1, order, drop_sorted)
    kept = probs.masked_fill(drop, 0.0)
    return kept / kept.sum(dim=-1, keepdim=True)


# -- accounting ------------------------------------------------------------------------------------


def distribution_error(laws: torch.Tensor, tolerance: float) -> str | None:
    """Why rows (n, V) are not probability laws (a value not finite or negative, a row not summing to 1 within
    ``tolerance``), or None when they are. Written so that NaN fails every check."""
    if not bool(torch.isfinite(laws).all()):
        return "values that are not finite"
    if not bool((laws >= 0).all()):
        return "negative values"
    sums = laws.double().sum(dim=-1)
    if not bool(((sums - 1.0).abs() <= tolerance).all()):
        worst = float((sums - 1.0).abs().max())
        return f"a row whose sum is {worst:.3g} away from 1 (tolerance {tolerance:.3g})"
    return None


def l1(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Row-wise ‖p − q‖₁, (n,)."""
    return (p.double() - q.double()).abs().sum(dim=-1).float()


def acceptance_rate(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Row-wise α = Σ_x min(p(x), q(x)): the probability that a draft x ~ q is accepted against p."""
    return torch.minimum(p.double(), q.double()).sum(dim=-1).float()


def true_residual_mass(full: torch.Tensor, topk: TopK) -> torch.Tensor:
    """(n,) τ: the exact mass outside the ids that ``topk`` kept."""
    exact = full.double()
    kept = exact[topk.segment_index(), topk.ids]
    return (exact.sum(dim=-1) - _segment_sum(kept, topk.counts)).clamp_min(0.0).float()


def quantization_error(full: torch.Tensor, topk: TopK) -> torch.Tensor:
    """(n,) η = Σ_{kept} |p̃(x) − p(x)|: L1 error of the transmitted (quantized) top-K values."""
    kept = full.double()[topk.segment_index(), topk.ids]
    return _segment_sum((topk.probs.double() - kept).abs(), topk.counts).float()


@dataclass(frozen=True)
class BoundReport:
    """Per-position accounting of one aggregation against the exact distributions."""

    delta: torch.Tensor  # (n,) Δ = ‖p − p̂‖₁ of the aggregate
    bound: torch.Tensor  # (n,) 2 Σ w_i ε_i: the aggregation-bias bound
    weighted_epsilon: torch.Tensor  # (n,) Σ w_i ε_i with the exact ε_i = τ_i + η_i, probability mass
    weighted_tail: torch.Tensor  # (n,) Σ w_i τ_i: exact mass outside the kept ids (no quantization)
    per_worker_delta: torch.Tensor  # (M, n) ‖p_i − p̂_i‖₁
    per_worker_epsilon: torch.Tensor  # (M, n) exact ε_i = ‖p_i − p̃_i‖₁
    per_worker_reported: torch.Tensor | None  # (M, n) ε_i as the workers reported it, when they did
    alpha: torch.Tensor | None  # (n,) Σ min(p, q), when a draft law was given
    alpha_hat: torch.Tensor | None  # (n,) Σ min(p̂, q)
    tolerance: float  # float slack allowed on every check

    @property
    def drift(self) -> torch.Tensor | None:
        """(n,) |α − α̂|."""
        if self.alpha is None or self.alpha_hat is None:
            return None
        return (self.alpha - self.alpha_hat).abs()

    def violations(self) -> list[str]:
        """Human-readable list of every bound that fails (empty when all hold).

        Each check is written as "not (holds)", so that a NaN (say, from a worker's NaN law) counts as a violation.
        """
        out: list[str] = []
        t = self.tolerance
        per_worker_bound = 2 * self.per_worker_epsilon
        for i, pos in torch.nonzero(~(self.per_worker_delta <= per_worker_bound + t)).tolist():
            out.append(
                f"worker {i} position {pos}: ‖p_i − p̂_i‖₁ = {float(self.per_worker_delta[i, pos]):.3g}"
                f" > 2ε_i = {float(per_worker_bound[i, pos]):.3g}"
            )
        if self.per_worker_reported is not None:
            for i, pos in torch.nonzero(~(self.per_worker_reported >= self.per_worker_epsilon - t)).tolist():
                out.append(
                    f"worker {i} position {pos}: reported ε = {float(self.per_worker_reported[i, pos]):.3g}"
                    f" < exact ‖p_i − p̃_i‖₁ = {float(self.per_worker_epsilon[i, pos]):.3g}"
                )
        for pos in torch.nonzero(~(self.delta <= self.bound + t)).flatten().tolist():
            out.append(f"position {pos}: Δ = {float(self.delta[pos]):.3g} > {float(self.bound[pos]):.3g}")
        drift = self.drift
        if drift is not None:
            for pos in torch.nonzero(~(drift <= 0.5 * self.delta[: drift.numel()] + t)).flatten().tolist():
                out.append(
                    f"position {pos}: |α − α̂| = {float(drift[pos]):.3g} > ½Δ = {0.5 * float(self.delta[pos]):.3g}"
                )
        return out


def bound_report(
    full: Sequence[torch.Tensor],
    topks: Sequence[TopK],
    weights: Sequence[float],
    method: Reconstruction,
    draft: torch.Tensor | None = None,
    tolerance: float = 1e-5,
) -> BoundReport:
    """Compare the aggregate of reconstructions with the aggregate of the exact distributions.

    Bounds (per position), with ε_i = ‖p_i − p̃_i‖₁ = τ_i + η_i (tail mass outside the kept ids plus
    the quantization error of the kept values): ``‖p_i − p̂_i‖₁ ≤ 2ε_i``. Renorm: ``‖p̂ − p‖₁ ≤
    ‖p̂ − p̃‖₁ + ‖p̃ − p‖₁ = |1 − Σp̃| + ε ≤ 2ε`` since ``|Σp − Σp̃| ≤ ‖p − p̃‖₁``. Residual: the
    kept part costs η, the rest ``≤ τ + |1 − Σp̃| ≤ τ + ε``, in all ``≤ 2ε``. With exact values
    η = 0 and ε is the paper's residual mass. The aggregate is a convex combination, so ``Δ ≤
    2Σ w_i ε_i``; with both laws summing to 1, ``α = 1 − ½‖p − q‖₁`` gives ``|α − α̂| ≤ ½Δ``.
    """
    w = normalize_weights(weights)
    recon = [reconstruct(t, method) for t in topks]
    p = aggregate(full, w.tolist())
    p_hat = aggregate(recon, w.tolist())
    tail = torch.stack([true_residual_mass(f, t) for f, t in zip(full, topks, strict=True)])
    eps = tail + torch.stack([quantization_error(f, t) for f, t in zip(full, topks, strict=True)])
    reported = None
    if all(t.epsilon is not None for t in topks):
        reported = torch.stack([t.transmitted_epsilon() for t in topks])
    wf = w.float()[:, None]
    alpha = alpha_hat = None
    if draft is not None:
        rows = draft.shape[0]
        alpha = acceptance_rate(p[:rows], draft)
        alpha_hat = acceptance_rate(p_hat[:rows], draft)
    return BoundReport(
        delta=l1(p, p_hat),
        bound=2 * (wf * eps).sum(0),
        weighted_epsilon=(wf * eps).sum(0),
        weighted_tail=(wf * tail).sum(0),
        per_worker_delta=torch.stack([l1(f, r) for f, r in zip(full, recon, strict=True)]),
        per_worker_epsilon=eps,
        per_worker_reported=reported,
        alpha=alpha,
        alpha_hat=alpha_hat,
        tolerance=tolerance,
    )
