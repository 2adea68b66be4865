"""What the untrusted cloud sees, collected in batches from a split model's own layers.

For a model of L decoder layers let h_k be the residual stream after k layers (h_0 is the token
embedding). With the edge holding ``head`` layers before the trunk and ``tail`` after it, the cloud
receives h_head (the *input side*) and returns h_{L-tail} (the *output side*). At audit depth d
we therefore record h_d and h_{L-d}. The layers are the same transformers decoder layers the
deployment runs (:class:`splitspec.models.stack.LayerStack`), run over a batch of windows with the
same explicit causal mask; a test checks the result against :meth:`EdgeModel.run_head` and the
trunk.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import NamedTuple

import numpy as np
import torch

from splitspec.models.split import SplitPlan
from splitspec.models.stack import FullModel, LayerStack
from splitspec.privacy.defences import add_send_noise

log = logging.getLogger(__name__)


def run_layers(stack: LayerStack, hidden: torch.Tensor, layers: Iterable[int] | None = None) -> list[torch.Tensor]:
    """Run windows (B, q, H) through ``stack`` (or its local layers ``layers``); one output per layer.

    Every window starts at position 0 with an empty cache. Gradients flow when enabled by the
    caller (unlike ``LayerStack.forward``, which is inference-only).
    """
    q = hidden.shape[1]
    positions = torch.arange(q, dtype=torch.int32)
    parents = torch.arange(-1, q - 1, dtype=torch.int32)
    return stack.run(hidden, positions, parents, None, layers)


def residual_stream(model: FullModel, tokens: torch.Tensor) -> list[torch.Tensor]:
    """[h_0, h_1, ..., h_L] for windows ``tokens`` (B, q); h_k is the stream after k layers."""
    h0 = model.embed(tokens)
    return [h0, *run_layers(model.layers, h0)]


class SplitStates(NamedTuple):
    """Hidden states (B, q, H) of windows through a split deployment."""

    head: torch.Tensor  # h_head, the edge's head output before the send noise
    sent: torch.Tensor  # h_head plus the send noise: what the cloud receives
    returned: torch.Tensor  # the trunk's output on ``sent``: what the cloud returns
    final: torch.Tensor  # the tail's output (before the final norm)


def split_forward(
    model: FullModel,
    plan: SplitPlan,
    inputs: torch.Tensor,
    noise_scale: float = 0.0,
    generator: torch.Generator | None = None,
) -> SplitStates:
    """The hidden states of windows ``inputs`` (B, q) through a split deployment with send noise.

    Gradients flow when enabled by the caller.
    """
    h = model.embed(inputs)
    h_head = run_layers(model.layers, h, plan.head_layers)[-1]  # (B, q, H)
    noise = None
    if noise_scale > 0:
        noise = torch.randn(h_head.shape, generator=generator, dtype=torch.float32).to(h_head.dtype)
    sent = add_send_noise(h_head, noise_scale, noise)
    returned = run_layers(model.layers, sent, plan.trunk_layers)[-1]
    final = run_layers(model.layers, returned, plan.tail_layers)[-1]
    return SplitStates(h_head, sent, returned, final)


@torch.no_grad()
def cloud_view(
    model: FullModel, plan: SplitPlan, tokens: np.ndarray, noise_scale: float = 0.0, seed: int = 0, batch: int = 16
) -> dict[str, np.ndarray]:
    """What the cloud sees from a deployment under ``plan`` with send noise: {"input", "output"} (n, q, H) float32.

    ``input`` is the noisy state sent up (h_head + noise), ``output`` the trunk's reply to it.
    """
    gen = torch.Generator().manual_seed(seed)
    sent: list[np.ndarray] = []
    returned: list[np.ndarray] = []
    for s in range(0, tokens.shape[0], batch):
        states = split_forward(model, plan, torch.from_numpy(tokens[s : s + batch]).long(), noise_scale, gen)
        sent.append(states.sent.float().numpy())
        returned.append(states.returned.float().numpy())
    return {"input": np.concatenate(sent), "output": np.concatenate(returned)}


@torch.no_grad()
def collect_layers(
    model: FullModel, tokens: np.ndarray, layer_ks: Iterable[int], batch: int = 16
) -> dict[int, np.ndarray]:
    """{k: h_k as float32 (n_windows, q, H)} for the requested stream indices k."""
    ks = sorted(set(layer_ks))
    n_layers = len(model.layers.layers)
    if any(k < 0 or k > n_layers for k in ks):
        raise ValueError(f"stream indices must lie in 0..{n_layers}, got {ks}")
    out: dict[int, list[np.ndarray]] = {k: [] for k in ks}
    for s in range(0, tokens.shape[0], batch):
        stream = residual_stream(model, torch.from_numpy(tokens[s : s + batch]))
        for k in ks:
            out[k].append(stream[k].float().numpy())
    return {k: np.concatenate(v) for k, v in out.items()}


@torch.no_grad()
def stock_tail_top5(public: FullModel, hidden: np.ndarray, depth: int, batch: int = 16) -> np.ndarray:
    """The public tail attack: published last ``depth`` layers + norm + LM head on returned states.

    ``hidden`` is the output side (n, q, H); returns (n, q, 5) top-5 next-token ids per position.
    """
    n_layers = len(public.layers.layers)
    tail = range(n_layers - depth, n_layers)
    tops: list[np.ndarray] = []
    for s in range(0, hidden.shape[0], batch):
        h = torch.from_numpy(hidden[s : s + batch]).to(public.dtype)
        h = run_layers(public.layers, h, tail)[-1]
        logits = public.logits(h)
        tops.append(logits.topk(5, dim=-1).indices.numpy())
    return np.concatenate(tops)
