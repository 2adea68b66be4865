"""A per-sequence KV cache that can keep an accepted path and drop the rest.

transformers' attention layers call ``cache.update(key, value, layer_idx)`` and attend over what
it returns; :class:`KVCache` implements that call over growable buffers and adds the two edits
speculative decoding needs: ``truncate(n)`` and ``keep_last(indices)``. Entries are stored in
position order: entry i holds position i once a step is committed. The buffers grow in blocks of
``block_tokens`` entries (:data:`KV_BLOCK_TOKENS`), so a cache holds at most one block beyond
its entries and the memory per entry approaches the theoretical KV size.
"""

from __future__ import annotations

import threading

import torch

from splitspec.protocol.messages import kept_length, truncated_length

KV_BLOCK_TOKENS = 16  # default allocation granularity of a cache's buffers, entries


class KVLedger:
    """The bytes a set of caches hold, kept as their buffers are (re)allocated: a trunk reads its KV
    memory in O(1) on every step instead of summing every session's cache. Caches grow on compute
    threads while the event loop reads and releases, so changes happen under ``lock``."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.nbytes = 0  # bytes held by the attached caches


class KVCache:
    """Keys and values for a set of layers of one sequence. Shapes are (1, kv_heads, T, head_dim)."""

    def __init__(self, block_tokens: int = KV_BLOCK_TOKENS) -> None:
        if block_tokens < 1:
            raise ValueError(f"a KV block must hold at least 1 entry, got {block_tokens}")
        self.block_tokens = block_tokens
        self._nbytes = 0  # bytes of every buffer, kept as they are (re)allocated
        self._ledger: KVLedger | None = None  # where a trunk totals its caches' bytes (see attach)
        self._keys: dict[int, torch.Tensor] = {}
        self._values: dict[int, torch.Tensor] = {}
        self._length = 0  # committed entries, identical across layers
        self._pending = 0  # entries appended by the step in flight (same for each layer)
        self._reserved = 0  # entries the buffers should have room for when they next grow (see reserve)
        self.last_step = 0  # query tokens of the most recent step

    def __len__(self) -> int:
        return self._length

    @property
    def nbytes(self) -> int:
        """Memory held by the buffers (their capacity, not only the committed entries), bytes."""
        return self._nbytes

    def attach(self, ledger: KVLedger) -> None:
        """Count this cache's bytes, now and as it grows, in ``ledger`` (until :meth:`detach`)."""
        with ledger.lock:
            self._ledger = ledger
            ledger.nbytes += self._nbytes

    def detach(self) -> None:
        """Take this cache's bytes out of its ledger (the cache is being dropped); later growth is not counted."""
        ledger = self._ledger
        if ledger is not None:
            with ledger.lock:
                ledger.nbytes -= self._nbytes
                self._ledger = None

    def _account(self, delta: int) -> None:
        """The buffers now hold ``delta`` more bytes (a growth, or a first allocation)."""
        ledger = self._ledger
        if ledger is None:
            self._nbytes += delta
            return
        with ledger.lock:  # with detach: a cache dropped while it grows leaves the ledger exact
            self._nbytes += delta
            if self._ledger is ledger:
                ledger.nbytes += delta

    @property
    def capacity(self) -> int:
        """Entries the buffers hold room for (0 while empty), tokens."""
        return next((buf.shape[2] for buf in self._keys.values()), 0)

    def reserve(self, entries: int) -> None:
        """Make the next growth room for ``entries`` entries at once: a step computed in chunks (a big prefill)
        then copies the buffers once, not once per chunk (O(n) instead of O(n^2) copying)."""
        self._reserved = entries

    def capacity_after(self, entries: int) -> int:
        """The capacity once the cache holds ``entries`` entries: the one home of the growth policy
        (``entries`` rounded up to whole blocks), so a trunk can account a step's memory before running it."""
        if entries <= self.capacity:
            return self.capacity
        return -(-entries // self.block_tokens) * self.block_tokens

    @property
    def device(self) -> torch.device | None:
        """Where the first layer's buffers live (None while empty); layers may sit on several devices."""
        return next((buf.device for buf in self._keys.values()), None)

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Append a step's keys/values (1, kv, q, d) for ``layer_idx``; return all (1, kv, T+q, d)."""
        q = key.shape[2]
        end = self._length + q
        buf_k = self._keys.get(layer_idx)
        if buf_k is None or buf_k.shape[2] < end:
            capacity = self.capacity_after(max(end, self._reserved))  # the first layer grows; the others follow
            new_k = key.new_empty((*key.shape[:2], capacity, key.shape[3]))
            new_v = value.new_empty((*value.shape[:2], capacity, value.shape[3]))
            delta = _bytes_of(new_k) + _bytes_of(new_v)
            if buf_k is not None:
                new_k[:, :, : self._length] = buf_k[:, :, : self._length]
                new_v[:, :, : self._length] = self._values[layer_idx][:, :, : self._length]
                delta -= _bytes_of(buf_k) + _bytes_of(self._values[layer_idx])
            self._account(delta)
            self._keys[layer_idx], self._values[layer_idx] = new_k, new_v
        self._keys[layer_idx][:, :, self._length : end] = key
        self._values[layer_idx][:, :, self._length : end] = value
        self._pending = q
        return self._keys[layer_idx][:, :, :end], self._values[layer_idx][:, :, :end]

    def commit(self) -> None:
        """Make the step in flight part of the cache (called after every layer ran)."""
        self._length += self._pending
        self.last_step = self._pending
        self._pending = 0

    def rollback(self) -> None:
        """Forget the step in flight (its forward pass failed)."""
        self._pending = 0

    def truncate(self, length: int) -> None:
        """Drop every entry at index >= ``length``."""
        self._length = truncated_length(self._length, length)
        self.last_step = 0

    @torch.inference_mode()  # the buffers were created under inference mode
    def keep_last(self, indices: tuple[int, ...]) -> None:
        """Keep only ``indices`` (strictly increasing, within the last step) of the last step's entries."""
        start = self._length - self.last_step
        kept = kept_length(self._length, self.last_step, indices)
        if list(indices) != list(range(len(indices))):  # a prefix of the step is already in place
            # built on the host, copied without blocking: no host sync (a tensor made on the device would wait)
            src = torch.tensor([start + i for i in indices], dtype=torch.long).to(self.device, non_blocking=True)
            dst = slice(start, start + len(indices))
            for layer_idx, buf in self._keys.items():
                src = src.to(buf.device, non_blocking=True)  # a no-op unless layers span devices
                buf[:, :, dst] = buf.index_select(2, src)
                vals = self._values[layer_idx]
                vals[:, :, dst] = vals.index_select(2, src)
        self._length = kept
        self.last_step = 0


def _bytes_of(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
