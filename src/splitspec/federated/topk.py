"""Top-K compression of next-token distributions, reconstruction, aggregation and error accounting.

Pure torch, no I/O. The pieces of SpecFed's uplink:

* :func:`select_topk` keeps, per position, the K most likely tokens: a fixed K, or the smallest K
  whose residual mass ``ε = 1 − Σ top-K`` is at most a target ε (adaptive K), capped at ``max_k``.
* :func:`encode_topk` / :func:`decode_topk` turn a :class:`TopK` into a compact byte stream and a
  probability tensor (the wire representation), validating everything on the way back.
* :func:`reconstruct` rebuilds a full distribution: ``renorm`` (top-K renormalised, zero
  elsewhere) or ``residual`` (top-K kept, the residual mass spread uniformly over the other
  ``|V| − K`` tokens).
* :func:`aggregate` mixes reconstructed worker distributions with weights ``w_i``.
* :func:`bound_report` checks the SpecFed bounds when the exact distributions are known:
  ``‖p_i − p̂_i‖₁ ≤ 2ε_i``, ``Δ = ‖p − p̂‖₁ ≤ 2Σ w_i ε_i`` and ``|α − α̂| ≤ ½Δ`` with
  ``α = Σ_x min(p(x), q(x))`` the speculative acceptance rate against a draft law q.

Byte cost of one position with K kept tokens (see :func:`encode_topk`):

* ids: one LEB128 varint for K, then the ids sorted ascending and delta-coded (first id as is,
  then ``gap − 1``), one varint each: 1 byte for a gap <= 128, 2 bytes up to 16 384, 3 bytes up
  to 2 097 152. For K ids spread over a vocabulary of V the mean gap is V/K, so K = 1 % of V
  costs ~1 byte per id; K = 100 % costs exactly 1 byte per id.
* probabilities: ``float16`` (2 bytes per id; relative error <= 2⁻¹¹, absolute <= 2⁻²⁵ below
  6·10⁻⁵) or ``float32`` (4 bytes per id, exact).
* the byte stream travels as int32 words (the frame dtype whitelist has no uint8): <= 3 bytes of
  zero padding per message, not per position.

So fixed K=320 of a 32 000-token vocabulary costs ~1 + 320·(1 + 2) ≈ 960 bytes per position and
worker with float16, against 128 000 bytes for the full float32 distribution.

Quantization adds an L1 error ``η = Σ_{top-K} |p̃ − p|`` that the bounds must absorb: with
quantized values the per-worker bound becomes ``‖p_i − p̂_i‖₁ ≤ 2(ε_i + η_i)`` (proof sketch in
:func:`bound_report`); with ``float32`` η is float rounding only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from splitspec.exceptions import BadTensor, ConfigError

Reconstruction = Literal["renorm", "residual"]
ProbCodec = Literal["float16", "float32"]
RECONSTRUCTIONS: tuple[str, ...] = ("renorm", "residual")
PROB_CODECS: dict[str, torch.dtype] = {"float16": torch.float16, "float32": torch.float32}
MAX_VARINT_BYTES = 4  # ids and counts are < 2**28: a larger vocabulary is refused
MAX_VOCAB = 1 << 28  # tokens
PROB_SUM_SLACK = 1e-2  # decoded top-K masses may exceed 1 by this much (quantization), no more


@dataclass(frozen=True)
class TopKPolicy:
    """How many tokens a worker keeps per position."""

    k: int | None = None  # fixed number of tokens per position; None = adaptive
    target_epsilon: float | None = None  # adaptive: smallest K with residual mass <= this (probability)
    max_k: int = 4096  # cap on K per position, tokens (applies to adaptive K; fixed K is capped at |V|)

    def __post_init__(self) -> None:
        if (self.k is None) == (self.target_epsilon is None):
            raise ConfigError("give exactly one of a fixed K and a target epsilon")
        if self.k is not None and self.k < 1:
            raise ConfigError(f"K must be at least 1, got {self.k}")
        if self.target_epsilon is not None and not 0.0 <= self.target_epsilon < 1.0:
            raise ConfigError(f"target epsilon must be in [0, 1), got {self.target_epsilon}")
        if self.max_k < 1:
            raise ConfigError(f"max_k must be at least 1, got {self.max_k}")


@dataclass(frozen=True)
class TopK:
    """Ragged top-K of n positions: ``counts[j]`` ids and probabilities for position j.

    ``ids`` and ``probs`` are flat, position after position, ids ascending within a position.
    """

    vocab_size: int  # |V|, tokens
    counts: torch.Tensor  # (n,) int64, K per position
    ids: torch.Tensor  # (ΣK,) int64, ascending within each position
    probs: torch.Tensor  # (ΣK,) float32 probabilities of those ids

    @property
    def positions(self) -> int:
        return int(self.counts.numel())

    def residual_mass(self) -> torch.Tensor:
        """(n,) ε = 1 − Σ top-K, clamped at 0 (quantized masses may sum slightly above 1)."""
        return (1.0 - _segment_sum(self.probs.double(), self.counts)).clamp_min(0.0).float()

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


def select_topk(probs: torch.Tensor, policy: TopKPolicy) -> TopK:
    """Keep each row's K most likely tokens of ``probs`` (n, V); ids come out ascending."""
    if probs.dim() != 2:
        raise ValueError(f"probs must be (n, V), got {tuple(probs.shape)}")
    n, vocab = probs.shape
    if policy.k is not None:
        counts = torch.full((n,), min(policy.k, vocab), dtype=torch.long)
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


