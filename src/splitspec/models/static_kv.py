"""A KV cache preallocated to a fixed capacity: the buffers a fixed-shape (compiled) decode step needs.

:class:`StaticKVCache` is a :class:`~splitspec.models.kv_cache.KVCache` whose buffers are
allocated once, at the first step, to ``size`` entries per layer (zero-filled) and never grow or
move. Everything else is KVCache's: entries in position order, ``commit``/``rollback`` of the
step in flight, ``truncate``, ``keep_last`` (the accepted path of a draft tree), ``nbytes`` and
``capacity`` (the whole allocation, so a trunk's ``--kv-budget-mb`` accounts it from the first
step), ``capacity_after`` (always ``size``: the one growth rule of a cache that never grows).

Steps of any shape (prefill, draft trees) write their entries after the committed ones and attend
over those entries only, exactly as with the growable cache. A *fixed* step (one query token,
:meth:`begin_fixed_step`) instead writes its entry with ``index_copy_`` at a slot given as a
device tensor and attends over the whole buffer under a mask
(:func:`splitspec.models.fixed_decode.fixed_step_mask`): its shapes never change from one step to
the next, which is what ``torch.compile`` and CUDA graphs need. The zero fill keeps the slots the
mask hides finite (a NaN there would poison the softmax even at weight zero).
"""

from __future__ import annotations

import torch

from splitspec.exceptions import ConfigError
from splitspec.models.kv_cache import KVCache


def static_cache_size(compile_mode: str | None, max_cache_tokens: int | None, max_positions: int) -> int | None:
    """The static KV size of a role: ``max_cache_tokens`` (else ``max_positions``) with ``--compile``,
    None without (growable caches); a size given without ``--compile`` or out of range is refused."""
    if compile_mode is None:
        if max_cache_tokens is not None:
            raise ConfigError("--max-cache-tokens sizes the static KV buffers of --compile: give --compile too")
        return None
    size = max_positions if max_cache_tokens is None else max_cache_tokens
    if not 1 <= size <= max_positions:
        raise ConfigError(f"--max-cache-tokens must be between 1 and the model's {max_positions} positions")
    return size


class StaticKVCache(KVCache):
    """Keys and values (1, kv_heads, size, head_dim) per layer, allocated once at the first step."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ConfigError(f"a static KV cache needs room for at least one entry, got {size}")
        super().__init__()
        self.size = size  # entries per layer, tokens
        self._fixed_slot: torch.Tensor | None = None  # (1,) long on the device: the fixed step's slot

    @property
    def capacity(self) -> int:
        """Entries the buffers hold room for: ``size`` once allocated, 0 before the first step."""
        return self.size if self._keys else 0

    def capacity_after(self, entries: int) -> int:
        """``size``, whatever ``entries``: the buffers never grow (a caller refuses more entries than that)."""
        if entries > self.size:
            raise ValueError(f"{entries} entries do not fit a static KV cache of {self.size}")
        return self.size

    def fits(self, entries: int) -> bool:
        """Whether the cache can hold ``entries`` entries."""
        return entries <= self.size

    def begin_fixed_step(self, slot: torch.Tensor) -> None:
        """The next step is one query token written at ``slot`` (a (1,) long tensor on the buffers'
        device, the committed length) and attending over the whole buffer."""
        self._fixed_slot = slot
        self._pending = 1

    def end_fixed_step(self) -> None:
        self._fixed_slot = None

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Write a step's keys/values (1, kv, q, d) for ``layer_idx``; return what the step attends over:
        the committed entries and the step's own (1, kv, T+q, d), or the whole buffer (1, kv, size, d)
        for a fixed step."""
        if self._fixed_slot is not None:
            keys, values = self._keys[layer_idx], self._values[layer_idx]
            keys.index_copy_(2, self._fixed_slot, key)
            values.index_copy_(2, self._fixed_slot, value)
            return keys, values
        if layer_idx not in self._keys:
            self._keys[layer_idx] = key.new_zeros((*key.shape[:2], self.size, key.shape[3]))
            self._values[layer_idx] = value.new_zeros((*value.shape[:2], self.size, value.shape[3]))
            for buf in (self._keys[layer_idx], self._values[layer_idx]):
                self._account(buf.numel() * buf.element_size())
                # a CUDA graph writes into these buffers in place: their address is part of the
                # graph (a session's buffers are recorded once), not an input copied on every replay
                torch._dynamo.mark_static_address(buf)
        if self._length + key.shape[2] > self.size:
            raise ValueError(f"a step of {key.shape[2]} entries overflows a static KV cache of {self.size}")
        return super().update(key, value, layer_idx)
