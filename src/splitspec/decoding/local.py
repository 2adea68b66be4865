"""A whole model on this machine, behind the same Verifier interface as the split client.

Used for local baselines, for the draft model, for federated workers and the coordinator's
drafter, and for tests that need the decoding loops without a network. Our :class:`KVCache`
keeps every entry (sliding windows are applied in the masks), so any prefix can be kept: rolling
back never re-prefills.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from splitspec.models.draft_forward import DraftForward
from splitspec.models.features import FeatureLog, full_model_step
from splitspec.models.kv_cache import KVCache
from splitspec.models.masks import chain, step_positions
from splitspec.models.stack import FullModel
from splitspec.prefix import common_prefix


class LocalSequence:
    """One sequence on a local :class:`FullModel`: tokens, their KV cache, forward / keep / truncate."""

    def __init__(self, model: FullModel) -> None:
        self.model = model
        self.cache = KVCache()
        self.tokens: list[int] = []  # token id behind every committed cache entry
        self.features: FeatureLog | None = None  # every committed token's features, when a drafter reads them

    def keep_features(self, layers: Sequence[int]) -> FeatureLog | None:
        """Keep the features of ``layers`` of every token committed from now on (as
        :meth:`splitspec.edge.sequence.EdgeSequence.keep_features`: only while the sequence is empty)."""
        if self.features is not None and self.features.layers == tuple(layers):
            return self.features
        self.features = None if self.tokens else FeatureLog(layers)
        return self.features

    def reset(self) -> None:
        self.cache = KVCache()
        self.tokens = []
        if self.features is not None:
            self.features.clear()

    def run(self, tokens: Sequence[int], parents: Sequence[int] | None = None, logits_from: int = 0) -> torch.Tensor:
        """tokens (q,) -> logits (q - logits_from, V) of the tokens from ``logits_from`` on; appends them to the
        cache."""
        ids, positions, parent_t = self._step_inputs(tokens, parents)
        if self.features is None:
            logits: torch.Tensor = self.model(ids, positions, parent_t, self.cache, logits_from)
        else:
            logits, features = full_model_step(self.model, ids, positions, parent_t, self.cache, self.features.layers)
            logits = logits[logits_from:]
            self.features.append(features)
        self.tokens.extend(tokens)
        return logits

    def _step_inputs(
        self, tokens: Sequence[int], parents: Sequence[int] | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A step of ``tokens`` after the cached ones (``parents``: its tree; None: a chain) -> ids (q,) long,
        positions (q,) int32, parents (q,) int32."""
        parent_list = chain(len(tokens)) if parents is None else list(parents)
        parent_t = torch.tensor(parent_list, dtype=torch.int32)
        positions = torch.tensor(step_positions(len(self.tokens), parent_list), dtype=torch.int32)
        return torch.tensor(list(tokens), dtype=torch.long), positions, parent_t

    def step(self, tokens: Sequence[int], logits_from: int = 0) -> DraftForward:
        """The forward :meth:`run` makes for a chain of ``tokens``, to be run elsewhere (in lockstep with other
        sequences': decoding/lockstep.py); the caller then appends ``tokens`` to :attr:`tokens`. Not while
        features are kept (:meth:`run` computes them)."""
        if self.features is not None:
            raise ValueError("a sequence that keeps features runs its steps itself (run)")
        ids, positions, parents = self._step_inputs(tokens, None)
        return DraftForward(self.model, self.cache, ids, positions, parents=parents, logits_from=logits_from)

    async def forward(
        self,
        tokens: Sequence[int],
        parents: Sequence[int] | None = None,
        logits_from: int = 0,
        *,
        sent: Callable[[], None] | None = None,
    ) -> torch.Tensor:
        if sent is not None:
            sent()  # no round trip: the step is "sent" at once
        return self.run(tokens, parents, logits_from)

    def keep(self, indices: Sequence[int]) -> None:
        """Keep only ``indices`` of the last step's entries."""
        keep = tuple(indices)
        start = len(self.tokens) - self.cache.last_step
        self.cache.keep_last(keep)
        self.tokens = self.tokens[:start] + [self.tokens[start + i] for i in keep]
        if self.features is not None:
            self.features.keep(start, keep)

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` cached tokens."""
        self.cache.truncate(length)
        del self.tokens[length:]
        if self.features is not None:
            self.features.truncate(length)

    def append(self, tokens: Sequence[int], num_scored: int) -> torch.Tensor:
        """Feed ``tokens`` after the cached ones; (num_scored, V) float32 logits of the last positions."""
        if not tokens or not 1 <= num_scored <= len(tokens):
            raise ValueError(f"need 1 <= num_scored ({num_scored}) <= new tokens ({len(tokens)})")
        return self.run(tokens, logits_from=len(tokens) - num_scored)

    def logits_for(self, sequence: Sequence[int], num_scored: int = 1) -> torch.Tensor:
        """(num_scored, V) logits for the last ``num_scored`` positions of ``sequence``, reusing the cache."""
        common = common_prefix(self.tokens, sequence, len(sequence) - num_scored)
        self.truncate(common)
        return self.append(list(sequence[common:]), num_scored)