# -- compact encoding ------------------------------------------------------------------------------


def _varint_encode(values: torch.Tensor) -> bytes:
    """LEB128 varints (7 bits per byte, high bit = more follows) of non-negative ints < 2**28."""
    if values.numel() == 0:
        return b""
    v = values.long()
    if bool((v < 0).any()) or bool((v >= 1 << (7 * MAX_VARINT_BYTES)).any()):
        raise ValueError("varint values must be in [0, 2**28)")
    nbytes = torch.ones_like(v)
    for j in range(1, MAX_VARINT_BYTES):
        nbytes += (v >= (1 << (7 * j))).long()
    shifts = torch.arange(MAX_VARINT_BYTES) * 7
    groups = (v[:, None] >> shifts) & 0x7F
    more = torch.arange(MAX_VARINT_BYTES)[None, :] < (nbytes[:, None] - 1)
    groups = groups | (more.long() << 7)
    present = torch.arange(MAX_VARINT_BYTES)[None, :] < nbytes[:, None]
    out: bytes = groups[present].to(torch.uint8).numpy().tobytes()
    return out


def _varint_decode(stream: torch.Tensor) -> torch.Tensor:
    """uint8 stream -> int64 values; refuses truncated, over-long and non-canonical varints."""
    if stream.numel() == 0:
        return torch.zeros(0, dtype=torch.long)
    b = stream.long()
    last = (b & 0x80) == 0
    if not bool(last[-1]):
        raise BadTensor("top-K stream ends inside a varint")
    value_index = torch.cumsum(last.long(), 0) - last.long()  # which value each byte belongs to
    n_values = int(last.sum())
    starts = torch.zeros(n_values, dtype=torch.long)
    ends = torch.nonzero(last).flatten()
    starts[1:] = ends[:-1] + 1
    lengths = ends - starts + 1
    if bool((lengths > MAX_VARINT_BYTES).any()):
        raise BadTensor(f"top-K stream holds a varint longer than {MAX_VARINT_BYTES} bytes")
    if bool(((lengths > 1) & (b[ends] == 0)).any()):
        raise BadTensor("top-K stream holds a non-canonical varint")
    within = torch.arange(b.numel()) - starts[value_index]
    values = torch.zeros(n_values, dtype=torch.long)
    return values.index_add_(0, value_index, (b & 0x7F) << (7 * within))


def encode_topk(topk: TopK, prob_codec: ProbCodec = "float16") -> tuple[bytes, torch.Tensor]:
    """The wire form of ``topk``: (varint byte stream of counts and id deltas, probabilities).

    Stream layout: n varints K_1..K_n, then for each position its K ids ascending, the first as
    is and each later one as ``id − previous − 1``.
    """
    if prob_codec not in PROB_CODECS:
        raise ConfigError(f"probability codec must be one of {sorted(PROB_CODECS)}, got {prob_codec!r}")
    counts = topk.counts.long()
    ids = topk.ids.long()
    first = torch.zeros(ids.numel(), dtype=torch.bool)
    starts = torch.cumsum(counts, 0) - counts
    first[starts[counts > 0]] = True
    previous = torch.cat([torch.zeros(1, dtype=torch.long), ids[:-1]]) if ids.numel() else ids
    deltas = torch.where(first, ids, ids - previous - 1)
    stream = _varint_encode(torch.cat([counts, deltas]))
    return stream, topk.probs.to(PROB_CODECS[prob_codec])


