"""Logits processors for OpenAI's sampling fields: ``logit_bias``, ``allowed_token_ids``, ``min_tokens`` and the
penalties.

Each implements :class:`splitspec.decoding.processors.LogitsProcessor` over the tokens generated
in this request (not the prompt), as OpenAI defines them, except ``repetition_penalty``:

* ``logit_bias``: a constant added to a token's logit (-100 bans it, 100 all but forces it);
* ``allowed_token_ids`` (vLLM's): every other token is banned, stop tokens included unless listed;
* ``min_tokens``: the stop tokens are forbidden until that many tokens were generated;
* penalties: ``logit[j] -= c[j] * frequency_penalty + (c[j] > 0) * presence_penalty``, ``c[j]``
  the count of token j generated so far;
* ``repetition_penalty`` (transformers' and vLLM's, Keskar et al. 2019): the logit of every token in the prompt or
  generated so far is divided by the penalty where positive and multiplied by it otherwise;
* ``bad_words`` (vLLM's): a word's last token is banned where the tokens generated end with the rest of it.

Row i of a ``(q, V)`` block follows ``draft[:i]``, so these see the draft's tokens as generated.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping, Sequence

import torch


class _Stateless:
    """A processor that keeps no state between positions: nothing to accept, roll back or finish."""

    def accept(self, tokens: Sequence[int]) -> None:
        return None

    def rollback(self, n: int) -> None:
        return None

    @property
    def finished(self) -> bool:
        return False


class LogitBias(_Stateless):
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


class AllowedTokens(_Stateless):
    """Bans every token but ``allowed`` at every position (their logits -inf); a draft stops at the first other."""

    def __init__(self, allowed: Collection[int], vocab_size: int) -> None:
        self._allowed = frozenset(allowed)
        self._banned = torch.ones(vocab_size, dtype=torch.bool)  # (V,)
        self._banned[torch.tensor(sorted(self._allowed), dtype=torch.long)] = False
        self.vocab_size = vocab_size

    def process(self, logits: torch.Tensor, tokens: Sequence[int], draft: Sequence[int]) -> torch.Tensor:
        return logits.masked_fill_(self._banned.to(logits.device), -float("inf"))  # (q, V)

    def validate_draft(self, draft: Sequence[int]) -> int:
        return next((i for i, t in enumerate(draft) if t not in self._allowed), len(draft))


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
        """Each row's penalty, ``c * frequency + presence`` over the counts it follows, taken off in one
        subtraction: the float32 result one-token decoding computes for that position, to the bit (two
        subtractions, the accepted counts' then the draft's, differ by an ulp and can flip a near-tie argmax)."""
        q = logits.shape[0]
        drafted = list(dict.fromkeys(draft[: q - 1]))  # distinct draft tokens some row follows, in order
        counts = self._counts
        in_draft = set(drafted)
        others = [t for t in counts if t not in in_draft]  # the same count in every row
        if others:
            ids = torch.tensor(others, dtype=torch.long, device=logits.device)  # (k,)
            c = torch.tensor([counts[t] for t in others], dtype=torch.float32, device=logits.device)  # (k,)
            logits[:, ids] -= c * self.frequency + self.presence
        if drafted:  # row i follows draft[:i]: its counts of the draft's tokens, row by row
            column = {t: j for j, t in enumerate(drafted)}
            rows = [[float(counts[t]) for t in drafted]]  # row 0: the accepted counts alone
            for token in draft[: q - 1]:
                row = list(rows[-1])
                row[column[token]] += 1.0
                rows.append(row)
            c = torch.tensor(rows, dtype=torch.float32, device=logits.device)  # (q, d)
            ids = torch.tensor(drafted, dtype=torch.long, device=logits.device)  # (d,)
            # presence only where seen; 0 where unseen (x - 0 is x exactly)
            penalty = torch.where(c > 0, c * self.frequency + self.presence, torch.zeros_like(c))  # (q, d)
            logits[:, ids] -= penalty
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


class RepetitionPenalty(_Stateless):
    """transformers' ``RepetitionPenaltyLogitsProcessor`` and vLLM's ``repetition_penalty``, over the sequence so far
    (the prompt and the tokens generated) and, row by row, the draft it follows.

    The seen tokens are kept as a (V,) mask read from ``tokens`` as it grows (one sequence's context only grows
    between calls); a context that is not the last one extended is read afresh."""

    def __init__(self, penalty: float) -> None:
        self.penalty = penalty
        self._seen: torch.Tensor | None = None  # (V,) bool: the tokens of the context's first _length
        self._length = 0
        self._last: int | None = None  # the context's token at _length - 1 (a context that differs: read afresh)

    def _seen_in(self, tokens: Sequence[int], vocab: int, device: torch.device) -> torch.Tensor:
        n = self._length
        seen = self._seen
        if (
            seen is None
            or seen.shape[0] != vocab
            or seen.device != device
            or len(tokens) < n
            or (n and tokens[n - 1] != self._last)
        ):
            seen, n = torch.zeros(vocab, dtype=torch.bool, device=device), 0
        if len(tokens) > n:
            seen[torch.tensor(tokens[n:], dtype=torch.long, device=device)] = True
        self._seen, self._length, self._last = seen, len(tokens), tokens[-1] if tokens else None
        return seen

    def process(self, logits: torch.Tensor, tokens: Sequence[int], draft: Sequence[int]) -> torch.Tensor:
        """Each row's seen tokens penalised, elementwise as one-token decoding would for that position (an
        element's result does not depend on the other rows, so it is the same float32)."""
        q, vocab = logits.shape
        rows = self._seen_in(tokens, vocab, logits.device).expand(q, vocab)  # (q, V): row i's seen tokens
        if q > 1 and draft:
            rows = rows.clone()
            for i, token in enumerate(draft[: q - 1]):
                rows[i + 1 :, token] = True  # rows after a drafted token have seen it
        columns = rows[-1].nonzero().squeeze(1)  # (k,): every token some row has seen (the last row sees most)
        sub = logits[:, columns]  # (q, k)
        penalised = torch.where(sub < 0, sub * self.penalty, sub / self.penalty)  # transformers' rule
        logits[:, columns] = torch.where(rows[:, columns], penalised, sub)
        return logits

    def validate_draft(self, draft: Sequence[int]) -> int:
        return len(draft)


