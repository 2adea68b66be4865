"""Defences of what the cloud sees, each with one knob, trained by ``splitspec diverge``.

* **Calibrated send noise** (``noise_scale`` = σ): the edge sends h_d + σ · rms(h_d) · ε with
  ε ~ N(0, I) drawn fresh per token, where rms is the token's own root-mean-square activation
  (so σ is a noise-to-signal ratio, independent of the layer's scale). The trunk sees only the
  noisy state; the edge's tail (and head) are trained *with* the noise so they tolerate it.
  The output side (what the trunk returns) is a function of the noisy state, so it is covered too.
* **Adversarial divergence** (``adversary_weight`` = λ): an inverter in the loop. Per-token
  probes read the state sent up (input side) and the state returned (output side) and learn to
  name the current token; they are updated on the edge's current activations, alternating with
  the edge. The edge pays λ · relu(CE_prior - CE_probe) per side: it is pushed until the probe
  does no better than the token-frequency prior (CE_prior), and gets no reward for making the
  probe confidently *wrong* (that would still leak).
* **Scale cap** (``max_scale`` = c, on for every divergence): left alone, the adversary (and, more
  slowly, the distance hinge of the plain divergence) games its probes by inflating the states'
  scale, which starves the trunk's own contribution to the residual stream and ruins perplexity
  (x80 RMS in 30 steps on a tiny model). The edge pays ``SCALE_CAP_WEIGHT`` per unit of
  relu(|log(rms(h) / rms(h_stock))| - log c), per token and side, where h_stock is the published
  model's state on the same tokens (before the send noise on the input side).

Both knobs act in :func:`splitspec.privacy.diverge.diverge`; σ is also written to the divergence
record so the serving edge adds the same noise (:func:`noise_for_tokens`). The per-token noise is
a keyed function of the token's prefix, so resending the same prefix (a replay after a reconnect,
a chat turn's history) yields the *same* noise and the cloud cannot average it away.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from splitspec.privacy.defence_config import DefenceConfig

SCALE_CAP_WEIGHT = 100.0  # nats per unit of log-scale beyond the cap: a wall the adversary cannot buy its way through


def token_rms(hidden: torch.Tensor) -> torch.Tensor:
    """Per-token root-mean-square activation (..., H) -> (..., 1)."""
    return hidden.float().pow(2).mean(-1, keepdim=True).sqrt().to(hidden.dtype)


def scale_excess(hidden: torch.Tensor, reference: torch.Tensor, max_scale: float) -> torch.Tensor:
    """Mean over tokens of relu(|log(rms(h) / rms(h_ref))| - log c) for states (..., H): 0 within the cap."""
    if math.isinf(max_scale):
        return torch.zeros(())
    log_ratio = torch.log(token_rms(hidden).clamp_min(1e-6)) - torch.log(token_rms(reference).clamp_min(1e-6))
    return torch.relu(log_ratio.abs() - math.log(max_scale)).mean()


def add_send_noise(hidden: torch.Tensor, scale: float, noise: torch.Tensor | None = None) -> torch.Tensor:
    """h + σ · rms(h) · ε; ``noise`` supplies ε (same shape as ``hidden``), else it is drawn from torch's RNG."""
    if scale == 0:
        return hidden
    eps = torch.randn_like(hidden) if noise is None else noise.to(hidden.dtype)
    return hidden + scale * token_rms(hidden) * eps


def prefix_digests(key: bytes, tokens: Sequence[int], parents: Sequence[int], base: bytes) -> list[bytes]:
    """Keyed digest of every query token's whole prefix (committed history ``base`` + its tree path)."""
    out: list[bytes] = []
    for tok, par in zip(tokens, parents, strict=True):
        prev = base if par < 0 else out[par]
        out.append(hashlib.blake2b(prev + int(tok).to_bytes(8, "little"), key=key, digest_size=16).digest())
    return out


