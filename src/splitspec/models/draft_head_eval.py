"""How well a draft head drafts for its target on this machine: greedy chains verified by the whole model.

:func:`greedy_chains` decodes greedily with the target (a :class:`LocalFeatures` over the whole
model), drafting a chain of ``depth`` tokens with the head before each verification. Its output
equals plain greedy decoding (the target decides every token); the figure is the mean accepted
length, tokens per verification (EAGLE's tau: the accepted drafts plus the target's own token).
This is a measurement helper for training and model cards; the edge's drafter is
:mod:`splitspec.decoding.eagle`.

Bookkeeping (the pair convention of :mod:`splitspec.models.draft_head`): with x_0..x_n decided,
the target's cache holds x_0..x_{n-1} (features f_0..f_{n-1}), the head's cache holds its queries
0..n-2, and x_n is the last token decided. Drafting queries (x_n, f_{n-1}) at position n-1, then
each drafted token with the head's own output as its feature. The target verifies x_n and the
chain in one step; the head's drafted entries are dropped and its true pairs re-run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from splitspec.exceptions import ConfigError
from splitspec.models.draft_head import DraftHead
from splitspec.models.kv_cache import KVCache
from splitspec.models.masks import chain
from splitspec.models.train_draft_head import LocalFeatures


@dataclass(frozen=True)
class ChainReport:
    """Greedy chain drafting over some prompts."""

    tokens: tuple[tuple[int, ...], ...]  # each prompt's generated tokens
    verifications: int  # target steps after each prompt's prefill
    accepted: int  # drafted tokens the target accepted

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verification: accepted drafts plus the target's own token (EAGLE's tau)."""
        return (self.accepted + self.verifications) / max(1, self.verifications)


def _ints(values: Sequence[int]) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int32)


def _head_step(
    head: DraftHead, source: LocalFeatures, tokens: list[int], feats: torch.Tensor, start: int, cache: KVCache
) -> torch.Tensor:
    """Head queries at positions start.. for (tokens[j], feats[j]) -> ĥ (q, H); appended to ``cache``."""
    q = len(tokens)
    ids = torch.tensor(tokens, dtype=torch.long)
    hidden: torch.Tensor = head(source.ends, ids, feats, _ints(range(start, start + q)), _ints(chain(q)), cache)
    return hidden


@torch.inference_mode()
def greedy_chains(
    head: DraftHead, source: LocalFeatures, prompts: Sequence[Sequence[int]], new_tokens: int, depth: int
) -> ChainReport:
    """Greedily decode ``new_tokens`` after each prompt (>= 2 tokens), drafting ``depth``-token chains."""
    if depth < 1 or new_tokens < 1:
        raise ConfigError("depth and new_tokens must be at least 1")
    if len(source.feature_layers) != 1:
        raise ConfigError("greedy_chains feeds the head its own output as a feature: one feature layer only")
    outputs: list[tuple[int, ...]] = []
    verifications = accepted = 0
    for prompt in prompts:
        if len(prompt) < 2:
            raise ConfigError("each prompt needs at least 2 tokens")
        target_cache, head_cache = KVCache(), KVCache()
        context = list(prompt)
        n = len(context) - 1  # x_n = context[n] is decided but not yet run by the target
        feats, logits = source.step(torch.tensor(context[:n]), _ints(range(n)), _ints(chain(n)), target_cache)
        last_feat = feats[-1:]  # f_{n-1}
        if n > 1:  # the head's true pairs 0..n-2: (x_{i+1}, f_i)
            _head_step(head, source, context[1:n], feats[:-1], 0, head_cache)
        generated: list[int] = []
        while len(generated) < new_tokens:
            drafts: list[int] = []
            token, feat = context[n], last_feat
            for d in range(depth):  # each drafted token's feature is the head's own prediction
                hidden = _head_step(head, source, [token], feat, n - 1 + d, head_cache)  # (1, H)
                token = int(head.logits(source.ends, hidden)[0].argmax())
                drafts.append(token)
                feat = hidden.to(feats.dtype)
            step = [context[n], *drafts]
            feats, logits = source.step(
                torch.tensor(step), _ints(range(n, n + len(step))), _ints(chain(len(step))), target_cache
            )
            greedy = logits.argmax(-1).tolist()  # greedy[j]: the target's token after step[j]
            a = 0
            while a < depth and drafts[a] == greedy[a]:
                a += 1
            verifications += 1
            accepted += a
            target_cache.keep_last(tuple(range(a + 1)))  # x_n and the accepted drafts
            head_cache.truncate(n - 1)  # drop the drafted queries, re-run the true pairs n-1..n+a-1
            true_feats = torch.cat([last_feat, feats[:a]])  # f_{n-1}..f_{n+a-1}
            _head_step(head, source, step[: a + 1], true_feats, n - 1, head_cache)
            new = [*drafts[:a], greedy[a]]
            context += new
            generated += new
            last_feat = feats[a : a + 1]  # f_{n+a}
            n += a + 1
        outputs.append(tuple(generated[:new_tokens]))
    return ChainReport(tuple(outputs), verifications, accepted)


def heldout_prompts(streams: Sequence[torch.Tensor], count: int, length: int, seed: int) -> list[list[int]]:
    """``count`` prompts of ``length`` tokens from evenly spaced places of the given token streams (seeded)."""
    gen = torch.Generator().manual_seed(seed)
    usable = [s for s in streams if s.numel() > length]
    if not usable:
        raise ConfigError(f"no evaluation file holds more than {length} tokens")
    out = []
    for i in range(count):
        stream = usable[i % len(usable)]
        start = int(torch.randint(0, stream.numel() - length, (1,), generator=gen))
        out.append(stream[start : start + length].tolist())
    return out
