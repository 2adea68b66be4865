"""A reduced draft vocabulary: a draft head that scores only the target tokens its text uses most.

A draft head's logits go through the target's LM head: a (V, H) product per drafted node. For a
real target that product dwarfs the head's own layer (Llama 3 8B: V = 128,256 and H = 4,096, so
525 M multiply-adds a node against about 220 M for its one decoder layer), and EAGLE-3 cuts it by
drafting over a reduced vocabulary of 32 K tokens. The same holds for splitspec's heads.

The draft vocabulary is the ``size`` target tokens seen most often in the training text (ties to
the lower id). The head keeps an LM head of its own, the target's rows for those tokens, so its
logits over them are exactly the full head's, and tokens outside are never drafted
(:meth:`~splitspec.models.draft_head.DraftHead.logits` gives them -inf). Drafting stays lossless:
greedy verification does not depend on the draft, and sampled verification divides by the q each
draft was drawn from, which is the head's distribution over its vocabulary.

Draft ids map to target ids by EAGLE-3's convention, ``target id = draft id + d2t[draft id]``, so
such a head also loads where vLLM and SGLang read EAGLE-3 heads' ``d2t``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch
from torch import nn

from splitspec.exceptions import ConfigError
from splitspec.models.draft_head import DraftHead
from splitspec.models.stack import ModelEnds


def token_counts(streams: Iterable[torch.Tensor], vocab_size: int) -> torch.Tensor:
    """How often each target token occurs in ``streams`` (each (T,) long ids) -> (V,) long."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ids in streams:
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
            raise ConfigError(f"token ids outside the target's vocabulary [0, {vocab_size})")
        counts += torch.bincount(ids.reshape(-1).to(torch.long), minlength=vocab_size)
    return counts


def frequent_tokens(counts: torch.Tensor, size: int) -> torch.Tensor:
    """The ``size`` most frequent tokens of ``counts`` (V,), ties to the lower id -> their ids (size,) ascending."""
    vocab = int(counts.shape[0])
    if not 1 <= size < vocab:
        raise ConfigError(f"a draft vocabulary holds 1 to {vocab - 1} tokens (the target has {vocab}), got {size}")
    # a stable sort of the negated counts keeps equal counts in id order
    order = torch.sort(-counts.to(torch.long), stable=True).indices  # (V,)
    return torch.sort(order[:size]).values


def lm_head_weight(ends: ModelEnds) -> torch.Tensor:
    """The target's LM head weight (V, H), read from its module (plain or tied to the embedding)."""
    module = ends.lm_head
    weight = getattr(module, "weight", None)
    if not isinstance(module, nn.Linear) or not isinstance(weight, torch.Tensor):
        raise ConfigError(f"the target's LM head is a {type(module).__name__}: its rows cannot be read")
    if module.bias is not None:
        raise ConfigError("the target's LM head has a bias: a reduced draft vocabulary is not supported for it")
    return weight


def with_draft_vocab(head: DraftHead, ends: ModelEnds, token_ids: torch.Tensor) -> DraftHead:
    """A copy of ``head`` drafting over ``token_ids`` (ascending target ids) only: its own LM head holds the
    target's rows for them and ``d2t`` maps them back. Its logits over them equal ``head``'s."""
    if head.config.draft_vocab is not None:
        raise ConfigError("this draft head already has a reduced vocabulary of its own")
    if head.config.logits_norm != "target":
        raise ConfigError("a reduced vocabulary needs a head that scores through the target's final norm")
    ids = token_ids.to(torch.long).cpu()
    vocab = int(ends.vocab_size)
    if ids.ndim != 1 or not ids.numel() or bool((ids[1:] <= ids[:-1]).any()):
        raise ConfigError("draft vocabulary ids must be distinct and ascending")
    if int(ids[0]) < 0 or int(ids[-1]) >= vocab:
        raise ConfigError(f"draft vocabulary ids must lie in the target's [0, {vocab})")
    config = dataclasses.replace(head.config, draft_vocab=int(ids.numel()))
    reduced = DraftHead(config, head.device, head.dtype)
    state = {k: v for k, v in head.state_dict().items()}
    rows = lm_head_weight(ends).detach()[ids.to(ends.device)]  # (n, H)
    state["lm_head.weight"] = rows.to(head.device, head.dtype)
    state["d2t"] = (ids - torch.arange(ids.numel())).to(head.device)  # target id = draft id + d2t
    reduced.load_state_dict(state)
    return reduced.train(head.training).requires_grad_(False)


def without_draft_vocab(head: DraftHead) -> DraftHead:
    """A copy of ``head`` scoring through the target's whole LM head again (what training continues from); only
    for a reduced vocabulary made by :func:`with_draft_vocab`, whose rows are the target's."""
    if head.config.draft_vocab is None:
        return head
    if head.config.logits_norm != "target":
        raise ConfigError("this draft head's own LM head is not the target's rows: it cannot be dropped")
    full = DraftHead(dataclasses.replace(head.config, draft_vocab=None), head.device, head.dtype)
    state = {k: v for k, v in head.state_dict().items() if k not in ("lm_head.weight", "d2t")}
    full.load_state_dict(state)
    return full
