"""The fixed-shape decode step: one query token through a layer stack over a static KV cache.

A decode step (one token, its parent the committed prefix) is the step a generation repeats, and
on an accelerator at batch 1 its time goes to launching kernels from Python, not to computing
them. :class:`FixedShapeDecode` runs it with shapes that never change: the token's key and value
go into a :class:`~splitspec.models.static_kv.StaticKVCache` at a slot held in a device tensor,
and attention covers the whole preallocated buffer under a mask built on the device from that
slot (:func:`fixed_step_mask`). Nothing in the step reads a device value on the host, and no
Python value changes between steps, so the step can be compiled once (``torch.compile`` with
``fullgraph=True``: a host sync or a data-dependent branch would fail the compile) and, on CUDA
with mode ``reduce-overhead``, replayed as a CUDA graph, as gpt-fast does.

Prefill and draft-tree steps keep the eager path (:meth:`LayerStack.run`): their shapes vary.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any, Protocol

import torch

from splitspec.exceptions import CompileFailed, ConfigError
from splitspec.models.compile_modes import COMPILE_MODES
from splitspec.models.kv_cache import KVCache
from splitspec.models.static_kv import StaticKVCache


class DecoderStack(Protocol):
    """What the step needs of a :class:`~splitspec.models.stack.LayerStack` (named here without importing it)."""

    layers: Any  # nn.ModuleList of decoder layers
    devices: list[torch.device]  # one per layer
    windows: list[int | None]  # each layer's sliding window
    layer_types: list[str]  # each layer's type (its rotary table)
    hidden_size: int

    def position_embeddings(
        self, hidden: torch.Tensor, pos: torch.Tensor
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]: ...

    def run_layer(
        self,
        j: int,
        hidden: torch.Tensor,
        pos: torch.Tensor,
        rope: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
        masks: Mapping[Any, torch.Tensor | None],
        cache: Any,
    ) -> torch.Tensor: ...

    def __call__(
        self, hidden: torch.Tensor, positions: torch.Tensor, parents: torch.Tensor, cache: KVCache
    ) -> torch.Tensor: ...


log = logging.getLogger(__name__)


def compile_mode_for(mode: str, device: torch.device) -> str:
    """The torch.compile mode ``mode`` names on ``device`` (``auto``: CUDA graphs on CUDA, else ``default``)."""
    if mode not in COMPILE_MODES:
        raise ConfigError(f"compile mode {mode!r} is not one of {', '.join(COMPILE_MODES)}")
    if mode == "auto":
        return "reduce-overhead" if device.type == "cuda" else "default"
    return mode


def fixed_step_mask(slot: torch.Tensor, size: int, dtype: torch.dtype, sliding_window: int | None) -> torch.Tensor:
    """Additive mask (1, 1, 1, size) for one query token at position ``slot`` (a (1,) tensor): 0 on
    slots 0..slot (the committed prefix and the token itself; slot i holds position i), dtype-min
    elsewhere, and with a sliding window w also on slots <= slot - w."""
    keys = torch.arange(size, device=slot.device)  # (size,)
    allowed = keys <= slot
    if sliding_window is not None:
        allowed &= keys > slot - sliding_window
    mask = torch.zeros(size, dtype=dtype, device=slot.device).masked_fill(~allowed, torch.finfo(dtype).min)
    return mask[None, None, None]


class FixedShapeDecode:
    """Decode steps of ``stack`` over static caches, eager or compiled (``compile_mode``)."""

    def __init__(self, stack: DecoderStack, compile_mode: str | None = None, backend: str = "inductor") -> None:
        devices = set(stack.devices)
        if len(devices) != 1:
            raise ConfigError("the fixed-shape decode step runs a stack on one device (not with --devices)")
        self.stack = stack
        self.device = next(iter(devices))
        self.mode = None if compile_mode is None else compile_mode_for(compile_mode, self.device)
        self.steps = 0  # decode steps run through this path
        self._step: Any = self._layers
        if self.mode is not None:
            # dynamic=False: one graph for the one shape; fullgraph: a graph break is a failure, not a
            # fallback. ``backend`` other than inductor: tests ("eager" captures the graph, runs it as is)
            mode = self.mode if backend == "inductor" else None  # the modes are inductor's
            self._step = torch.compile(self._layers, backend=backend, mode=mode, fullgraph=True, dynamic=False)

    def applies(self, hidden: torch.Tensor, cache: KVCache) -> bool:
        """Whether this step is a fixed one: one token on a static cache that holds its first step already."""
        return hidden.shape[1] == 1 and isinstance(cache, StaticKVCache) and cache.capacity > 0

    def __call__(self, hidden: torch.Tensor, positions: torch.Tensor, cache: StaticKVCache) -> torch.Tensor:
        """hidden (1, 1, H) on the device, positions (1,) on the host (the committed length) -> (1, 1, H).

        The cache receives the entry but is not committed here (as :meth:`LayerStack.run`).
        """
        pos = positions.to(self.device, torch.long, non_blocking=True)[None]  # (1, 1)
        cache.begin_fixed_step(pos[0])
        try:
            out: torch.Tensor = self._step(hidden, pos, cache)
        finally:
            cache.end_fixed_step()
        self.steps += 1
        return out

    def _layers(self, hidden: torch.Tensor, pos: torch.Tensor, cache: StaticKVCache) -> torch.Tensor:
        """The traced body: rotary, masks and every layer; no host read, no value-dependent branch."""
        stack = self.stack
        rope = stack.position_embeddings(hidden, pos)
        masks = {w: fixed_step_mask(pos[0], cache.size, hidden.dtype, w) for w in set(stack.windows)}
        for j in range(len(stack.layers)):
            hidden = stack.run_layer(j, hidden, pos, rope, masks, cache)
        return hidden

    def warm_up(self, size: int) -> float:
        """Compile (when compiling) by running a prefill and two decode steps on a scratch cache of
        ``size`` entries; return the seconds it took. A compile that fails raises
        :class:`~splitspec.exceptions.CompileFailed` with one clear line."""
        t0 = time.perf_counter()
        dtype = next(self.stack.layers[0].parameters()).dtype
        cache = StaticKVCache(size)
        with torch.inference_mode():  # steps see inference tensors (activations, HostStaging's copies)
            token = torch.zeros(1, 1, self.stack.hidden_size, dtype=dtype, device=self.device)  # (1, 1, H)
        one = torch.tensor([-1], dtype=torch.int32)
        self.stack(token, torch.tensor([0], dtype=torch.int32), one, cache)  # allocates the buffers
        try:
            for position in (1, 2):  # the second call checks the first one's graph is reused
                self.stack(token, torch.tensor([position], dtype=torch.int32), one, cache)
        except Exception as exc:  # torch's compile errors have no common base; each becomes one typed line
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise CompileFailed(
                f"--compile: torch.compile (mode {self.mode}) of the decode step on {self.device} failed: "
                f"{type(exc).__name__}: {first}"
            ) from exc
        seconds = time.perf_counter() - t0
        if self.mode is not None:
            log.info("decode step compiled (mode %s, %d-entry static KV) in %.1f s", self.mode, size, seconds)
        return seconds
