"""Token-recovery attackers against what the cloud sees.

Every attacker maps activations of test windows (n, q, H) to top-5 token guesses (n, q, 5) for the
q non-BOS positions' *current* tokens (except :func:`stock_tail`, which reads position j-1 to guess
token j - see :mod:`splitspec.privacy.activations`). Outcomes are then scored top-1 / top-5.

* baselines: the single most frequent attacker-train token (a frequency prior: the honest floor),
  the same per position-in-document bucket, and uniform guessing (reference only);
* ``nn-embed``: white-box nearest neighbour (cosine) against the public embedding matrix;
* ``mlp``: the paper's per-token MLP inverter (activation -> token logits), trained on
  attacker-train (activation, token) pairs;
* ``bigru``: a sequence-aware inverter, a bidirectional GRU over each window's activations;
* ``search``: white-box inversion with the *published* edge layers: an inverter proposes candidates,
  the published layers recompute h_k for each after the decoded prefix, the closest wins.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from splitspec.models.kv_cache import KVCache
from splitspec.models.stack import FullModel

log = logging.getLogger(__name__)

TOPK = 5
IGNORE = -100  # label of a position the loss skips (torch's cross-entropy default)


@dataclass(frozen=True)
class TrainConfig:
    """Training knobs of the learned inverters."""

    epochs: int = 3  # MLP passes over the attacker-train tokens
    seq_epochs: int = 6  # GRU passes over the attacker-train windows
    lr: float = 2e-3  # Adam learning rate
    batch_tokens: int = 256  # tokens per step for the MLP
    batch_windows: int = 4  # windows per step for the GRU
    mlp_hidden: int = 512  # width of the MLP's first hidden layer (the paper: 2048 for H = 4096)
    bottleneck: int = 256  # width of the last hidden layer before the (vocabulary-sized) output
    gru_hidden: int = 128  # GRU units per direction
    dropout: float = 0.1  # on hidden features during training
    seed: int = 0  # init and shuffling


# ---------------------------------------------------------------- baselines


def position_bucket(pos: np.ndarray) -> np.ndarray:
    """Log2 buckets of the token position within its document: 0, 1, 2-3, 4-7, ... (capped at 16)."""
    return np.minimum(np.floor(np.log2(np.asarray(pos, dtype=np.float64) + 1.0)).astype(np.int64), 16)


def frequency_prior(train_targets: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """The 5 most frequent attacker-train tokens, guessed everywhere."""
    ids, counts = np.unique(train_targets, return_counts=True)
    top = ids[np.argsort(-counts, kind="stable")[:TOPK]]
    top = np.pad(top, (0, TOPK - len(top)), mode="edge")
    return np.broadcast_to(top, (*shape, TOPK)).copy()


def positional_prior(train_targets: np.ndarray, train_pos: np.ndarray, test_pos: np.ndarray) -> np.ndarray:
    """Per position-in-document bucket, the 5 most frequent train tokens (global top-5 fills gaps)."""
    global_top = frequency_prior(train_targets.ravel(), (1,))[0]
    tb = position_bucket(train_pos).ravel()
    tt = train_targets.ravel()
    table: dict[int, np.ndarray] = {}
    for b in np.unique(tb):
        ids, counts = np.unique(tt[tb == b], return_counts=True)
        top = list(ids[np.argsort(-counts, kind="stable")[:TOPK]])
        top += [t for t in global_top if t not in top][: TOPK - len(top)]
        table[int(b)] = np.array(top[:TOPK])
    qb = position_bucket(test_pos)
    out = np.empty((*qb.shape, TOPK), dtype=np.int64)
    for b in np.unique(qb):
        out[qb == b] = table.get(int(b), global_top)
    return out


def uniform_rate(vocab_size: int, k: int) -> float:
    """Expected recovery of uniform guessing (reference only: nothing real is uniform)."""
    return min(1.0, k / vocab_size)


# ---------------------------------------------------------------- white-box nearest neighbour


@torch.no_grad()
def nearest_embedding(acts: np.ndarray, embedding: torch.Tensor, chunk: int = 4096) -> np.ndarray:
    """Top-5 cosine nearest rows of the public embedding matrix (V, H) for each activation."""
    emb = nn.functional.normalize(embedding.float(), dim=-1)
    flat = acts.reshape(-1, acts.shape[-1])
    out = np.empty((flat.shape[0], TOPK), dtype=np.int64)
    for s in range(0, flat.shape[0], chunk):
        a = nn.functional.normalize(torch.from_numpy(flat[s : s + chunk]).float(), dim=-1)
        out[s : s + chunk] = (a @ emb.T).topk(TOPK, dim=-1).indices.numpy()
    return out.reshape(*acts.shape[:-1], TOPK)


# ---------------------------------------------------------------- learned inverters


class _Standardize(nn.Module):
    """Fixed per-feature standardisation fitted on the attacker's training activations."""

    mean: torch.Tensor
    std: torch.Tensor

    def __init__(self, mean: torch.Tensor, std: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("mean", mean)
        self.register_buffer("std", std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / self.std


class MLPInverter(nn.Module):
    """Per-token inverter: H -> width -> bottleneck -> classes (the paper's 3-layer MLP, scaled down)."""

    def __init__(
        self, scaler: _Standardize, hidden_size: int, width: int, bottleneck: int, classes: int, dropout: float
    ) -> None:
        super().__init__()
        self.scaler = scaler
        self.net = nn.Sequential(
            nn.Linear(hidden_size, width),
            nn.GELU(),
            nn.Dropout(dropout),
            nn.Linear(width, bottleneck),
            nn.GELU(),
            nn.Dropout(dropout),
            nn.Linear(bottleneck, classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(self.scaler(x))
        return out


class GRUInverter(nn.Module):
    """Sequence-aware inverter: a bidirectional GRU over a window of activations, per-token logits."""

    def __init__(
        self, scaler: _Standardize, hidden_size: int, units: int, bottleneck: int, classes: int, dropout: float
    ) -> None:
        super().__init__()
        self.scaler = scaler
        self.proj = nn.Linear(hidden_size, 2 * units)
        self.gru = nn.GRU(2 * units, units, batch_first=True, bidirectional=True)
        self.drop = nn.Dropout(dropout)
        self.mix = nn.Linear(4 * units, bottleneck)
        self.out = nn.Linear(bottleneck, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = nn.functional.gelu(self.proj(self.scaler(x)))  # (B, q, 2u)
        seq, _ = self.gru(p)  # (B, q, 2u)
        mixed = nn.functional.gelu(self.mix(self.drop(torch.cat([p, seq], dim=-1))))
        out: torch.Tensor = self.out(self.drop(mixed))
        return out


@dataclass
class TrainedInverter:
    """A learned inverter and the token ids of its output classes."""

    kind: str  # "mlp" or "bigru"
    model: nn.Module
    classes: np.ndarray  # (C,) token id of each output class
    final_loss: float  # mean training cross-entropy of the last epoch (nats)

    @torch.no_grad()
    def predict_topk(self, acts: np.ndarray, k: int = TOPK, batch: int = 64) -> np.ndarray:
        """(n, q, H) -> (n, q, k) token ids, best first (the best class repeats if there are < k)."""
        self.model.eval()
        tops: list[np.ndarray] = []
        for s in range(0, acts.shape[0], batch):
            x = torch.from_numpy(acts[s : s + batch]).float()
            logits = self.model(x)
            kk = min(k, logits.shape[-1])
            idx = logits.topk(kk, dim=-1).indices.numpy()
            if kk < k:
                idx = np.concatenate([idx, np.repeat(idx[..., :1], k - kk, axis=-1)], axis=-1)
            tops.append(self.classes[idx])
        return np.concatenate(tops)

    def predict_top5(self, acts: np.ndarray) -> np.ndarray:
        """(n, q, H) -> (n, q, 5) token ids."""
        return self.predict_topk(acts, TOPK)


def _scaler(acts: np.ndarray) -> _Standardize:
    flat = torch.from_numpy(acts.reshape(-1, acts.shape[-1])).float()
    return _Standardize(flat.mean(0), flat.std(0).clamp_min(1e-6))


def train_inverter(
    kind: str, acts: np.ndarray, targets: np.ndarray, config: TrainConfig, desc: str = ""
) -> TrainedInverter:
    """Train an ``"mlp"`` or ``"bigru"`` inverter on activations (n, q, H) and token targets (n, q).

    A negative target marks a position without a label (it is skipped by the loss).
    """
    torch.manual_seed(config.seed)
    rng = np.random.default_rng(config.seed)
    known = targets >= 0
    if not known.any():
        raise ValueError("no labelled position to train on")
    classes = np.unique(targets[known])
    labels = np.where(known, np.searchsorted(classes, np.where(known, targets, classes[0])), IGNORE)
    hidden_size = acts.shape[-1]
    scaler = _scaler(acts)
    model: nn.Module
    if kind == "mlp":
        model = MLPInverter(scaler, hidden_size, config.mlp_hidden, config.bottleneck, len(classes), config.dropout)
        x_all = torch.from_numpy(acts.reshape(-1, hidden_size)).float()
        y_all = torch.from_numpy(labels.reshape(-1)).long()
        step_size = config.batch_tokens
    elif kind == "bigru":
        model = GRUInverter(scaler, hidden_size, config.gru_hidden, config.bottleneck, len(classes), config.dropout)
        x_all = torch.from_numpy(acts).float()
        y_all = torch.from_numpy(labels).long()
        step_size = config.batch_windows
    else:
        raise ValueError(f"unknown inverter kind {kind!r}")
    opt = torch.optim.Adam(model.parameters(), lr=config.lr)
    n = x_all.shape[0]
    epochs = config.epochs if kind == "mlp" else config.seq_epochs
    steps_per_epoch = math.ceil(n / step_size)
    total = epochs * steps_per_epoch
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=config.lr, total_steps=total, pct_start=0.1)
    model.train()
    last = float("nan")
    with tqdm(total=total, desc=desc or kind, leave=False, mininterval=2.0) as bar:
        for _ in range(epochs):
            order = torch.from_numpy(rng.permutation(n))
            losses: list[float] = []
            for s in range(0, n, step_size):
                idx = order[s : s + step_size]
                if not (y_all[idx] != IGNORE).any():
                    continue  # a batch of unlabelled positions only: nothing to learn
                logits = model(x_all[idx])
                loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y_all[idx].reshape(-1))
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                sched.step()
                losses.append(loss.item())
                bar.update(1)
            last = float(np.mean(losses))
    log.info("%s: %d classes, final train CE %.3f", desc or kind, len(classes), last)
    return TrainedInverter(kind, model.eval(), classes, last)


# ---------------------------------------------------------------- white-box search


@torch.no_grad()
def whitebox_search_top5(
    public: FullModel, observed: np.ndarray, k: int, candidates: np.ndarray, first: np.ndarray
) -> np.ndarray:
    """Invert h_k with the *published* first k layers, position by position.

    ``observed`` (n, W+1, H) holds what the cloud saw for BOS-led windows, ``first`` (n,) each window's
    BOS token (no secret: the same for every window, and the edge's tokenizer is public); ``candidates`` (n, W, K)
    token guesses per position (from a learned inverter). At each position j every window tries
    its K candidates after its already-decoded prefix (one tree step: all candidates are children
    of the prefix), ranks them by cosine distance between the recomputed and the observed h_k, and
    commits the best. With stock edge weights the true token reproduces h_k exactly, so recovery
    reaches the candidate set's recall; against a diverged edge the match is only approximate.
    Returns (n, W, 5) token ids.
    """
    n, w1, _ = observed.shape
    n_cand = candidates.shape[-1]
    stack = public.layers.first(k)
    obs = nn.functional.normalize(torch.from_numpy(observed).float(), dim=-1)
    cand = torch.from_numpy(candidates).long()
    out = np.empty((n, w1 - 1, TOPK), dtype=np.int64)
    cache = KVCache()
    if first.shape != (n,):
        raise ValueError(f"need one first token per window ({n}), got shape {first.shape}")
    one = torch.zeros(1, dtype=torch.int32)
    stack(public.embed(torch.from_numpy(first).long()[:, None]), one, one - 1, cache)
    chosen = torch.empty(n, dtype=torch.long)
    for j in tqdm(range(1, w1), desc=f"search h{k}", leave=False, mininterval=2.0):
        positions = torch.full((n_cand,), j, dtype=torch.int32)
        parents = torch.full((n_cand,), -1, dtype=torch.int32)
        h = stack(public.embed(cand[:, j - 1]), positions, parents, cache)  # (n, K, H)
        sim = (nn.functional.normalize(h.float(), dim=-1) * obs[:, j : j + 1]).sum(-1)  # (n, K)
        order = sim.argsort(dim=-1, descending=True)
        ranked = cand[:, j - 1].gather(1, order)
        # Keep the ranking's distinct tokens (candidates may repeat).
        for b in range(n):
            seen: list[int] = []
            for t in ranked[b].tolist():
                if t not in seen:
                    seen.append(t)
                if len(seen) == TOPK:
                    break
            seen += [seen[0]] * (TOPK - len(seen))
            out[b, j - 1] = seen
        chosen = ranked[:, 0]
        cache.truncate(j)
        stack(public.embed(chosen[:, None]), positions[:1], parents[:1], cache)
    return out


def score(top5: np.ndarray, targets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-token top-1 and top-5 hits (bool arrays shaped like ``targets``)."""
    hit1 = top5[..., 0] == targets
    hit5 = (top5 == targets[..., None]).any(axis=-1)
    return hit1, hit5