def noise_for_tokens(digests: Sequence[bytes], hidden_size: int) -> torch.Tensor:
    """ε (q, H): standard normal noise, a deterministic function of each token's prefix digest."""
    rows = [np.random.default_rng(int.from_bytes(d, "little")).standard_normal(hidden_size) for d in digests]
    return torch.from_numpy(np.stack(rows)).float() if rows else torch.zeros(0, hidden_size)


class TokenProbe(nn.Module):
    """The in-the-loop adversary: per-token LayerNorm -> MLP -> token logits."""

    def __init__(self, hidden_size: int, width: int, vocab_size: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.LayerNorm(hidden_size, elementwise_affine=False),
            nn.Linear(hidden_size, width),
            nn.GELU(),
            nn.Linear(width, vocab_size),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(x)
        return out


def probe_classes(tokens: np.ndarray, vocab_size: int, n_classes: int) -> np.ndarray:
    """(V,) class of each token id: the n_classes - 1 most frequent ``tokens`` get one each, the rest share one."""
    counts = np.bincount(tokens.ravel(), minlength=vocab_size)
    order = np.argsort(-counts, kind="stable")[: n_classes - 1]
    out = np.full(vocab_size, n_classes - 1, dtype=np.int64)
    out[order] = np.arange(len(order))
    return out


def prior_cross_entropy(labels: np.ndarray, n_classes: int) -> float:
    """Cross-entropy (nats) of the add-one class prior on ``labels``: what a blind guesser pays."""
    counts = np.bincount(labels.ravel(), minlength=n_classes).astype(np.float64) + 1.0
    p = counts / counts.sum()
    return float(-np.log(p[labels.ravel()]).mean())


class Adversary:
    """Probes for both sides and their optimiser; :meth:`fit` learns, :meth:`penalty` charges the edge.

    The probes name the current token among the ``adversary_classes - 1`` most frequent tokens of the
    edge's training text (one more class for the rest): a cheap stand-in for a full-vocabulary
    inverter that covers most of the text.
    """

    def __init__(self, hidden_size: int, train_tokens: np.ndarray, vocab_size: int, config: DefenceConfig) -> None:
        self.config = config
        self.class_of = torch.from_numpy(probe_classes(train_tokens, vocab_size, config.adversary_classes))
        self.prior_ce = prior_cross_entropy(
            self.class_of[torch.from_numpy(train_tokens)].numpy(), config.adversary_classes
        )
        self.probes = nn.ModuleDict(
            {
                side: TokenProbe(hidden_size, config.adversary_width, config.adversary_classes)
                for side in ("input", "output")
            }
        )
        self.opt = torch.optim.Adam(self.probes.parameters(), lr=config.adversary_lr)

    def _ce(self, side: str, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        logits = self.probes[side](hidden)
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), self.class_of[tokens].reshape(-1))

    def fit(self, views: dict[str, torch.Tensor], tokens: torch.Tensor) -> dict[str, float]:
        """``adversary_steps`` updates of each probe on detached views (B, q, H) of ``tokens`` (B, q); last CEs."""
        self.probes.train()
        last: dict[str, float] = {}
        for _ in range(self.config.adversary_steps):
            ces = {side: self._ce(side, h.detach(), tokens) for side, h in views.items()}
            self.opt.zero_grad(set_to_none=True)
            sum(ces.values(), torch.zeros(())).backward()
            self.opt.step()
            last = {side: float(ce.detach()) for side, ce in ces.items()}
        return last

    def penalty(self, views: dict[str, torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
        """λ · Σ_sides relu(CE_prior - CE_probe): gradients reach the edge, not the probes."""
        for p in self.probes.parameters():
            p.requires_grad_(False)
        try:
            terms = [torch.relu(self.prior_ce - self._ce(side, h, tokens)) for side, h in views.items()]
        finally:
            for p in self.probes.parameters():
                p.requires_grad_(True)
        return self.config.adversary_weight * sum(terms, torch.zeros(()))
