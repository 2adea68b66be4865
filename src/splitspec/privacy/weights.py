"""Are the edge's layers the published ones? Per-tensor differences and a fingerprint.

Stock public weights on the edge void the privacy story: anyone can recompute (activation, token)
pairs with them. :func:`edge_weight_report` compares the edge layers of an edge checkpoint with
the published checkpoint, tensor by tensor, and :func:`edge_fingerprint` hashes the tensors the
edge runs so a deployment can pin (and refuse to silently fall back from) its private variant.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import torch

from splitspec.exceptions import ConfigError
from splitspec.models.checkpoint import Checkpoint, hash_tensors
from splitspec.models.split import SplitPlan

# relative Frobenius difference below which a tensor counts as stock: a bfloat16 copy of float32 weights differs by
# about 2e-3 (bfloat16 keeps 8 significant bits) and is as public as they are; `splitspec diverge` moves the edge
# layers' tensors by about 0.5
DEFAULT_TOLERANCE = 1e-2


def edge_layer_names(ckpt: Checkpoint, plan: SplitPlan) -> list[str]:
    """Tensor names of the edge's decoder layers (head and tail), sorted."""
    layers = [*plan.head_layers, *plan.tail_layers]
    prefixes = tuple(f"model.layers.{i}." for i in layers)
    return sorted(n for n in ckpt.tensor_names if n.startswith(prefixes))


def edge_tensor_names(ckpt: Checkpoint, plan: SplitPlan) -> list[str]:
    """Every tensor the edge loads: embedding, edge layers, final norm, LM head (when untied)."""
    ends = [n for n in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight") if ckpt.has(n)]
    return sorted({*ends, *edge_layer_names(ckpt, plan)})


def edge_fingerprint(ckpt_dir: str | Path, plan: SplitPlan) -> str:
    """sha256 (hex) over the edge tensors' names, shapes and float32 bytes, in name order."""
    ckpt = Checkpoint(ckpt_dir)
    h = hashlib.sha256()
    hash_tensors(h, ckpt, edge_tensor_names(ckpt, plan))
    return h.hexdigest()


@dataclass(frozen=True)
class TensorDiff:
    """One edge tensor against its published counterpart."""

    name: str
    relative_difference: float  # ||edge - published||_F / ||published||_F
    stock: bool  # relative_difference <= tolerance


@dataclass(frozen=True)
class WeightReport:
    """How far the edge layers are from the published ones."""

    plan: SplitPlan
    tolerance: float  # relative Frobenius difference counted as "equal"
    tensors: tuple[TensorDiff, ...] = field(repr=False)

    @property
    def is_stock(self) -> bool:
        """True when every edge-layer tensor equals the published one within tolerance."""
        return all(t.stock for t in self.tensors)

    @property
    def head_is_stock(self) -> bool:
        """True when every head-layer tensor equals the published one: the hidden state the cloud receives is then
        what anyone holding the published model computes, whatever the tail layers are."""
        head = set(self.plan.head_layers)
        return all(t.stock for t in self.tensors if int(t.name.split(".")[2]) in head)

    @property
    def stock_layers(self) -> list[int]:
        """Edge layers none of whose tensors differ from the published ones: public to an attacker."""
        by_layer: dict[int, bool] = {}
        for t in self.tensors:
            layer = int(t.name.split(".")[2])
            by_layer[layer] = by_layer.get(layer, True) and t.stock
        return sorted(i for i, stock in by_layer.items() if stock)

    @property
    def max_relative_difference(self) -> float:
        return max((t.relative_difference for t in self.tensors), default=0.0)

    def to_dict(self) -> dict[str, object]:
        return {
            "head": self.plan.head,
            "tail": self.plan.tail,
            "tolerance": self.tolerance,
            "is_stock": self.is_stock,
            "head_is_stock": self.head_is_stock,
            "stock_layers": self.stock_layers,
            "max_relative_difference": self.max_relative_difference,
            "tensors": {t.name: t.relative_difference for t in self.tensors},
        }


def edge_weight_report(
    edge_ckpt_dir: str | Path,
    published_ckpt_dir: str | Path,
    plan: SplitPlan,
    tolerance: float = DEFAULT_TOLERANCE,
) -> WeightReport:
    """Compare the edge layers of ``edge_ckpt_dir`` with ``published_ckpt_dir`` under ``plan``.

    Only the edge layers' tensors are read from either checkpoint.
    """
    edge = Checkpoint(edge_ckpt_dir)
    published = Checkpoint(published_ckpt_dir)
    if int(edge.config.num_hidden_layers) != int(published.config.num_hidden_layers):
        raise ConfigError(
            f"{edge_ckpt_dir} has {edge.config.num_hidden_layers} layers but {published_ckpt_dir} has "
            f"{published.config.num_hidden_layers}: not the same model"
        )
    names = edge_layer_names(published, plan)
    missing = [n for n in names if not edge.has(n)]
    if missing:
        raise ConfigError(f"{edge_ckpt_dir} lacks edge tensors {missing[:3]}")
    diffs: list[TensorDiff] = []
    for name in names:
        a = edge.read([name], torch.float32)[name]
        b = published.read([name], torch.float32)[name]
        if a.shape != b.shape:
            raise ConfigError(f"tensor {name}: shape {tuple(a.shape)} differs from published {tuple(b.shape)}")
        rel = float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b).clamp_min(1e-12))
        diffs.append(TensorDiff(name, rel, rel <= tolerance))
    return WeightReport(plan, tolerance, tuple(diffs))
