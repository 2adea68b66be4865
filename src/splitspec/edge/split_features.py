"""Features through the split: a stripped edge (no trunk weights) reads a draft head's training data.

``splitspec train-drafter --cloud URL`` trains a head on an edge that holds only its own layers:
each training window runs as a prefill through a real trunk server, and the edge keeps the
features it has without asking (its head's output, the trunk's output, its tail's output; see
:mod:`splitspec.models.features`) and every row's logits. The trunk sees what it sees at any
prefill: the head's hidden states of the window, nothing more.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from splitspec.edge.client import SplitClient
from splitspec.models.features import edge_feature_sources
from splitspec.models.stack import ModelEnds


class SplitFeatures:
    """A draft head's :class:`~splitspec.models.train_draft_head.FeatureSource` over a connected split client."""

    def __init__(self, client: SplitClient, feature_layers: Sequence[int]) -> None:
        plan = client.runtime.plan
        edge_feature_sources(feature_layers, plan.num_layers, plan.head, plan.tail)  # only what the edge has
        self.client = client
        self.feature_layers = tuple(feature_layers)

    @property
    def ends(self) -> ModelEnds:
        return self.client.runtime.model

    async def features(self, token_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """token ids (T,) from position 0 -> features (T, F * H) and the target's logits (T, V) float32."""
        sequence = self.client.sequence
        sequence.reset()  # the trunk's cache of the last window is dropped with this window's step
        log = sequence.keep_features(self.feature_layers)
        if log is None:  # reset() emptied the sequence, so a log always starts
            raise RuntimeError("the sequence could not keep features")
        logits = await self.client.forward(list(token_ids), logits_from=0)  # (T, V)
        return log.rows().clone(), logits
