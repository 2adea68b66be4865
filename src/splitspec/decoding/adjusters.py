"""Logits processors for OpenAI's sampling fields: ``logit_bias``, ``min_tokens`` and the penalties.

Each implements :class:`splitspec.decoding.processors.LogitsProcessor` over the tokens generated
in this request (not the prompt), as OpenAI defines them:

* ``logit_bias``: a constant added to a token's logit (-100 bans it, 100 all but forces it);
* ``min_tokens``: the stop tokens are forbidden until that many tokens were generated;
* penalties: ``logit[j] -= c[j] * frequency_penalty + (c[j] > 0) * presence_penalty``, ``c[j]``
  the count of token j generated so far.

Row i of a ``(q, V)`` block follows ``draft[:i]``, so these see the draft's tokens as generated.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping, Sequence

import torch


class LogitBias:
    """Adds ``bias[token]`` to that token's logit at every position."""

    def __init__(self, bias: Mapping[int, float], vocab_size: int) -> None:
        self._ids = torch.tensor(list(bias), dtype=torch.long)  # (k,)
        self._values = torch.tensor(list(bias.values()), dtype=torch.float32)  # (k,)
        self.vocab_size = vocab_size

    def process(self, logits: torch.Tensor, tokens: Sequence[int], draft: Sequence[int]) -> torch.Tensor:
        logits[:, self._ids.to(logits.device)] += self._values.to(logits.device)  # (q, V)
        return logits

    def validate_draft(self, draft: Sequence[int]) -> int:
        return len(draft)

    def accept(self, tokens: Sequence[int]) -> None:
        return None

    def rollback(self, n: int) -> None:
        return None

    @property
    def finished(self) -> bool:
        return False


class MinTokens:
    """Forbids ``stop_ids`` until ``minimum`` tokens were generated."""

    def __init__(self, minimum: int, stop_ids: Collection[int]) -> None:
        self.minimum = minimum
        self._stop = torch.tensor(sorted(stop_ids), dtype=torch.long)  # (s,)
        self.generated = 0

    def process(self, logits: torch.Tensor, tokens: Sequence[int], draft: Sequence[int]) -> torch.Tensor:
        rows = [i for i in range(logits.shape[0]) if self.generated + i < self.minimum]
        if rows and len(self._stop):
            idx = torch.tensor(rows, dtype=torch.long, device=logits.device)
            logits[idx.unsqueeze(1), self._stop.to(logits.device).unsqueeze(0)] = -float("inf")  # (r, s)
        return logits

    def validate_draft(self, draft: Sequence[int]) -> int:
        stop = set(self._stop.tolist())
        for i, token in enumerate(draft):
            if token in stop and self.generated + i < self.minimum:
                return i
        return len(draft)

    def accept(self, tokens: Sequence[int]) -> None:
        self.generated += len(tokens)

    def rollback(self, n: int) -> None:
        self.generated -= n

    @property
    def finished(self) -> bool:
        return False


class Penalties:
    """OpenAI's presence and frequency penalties over the tokens generated so far.

    The counts are kept as tokens are accepted and rolled back, so a step costs the distinct tokens
    generated plus its draft, not a recount of the whole answer."""

    def __init__(self, presence: float, frequency: float) -> None:
        self.presence = presence
        self.frequency = frequency
        self._generated: list[int] = []
        self._counts: Counter[int] = Counter()  # of _generated

    def process(self, logits: torch.Tensor, tokens: Sequence[int], draft: Sequence[int]) -> torch.Tensor:
        counts = self._counts
        if counts:  # every row follows the generated tokens: c * frequency + presence for each seen token
            ids = torch.tensor(list(counts), dtype=torch.long, device=logits.device)  # (k,)
            c = torch.tensor(list(counts.values()), dtype=torch.float32, device=logits.device)  # (k,)
            logits[:, ids] -= c * self.frequency + self.presence
        seen: Counter[int] = Counter()  # draft tokens before the row
        for i in range(1, logits.shape[0]):  # row i also follows draft[:i]: one more count of draft[i - 1]
            token = draft[i - 1]
            first = counts[token] + seen[token] == 0
            seen[token] += 1
            logits[i:, token] -= self.frequency + (self.presence if first else 0.0)
        return logits

    def validate_draft(self, draft: Sequence[int]) -> int:
        return len(draft)

    def accept(self, tokens: Sequence[int]) -> None:
        self._generated.extend(tokens)
        self._counts.update(tokens)

    def rollback(self, n: int) -> None:
        if n:
            self._counts.subtract(self._generated[-n:])
            self._counts = +self._counts  # drop the tokens no longer generated
            del self._generated[-n:]

    @property
    def finished(self) -> bool:
        return False
