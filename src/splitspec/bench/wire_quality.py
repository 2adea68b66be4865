"""What a lossy wire codec costs a model's output, measured without a server.

A split model's hidden state crosses the wire twice per step: up after the edge's head layers and
back after the trunk. :func:`split_logits` runs a whole model (:class:`~splitspec.models.stack.
FullModel`) with a codec's encode and decode applied at those two points, which is exactly what
the trunk and the edge receive over a link (the same protocol.codec functions the messages use).
Against the raw run it gives, per token of teacher-forced text, top-1 agreement and the KL
divergence KL(raw || codec) of the next-token laws (:func:`teacher_forced`), and, per prompt,
whether greedy decoding produces the same tokens (:func:`greedy_agreement`).

:func:`per_token_int8` is a reference codec for reports only (never on the wire): one absmax
scale per token, no outliers, i.e. what int8 without outlier handling does to massive activations.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from splitspec.bench.prompts import TokenizerLike
from splitspec.models.kv_cache import KVCache
from splitspec.models.masks import chain
from splitspec.models.stack import FullModel
from splitspec.protocol.codec import decode_hidden, encode_hidden

Wire = Callable[[torch.Tensor], torch.Tensor]  # hidden (1, q, H) -> what the other side computes on, same dtype

__all__ = [
    "Wire",
    "WireQuality",
    "codec_wire",
    "greedy_agreement",
    "heldout_windows",
    "per_token_int8",
    "split_logits",
    "teacher_forced",
]


def heldout_windows(tokenizer: TokenizerLike, corpus_dir: Path, length: int, count: int) -> list[list[int]]:
    """The first ``length`` tokens of up to ``count`` held-out documents (``corpus_dir``/*/*.txt), domains
    taken in turn, documents in name order; a document shorter than ``length`` tokens is skipped."""
    domains = [sorted(d.glob("*.txt")) for d in sorted(corpus_dir.iterdir()) if d.is_dir()]
    windows = []
    for doc in itertools.chain.from_iterable(itertools.zip_longest(*domains)):
        if doc is None:
            continue
        ids = tokenizer.encode(doc.read_text(encoding="utf-8"), add_special_tokens=False)
        if len(ids) >= length:
            windows.append([int(t) for t in ids[:length]])
        if len(windows) == count:
            break
    return windows


def codec_wire(codec: str) -> Wire:
    """A hidden state through ``codec`` and back, in its own dtype (as the receiver casts it)."""

    def through(hidden: torch.Tensor) -> torch.Tensor:
        return decode_hidden(codec, encode_hidden(codec, hidden)).to(hidden.dtype)

    return through


def per_token_int8(hidden: torch.Tensor) -> torch.Tensor:
    """Reference only: int8 with one absmax scale per token and no outliers, decoded back (1, q, H)."""
    x = hidden.float()
    scale = x.abs().amax(dim=-1, keepdim=True) / 127  # (1, q, 1)
    quantized = torch.where(scale > 0, x / scale, 0.0).round().clamp(-127, 127)
    return (quantized * scale).to(hidden.dtype)


def _identity(hidden: torch.Tensor) -> torch.Tensor:
    return hidden


@torch.inference_mode()
def split_logits(
    model: FullModel,
    token_ids: Sequence[int],
    cuts: tuple[int, int],
    wire: Wire,
    cache: KVCache | None = None,
    inject: Wire = _identity,
) -> torch.Tensor:
    """Logits (q, V) of ``token_ids`` (a chain after ``cache``'s entries) with ``wire`` applied where
    the hidden state leaves layer ``cuts[0]`` and re-enters at layer ``cuts[1]`` (the head ends and the
    tail starts there; ``cuts[0] == cuts[1]`` is an empty trunk). ``inject`` edits the head's output
    before the wire (a test's stand-in for a model with massive activations)."""
    stack = model.layers
    past = 0 if cache is None else len(cache)
    ids = torch.tensor(list(token_ids), dtype=torch.long)
    parents = torch.tensor(chain(len(ids)), dtype=torch.int32)
    positions = torch.arange(past, past + len(ids), dtype=torch.int32)
    hidden = model.embed(ids[None])  # (1, q, H)
    bounds = (0, cuts[0], cuts[1], len(stack.layers))
    for crossing, (start, stop) in enumerate(itertools.pairwise(bounds)):
        if crossing == 1:
            hidden = wire(inject(hidden))  # up to the trunk
        elif crossing == 2:
            hidden = wire(hidden)  # back to the edge
        if stop > start:
            hidden = stack.run(hidden, positions, parents, cache, layers=range(start, stop))[-1]
    if cache is not None:
        cache.commit()
    return model.logits(hidden)[0]


@dataclass(frozen=True)
class WireQuality:
    """One codec's agreement with the raw wire over teacher-forced text."""

    tokens: int  # positions scored
    top1_agreement: float  # fraction of positions whose argmax equals the raw run's
    kl_p99: float  # 99th percentile over positions of KL(raw || codec), nats
    kl_max: float  # largest KL(raw || codec), nats


def teacher_forced(
    model: FullModel, windows: Sequence[Sequence[int]], cuts: tuple[int, int], wire: Wire, inject: Wire = _identity
) -> WireQuality:
    """``wire`` against the raw wire (both with ``inject``) over every position of ``windows``."""
    agree, kls = 0, []
    for window in windows:
        raw = split_logits(model, window, cuts, _identity, inject=inject).log_softmax(-1)  # (T, V)
        coded = split_logits(model, window, cuts, wire, inject=inject).log_softmax(-1)  # (T, V)
        agree += int((raw.argmax(-1) == coded.argmax(-1)).sum())
        kls.append((raw.exp() * (raw - coded)).sum(-1).clamp_min(0.0))  # (T,)
    kl = torch.cat(kls).double()
    return WireQuality(len(kl), agree / len(kl), float(torch.quantile(kl, 0.99)), float(kl.max()))


def _greedy(
    model: FullModel, prompt: Sequence[int], new_tokens: int, cuts: tuple[int, int], wire: Wire, inject: Wire
) -> list[int]:
    cache = KVCache()
    logits = split_logits(model, prompt, cuts, wire, cache, inject)
    out = [int(logits[-1].argmax())]
    while len(out) < new_tokens:
        out.append(int(split_logits(model, out[-1:], cuts, wire, cache, inject)[-1].argmax()))
    return out


def greedy_agreement(
    model: FullModel,
    prompts: Sequence[Sequence[int]],
    new_tokens: int,
    cuts: tuple[int, int],
    wire: Wire,
    inject: Wire = _identity,
) -> int:
    """Prompts whose greedy continuation of ``new_tokens`` through ``wire`` equals the raw wire's."""
    return sum(
        _greedy(model, p, new_tokens, cuts, wire, inject) == _greedy(model, p, new_tokens, cuts, _identity, inject)
        for p in prompts
    )
