"""T2 attackers: a cloud that adapts to a defended deployment *without* ever seeing its text.

The T2 cloud holds (i) the activations it received from the deployment on its users' text
(:class:`Traffic`: activations only, by construction no token ids), (ii) the published weights,
so it can compute the stock view of any text it likes (``public_view``), and (iii) a stock
inverter trained on public text (a T1 attacker). From these:

* :func:`self_train` - pseudo-labelling. The stock inverter is first re-standardised on the
  traffic's own per-feature mean and std (moment alignment), then labels the traffic; its most
  confident guesses become training labels for a fresh inverter on the *deployed* activations, and
  the new inverter relabels the traffic for the next round.
* :func:`align` - a map from deployed to stock activations. The traffic's pseudo-text (the
  re-standardised stock inverter's guesses) is run through the published layers; a ridge
  regression from the deployed activations to those stock activations is fitted, pseudo-labels
  are refreshed through the map, and the map refitted. The stock inverter then reads mapped
  activations.

Neither function accepts token ids of the traffic: the only tokens they touch are their own
guesses and public text (the test suite checks that a token only the traffic contains is never
produced). T3 (chosen plaintext, labelled deployment pairs) is simply
:func:`~splitspec.privacy.attackers.train_inverter` on labelled deployed activations.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from splitspec.privacy.attackers import TOPK, TrainConfig, TrainedInverter, _scaler, _Standardize, train_inverter

log = logging.getLogger(__name__)

PublicView = Callable[[np.ndarray], np.ndarray]  # BOS-led token windows (n, q+1) -> stock activations (n, q+1, H)


@dataclass(frozen=True)
class Traffic:
    """What the cloud received from the deployment on its users' windows: activations, nothing else."""

    acts: np.ndarray  # (n, q, H) float32 at the non-BOS positions of each window

    def __post_init__(self) -> None:
        if self.acts.ndim != 3 or not np.issubdtype(self.acts.dtype, np.floating):
            raise TypeError(f"traffic must be float activations (n, q, H), got {self.acts.dtype} {self.acts.shape}")


@torch.no_grad()
def guesses(inverter: TrainedInverter, acts: np.ndarray, batch: int = 64) -> tuple[np.ndarray, np.ndarray]:
    """Top-1 token ids (n, q) and their probabilities (n, q) under ``inverter``."""
    inverter.model.eval()
    ids: list[np.ndarray] = []
    probs: list[np.ndarray] = []
    for s in range(0, acts.shape[0], batch):
        p = torch.softmax(inverter.model(torch.from_numpy(acts[s : s + batch]).float()), dim=-1)
        top = p.max(dim=-1)
        ids.append(inverter.classes[top.indices.numpy()])
        probs.append(top.values.numpy())
    return np.concatenate(ids), np.concatenate(probs)


def restandardised(inverter: TrainedInverter, acts: np.ndarray) -> TrainedInverter:
    """A copy of ``inverter`` whose input standardisation is refitted on ``acts`` (moment alignment)."""
    model = copy.deepcopy(inverter.model)
    scaler = model.get_submodule("scaler")
    if not isinstance(scaler, _Standardize):
        raise TypeError(f"a {inverter.kind} inverter without an input standardisation cannot be re-standardised")
    scaler.load_state_dict(_scaler(acts).state_dict())
    return TrainedInverter(inverter.kind, model.eval(), inverter.classes, inverter.final_loss)


def confident_labels(ids: np.ndarray, probs: np.ndarray, keep: float) -> np.ndarray:
    """``ids`` where the probability is among the top ``keep`` fraction, -1 (unlabelled) elsewhere."""
    threshold = np.quantile(probs, 1.0 - keep)
    return np.where(probs >= threshold, ids, -1)


def self_train(
    stock: TrainedInverter,
    traffic: Traffic,
    config: TrainConfig,
    rounds: int = 1,
    keep: float = 0.6,
    student: str | None = None,
) -> TrainedInverter:
    """Pseudo-labelling from a stock inverter on unlabelled deployment traffic (see the module doc).

    ``student`` is the kind of inverter trained on the pseudo-labels (default: the stock one's).
    """
    if rounds < 1 or not 0 < keep <= 1:
        raise ValueError(f"need rounds >= 1 and keep in (0, 1], got {rounds}, {keep}")
    current = restandardised(stock, traffic.acts)
    for r in range(rounds):
        ids, probs = guesses(current, traffic.acts)
        labels = confident_labels(ids, probs, keep)
        log.info("self-train round %d: %.0f%% of traffic positions pseudo-labelled", r, 100 * (labels >= 0).mean())
        current = train_inverter(student or stock.kind, traffic.acts, labels, config, desc=f"T2 self-train {r}")
    return current


@dataclass
class MappedInverter:
    """An inverter reading activations through an affine map (deployed -> stock space)."""

    inner: TrainedInverter
    weight: np.ndarray  # (H + 1, H): [x, 1] @ weight

    def transform(self, acts: np.ndarray) -> np.ndarray:
        flat = acts.reshape(-1, acts.shape[-1])
        mapped: np.ndarray = np.concatenate([flat, np.ones((flat.shape[0], 1), flat.dtype)], axis=1) @ self.weight
        return mapped.reshape(acts.shape).astype(np.float32)

    def predict_topk(self, acts: np.ndarray, k: int = TOPK) -> np.ndarray:
        return self.inner.predict_topk(self.transform(acts), k)

    def predict_top5(self, acts: np.ndarray) -> np.ndarray:
        return self.predict_topk(acts, TOPK)


def ridge_map(source: np.ndarray, target: np.ndarray, ridge: float) -> np.ndarray:
    """Affine least squares (H+1, H) from ``source`` rows to ``target`` rows, ridge relative to the mean variance."""
    x = np.concatenate([source, np.ones((source.shape[0], 1), source.dtype)], axis=1).astype(np.float64)
    gram = x.T @ x
    reg = ridge * np.trace(gram) / gram.shape[0] * np.eye(gram.shape[0])
    reg[-1, -1] = 0.0  # the offset is not shrunk
    weight: np.ndarray = np.linalg.solve(gram + reg, x.T @ target.astype(np.float64))
    return weight


def align(
    stock: TrainedInverter,
    traffic: Traffic,
    public_view: PublicView,
    bos_id: int,
    rounds: int = 2,
    ridge: float = 1e-3,
) -> MappedInverter:
    """Fit a deployed -> stock activation map from the traffic's pseudo-text (see the module doc)."""
    if rounds < 1:
        raise ValueError(f"need rounds >= 1, got {rounds}")
    n, _, hidden = traffic.acts.shape
    flat = traffic.acts.reshape(-1, hidden)
    reader: MappedInverter | TrainedInverter = restandardised(stock, traffic.acts)
    mapped = MappedInverter(stock, np.zeros((hidden + 1, hidden)))
    for r in range(rounds):
        if isinstance(reader, MappedInverter):
            ids, _ = guesses(reader.inner, reader.transform(traffic.acts))
        else:
            ids, _ = guesses(reader, traffic.acts)
        pseudo = np.concatenate([np.full((n, 1), bos_id, dtype=np.int64), ids.astype(np.int64)], axis=1)
        target = public_view(pseudo)[:, 1:].reshape(-1, hidden)  # (n*q, H) stock view of the pseudo-text
        mapped = MappedInverter(stock, ridge_map(flat, target, ridge))
        reader = mapped
        log.info("align round %d: fitted a %d x %d map on %d positions", r, hidden + 1, hidden, flat.shape[0])
    return mapped