class BadWords:
    """vLLM's ``bad_words``, as token sequences: a sequence's last token is banned wherever the tokens generated so
    far (the prompt's are not looked at, as in vLLM) end with the rest of it; a one-token sequence always."""

    def __init__(self, words: Collection[Sequence[int]]) -> None:
        self._always_set = frozenset(w[0] for w in words if len(w) == 1)  # the one-token words
        self._always = torch.tensor(sorted(self._always_set), dtype=torch.long)  # (s,)
        self._after = sorted({(tuple(w[:-1]), w[-1]) for w in words if len(w) > 1})  # (the tokens before, the last)
        self._reach = max((len(before) for before, _ in self._after), default=0)  # tokens looked back at most
        self._generated: list[int] = []

    def _recent(self) -> list[int]:
        """The generated tokens a sequence can reach back to."""
        return self._generated[max(0, len(self._generated) - self._reach) :]

    def _banned_after(self, history: Sequence[int]) -> list[int]:
        """The last tokens of the sequences whose other tokens end ``history``."""
        n = len(history)
        return [
            last for before, last in self._after if n >= len(before) and tuple(history[n - len(before) :]) == before
        ]

    def process(self, logits: torch.Tensor, tokens: Sequence[int], draft: Sequence[int]) -> torch.Tensor:
        if len(self._always):
            logits[:, self._always.to(logits.device)] = -float("inf")  # (q, s)
        if self._after:
            history = [*self._recent(), *draft]
            start = len(history) - len(draft)  # row i follows history[: start + i]
            for i in range(logits.shape[0]):
                banned = self._banned_after(history[: start + i])
                if banned:
                    logits[i, torch.tensor(banned, dtype=torch.long, device=logits.device)] = -float("inf")
        return logits

    def validate_draft(self, draft: Sequence[int]) -> int:
        history = self._recent()
        for i, token in enumerate(draft):
            if token in self._always_set or token in self._banned_after(history):
                return i
            history.append(token)
        return len(draft)

    def accept(self, tokens: Sequence[int]) -> None:
        self._generated.extend(tokens)

    def rollback(self, n: int) -> None:
        if n:
            del self._generated[-n:]

    @property
    def finished(self) -> bool:
        return False