def decode_topk(stream: bytes | torch.Tensor, probs: torch.Tensor, positions: int, vocab_size: int) -> TopK:
    """Inverse of :func:`encode_topk`, validating every field a peer could get wrong."""
    if not 1 <= vocab_size <= MAX_VOCAB:
        raise BadTensor(f"vocabulary size {vocab_size} is out of range")
    if isinstance(stream, bytes):
        raw = torch.frombuffer(bytearray(stream), dtype=torch.uint8) if stream else torch.zeros(0, dtype=torch.uint8)
    else:
        raw = stream
    if raw.dtype != torch.uint8 or raw.dim() != 1:
        raise BadTensor("top-K stream must be a 1-D byte tensor")
    if len(raw) == 0 and positions > 0:
        raise BadTensor("top-K stream is empty")
    values = _varint_decode(raw)
    if values.numel() < positions:
        raise BadTensor(f"top-K stream holds {values.numel()} values, fewer than {positions} counts")
    counts, deltas = values[:positions], values[positions:]
    if bool(((counts < 1) | (counts > vocab_size)).any()):
        raise BadTensor(f"every K must be in [1, {vocab_size}]")
    total = int(counts.sum())
    if deltas.numel() != total:
        raise BadTensor(f"top-K stream holds {deltas.numel()} ids, the counts say {total}")
    if probs.dim() != 1 or probs.numel() != total:
        raise BadTensor(f"top-K probabilities must be ({total},), got {tuple(probs.shape)}")
    if probs.dtype not in PROB_CODECS.values():
        raise BadTensor(f"top-K probabilities must be float16 or float32, got {probs.dtype}")
    starts = torch.cumsum(counts, 0) - counts
    first = torch.zeros(total, dtype=torch.bool)
    first[starts] = True
    steps = torch.where(first, deltas, deltas + 1)
    running = torch.cumsum(steps, 0)
    base = torch.repeat_interleave(running[starts] - steps[starts], counts)
    ids = running - base
    if total and int(ids.max()) >= vocab_size:
        raise BadTensor(f"a top-K id is outside the vocabulary of {vocab_size}")
    p = probs.float()
    if not bool(torch.isfinite(p).all()) or bool((p < 0).any()) or bool((p > 1).any()):
        raise BadTensor("top-K probabilities must be finite and in [0, 1]")
    topk = TopK(vocab_size=vocab_size, counts=counts, ids=ids, probs=p)
    mass = _segment_sum(p.double(), counts)
    if bool((mass > 1.0 + PROB_SUM_SLACK).any()):
        raise BadTensor("top-K probabilities of a position sum above 1")
    return topk


def stream_to_words(stream: bytes) -> torch.Tensor:
    """Pack a byte stream into int32 words (zero padded) for the frame dtype whitelist."""
    padded = stream + b"\0" * (-len(stream) % 4)
    if not padded:
        return torch.zeros(0, dtype=torch.int32)
    return torch.frombuffer(bytearray(padded), dtype=torch.int32).clone()


def words_to_stream(words: torch.Tensor, nbytes: int) -> torch.Tensor:
    """Inverse of :func:`stream_to_words`: the first ``nbytes`` bytes; padding must be zero."""
    if words.dtype != torch.int32 or words.dim() != 1:
        raise BadTensor("top-K stream words must be a 1-D int32 tensor")
    raw = words.contiguous().view(torch.uint8)
    if not 4 * words.numel() - 3 <= nbytes <= 4 * words.numel() or (nbytes == 0) != (words.numel() == 0):
        raise BadTensor(f"stream length {nbytes} does not fit {words.numel()} words")
    if bool((raw[nbytes:] != 0).any()):
        raise BadTensor("top-K stream padding must be zero")
    return raw[:nbytes]


def payload_bytes(stream: bytes, probs: torch.Tensor) -> int:
    """Bytes a top-K reply carries in payload (stream padded to words + probabilities)."""
    return len(stream) + (-len(stream) % 4) + probs.numel() * probs.element_size()


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
    return (out / total).float()


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


