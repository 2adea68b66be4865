"""Per-token hidden states ("features") a verifier keeps for a drafter that reads them (an EAGLE head).

A feature of token i is the residual stream after k decoder layers at position i; a drafter names
the layers it reads (``layers``, concatenated in that order: (F * H,) per token). On a split edge
the layers it has without asking the trunk are the head's output (k = head layers), the trunk's
output (k = the tail's first layer) and the tail's output (k = L, before the final norm); one
state inside the trunk (EAGLE-3 reads the middle of the model) the trunk returns beside its output
when a step asks for it (``Step.return_layer``).

:class:`FeatureLog` is aligned with a sequence's committed tokens: it grows, keeps a step's
accepted path and truncates exactly as the token list does, so row i is always token i's feature.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from splitspec.models.kv_cache import KVCache
    from splitspec.models.stack import FullModel


class FeatureLog:
    """Features of every committed token of one sequence: (len, F * H), in a buffer grown by doubling."""

    def __init__(self, layers: Sequence[int]) -> None:
        if not layers or any(k < 1 for k in layers):
            raise ValueError(f"feature layers must be decoder-layer counts >= 1, got {list(layers)}")
        self.layers = tuple(layers)  # the stream after this many decoder layers, concatenated in this order
        self._buffer: torch.Tensor | None = None  # (capacity, F * H)
        self._length = 0

    @property
    def nbytes(self) -> int:
        """Memory its buffer holds (its capacity, not only the rows in use), bytes."""
        return 0 if self._buffer is None else self._buffer.numel() * self._buffer.element_size()

    def __len__(self) -> int:
        return self._length

    def rows(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Features of tokens ``start`` .. ``stop`` - 1: (n, F * H)."""
        stop = self._length if stop is None else stop
        if not 0 <= start <= stop <= self._length:
            raise IndexError(f"rows {start}:{stop} of a log of {self._length}")
        if self._buffer is None:
            raise IndexError("the feature log is empty")
        return self._buffer[start:stop]

    def append(self, features: torch.Tensor) -> None:
        """Add the features (q, F * H) of a step's q tokens, in query order."""
        q = features.shape[0]
        if self._buffer is None:
            self._buffer = features.new_empty((max(64, q), features.shape[1]))
        elif features.shape[1] != self._buffer.shape[1] or features.dtype != self._buffer.dtype:
            raise ValueError(f"features {tuple(features.shape)} {features.dtype} do not match the log's")
        if self._length + q > self._buffer.shape[0]:
            grown = self._buffer.new_empty((max(2 * self._buffer.shape[0], self._length + q), self._buffer.shape[1]))
            grown[: self._length] = self._buffer[: self._length]
            self._buffer = grown
        self._buffer[self._length : self._length + q] = features
        self._length += q

    def keep(self, start: int, indices: Sequence[int]) -> None:
        """Keep rows ``start + i`` for i in ``indices`` of the last step (starting at row ``start``)."""
        if self._buffer is None or not indices:
            self._length = min(self._length, start)
            return
        kept = self._buffer[[start + i for i in indices]]  # (k, F * H): an indexed copy
        self._buffer[start : start + len(indices)] = kept
        self._length = start + len(indices)

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` rows."""
        self._length = min(self._length, max(0, length))

    def clear(self) -> None:
        self._buffer, self._length = None, 0


def edge_feature_sources(layers: Sequence[int], num_layers: int, head: int, tail: int) -> tuple[str, ...]:
    """Where a split edge with ``head`` and ``tail`` edge layers (of ``num_layers``) finds each feature layer:
    "head" (the head's output), "trunk" (the trunk's output), "tail" (the last layer's output) or "middle"
    (a state inside the trunk, which the trunk returns beside its output when a step asks: see
    :func:`trunk_feature_layer`).

    Raises :class:`~splitspec.exceptions.ConfigError` for a layer inside the edge's own head or tail (not
    recorded), and for more than one layer inside the trunk (a step asks for one).
    """
    from splitspec.exceptions import ConfigError

    where = {head: "head", num_layers - tail: "trunk", num_layers: "tail"}
    middle = [k for k in layers if head < k < num_layers - tail]
    missing = [k for k in layers if k not in where and k not in middle]
    if missing:
        raise ConfigError(
            f"the draft head reads the stream after layer(s) {missing}, inside this edge's own layers, which it does "
            f"not record; this edge has layers {head} (its head's output), {num_layers - tail} (the trunk's), "
            f"{num_layers} (its tail's), and one of {head + 1} .. {num_layers - tail - 1} from the trunk on request"
        )
    if len(set(middle)) > 1:
        raise ConfigError(
            f"the draft head reads the states after several trunk layers {sorted(set(middle))}: a step asks the trunk "
            "for one"
        )
    return tuple(where.get(k, "middle") for k in layers)


def trunk_feature_layer(layers: Sequence[int], num_layers: int, head: int, tail: int) -> int | None:
    """The one feature layer inside the trunk (see :func:`edge_feature_sources`), or None."""
    sources = edge_feature_sources(layers, num_layers, head, tail)
    return next((k for k, source in zip(layers, sources, strict=True) if source == "middle"), None)


@torch.inference_mode()
def full_model_step(
    model: FullModel,
    token_ids: torch.Tensor,
    positions: torch.Tensor,
    parents: torch.Tensor,
    cache: KVCache | None,
    layers: Sequence[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """A whole model's step that also returns features: token_ids (q,) -> logits (q, V) float32 and features
    (q, F * H) of ``layers``; with a cache, the step's q entries are appended and committed."""
    outs = model.layers.run_committed(model.embed(token_ids[None]), positions, parents, cache)  # L x (1, q, H)
    features = torch.cat([outs[k - 1][0] for k in layers], dim=-1)  # (q, F * H)
    return model.logits(outs[-1])[0], features