def l1(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Row-wise ‖p − q‖₁, (n,)."""
    return (p.double() - q.double()).abs().sum(dim=-1).float()


def acceptance_rate(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Row-wise α = Σ_x min(p(x), q(x)): the probability that a draft x ~ q is accepted against p."""
    return torch.minimum(p.double(), q.double()).sum(dim=-1).float()


def true_residual_mass(full: torch.Tensor, topk: TopK) -> torch.Tensor:
    """(n,) ε computed from the exact distribution over the ids that ``topk`` kept."""
    kept = full.double()[topk.segment_index(), topk.ids]
    return (1.0 - _segment_sum(kept, topk.counts)).clamp_min(0.0).float()


def quantization_error(full: torch.Tensor, topk: TopK) -> torch.Tensor:
    """(n,) η = Σ_{kept} |p̃(x) − p(x)|: L1 error of the transmitted (quantized) top-K values."""
    kept = full.double()[topk.segment_index(), topk.ids]
    return _segment_sum((topk.probs.double() - kept).abs(), topk.counts).float()


@dataclass(frozen=True)
class BoundReport:
    """Per-position accounting of one aggregation against the exact distributions."""

    delta: torch.Tensor  # (n,) Δ = ‖p − p̂‖₁ of the aggregate
    bound: torch.Tensor  # (n,) 2 Σ w_i (ε_i + η_i): the aggregation-bias bound
    weighted_epsilon: torch.Tensor  # (n,) Σ w_i ε_i, probability mass
    per_worker_delta: torch.Tensor  # (M, n) ‖p_i − p̂_i‖₁
    per_worker_bound: torch.Tensor  # (M, n) 2 (ε_i + η_i)
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
        """Human-readable list of every bound that fails (empty when all hold)."""
        out: list[str] = []
        t = self.tolerance
        for j in torch.nonzero(self.per_worker_delta > self.per_worker_bound + t).tolist():
            i, pos = j
            out.append(
                f"worker {i} position {pos}: ‖p_i − p̂_i‖₁ = {float(self.per_worker_delta[i, pos]):.3g}"
                f" > 2(ε_i + η_i) = {float(self.per_worker_bound[i, pos]):.3g}"
            )
        for pos in torch.nonzero(self.delta > self.bound + t).flatten().tolist():
            out.append(f"position {pos}: Δ = {float(self.delta[pos]):.3g} > {float(self.bound[pos]):.3g}")
        drift = self.drift
        if drift is not None:
            for pos in torch.nonzero(drift > 0.5 * self.delta[: drift.numel()] + t).flatten().tolist():
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

    Bounds (per position): ``‖p_i − p̂_i‖₁ ≤ 2(ε_i + η_i)`` where ε_i is the exact mass outside the
    kept ids and η_i the quantization error of the kept values. Renorm: ``‖p̂ − p‖₁ ≤
    ‖p̂ − p̃‖₁ + η + ε = |1 − Σp̃| + η + ε ≤ 2ε + 2η``. Residual: the kept part costs η, the rest
    ``≤ ε + ε̃ ≤ 2ε + η``. The aggregate is a convex combination, so ``Δ ≤ 2Σ w_i(ε_i + η_i)``;
    with both laws summing to 1, ``α = 1 − ½‖p − q‖₁`` gives ``|α − α̂| ≤ ½Δ``.
    """
    w = normalize_weights(weights)
    recon = [reconstruct(t, method) for t in topks]
    p = aggregate(full, w.tolist())
    p_hat = aggregate(recon, w.tolist())
    eps = torch.stack([true_residual_mass(f, t) for f, t in zip(full, topks, strict=True)])
    eta = torch.stack([quantization_error(f, t) for f, t in zip(full, topks, strict=True)])
    per_worker_delta = torch.stack([l1(f, r) for f, r in zip(full, recon, strict=True)])
    per_worker_bound = 2 * (eps + eta)
    wf = w.float()[:, None]
    alpha = alpha_hat = None
    if draft is not None:
        rows = draft.shape[0]
        alpha = acceptance_rate(p[:rows], draft)
        alpha_hat = acceptance_rate(p_hat[:rows], draft)
    return BoundReport(
        delta=l1(p, p_hat),
        bound=(wf * per_worker_bound).sum(0),
        weighted_epsilon=(wf * eps).sum(0),
        per_worker_delta=per_worker_delta,
        per_worker_bound=per_worker_bound,
        alpha=alpha,
        alpha_hat=alpha_hat,
        tolerance=tolerance,
    )
