"""One sequence on the edge: its tokens, its head and tail KV caches, its cloud session and its statistics.

An :class:`EdgeSequence` is what a request (or a chat conversation) owns; everything it shares
with other sequences (weights, device, the trunk connections) lives in the
:class:`~splitspec.edge.runtime.EdgeRuntime` and the :class:`~splitspec.edge.engine.EdgeEngine`.
It keeps the token id behind every committed cache entry, so the engine can replay them on a new
cloud session when the trunk loses this one, and it edits its caches for speculative decoding
(``keep`` the accepted path, ``truncate`` to a reused prefix); the cloud's half of each edit
rides on the sequence's next step as a :class:`~splitspec.protocol.messages.CacheCommand`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from splitspec.decoding.controller import SpeculationController
from splitspec.edge.link import TrunkConnection
from splitspec.edge.runtime import EdgeRuntime
from splitspec.models.features import FeatureLog
from splitspec.protocol.messages import CacheCommand


@dataclass(frozen=True)
class StepStats:
    """What one round trip cost, as the edge saw it."""

    kind: str  # "prefill", "decode" or "replay"
    query_tokens: int  # tokens in the step
    network_ms: float  # round trip minus the cloud's compute (its queue included: see cloud_queue_ms), milliseconds
    edge_ms: float  # head + tail compute on the edge, batch waits included (see serialize_ms), milliseconds
    cloud_ms: float  # trunk compute reported by the cloud, milliseconds
    # copying the hidden state to the host and back + encoding the request + decoding the reply, on
    # the edge, milliseconds; on an accelerator the copy to the host also waits for the head's kernels
    serialize_ms: float
    bytes_up: int  # request frame, bytes
    bytes_down: int  # reply frame, bytes
    feature_bytes_down: int = 0  # of bytes_down: the state inside the trunk a draft head reads (asked per step), bytes
    # of edge_ms: waiting for the head's and the tail's batches (gathering, and the batches ahead), milliseconds
    edge_queue_ms: float = 0.0
    # of network_ms: the step's wait on the cloud before its compute (the trunk's batches), as the trunk reported it, ms
    cloud_queue_ms: float = 0.0


class EdgeSequence:
    """The per-sequence state of split inference (see the module docstring)."""

    def __init__(self, runtime: EdgeRuntime) -> None:
        self.runtime = runtime
        self.head_cache = runtime.new_cache()
        self.tail_cache = runtime.new_cache()
        self.tokens: list[int] = []  # token id behind every committed cache entry
        self.digests: list[bytes] = []  # keyed prefix digest of every committed token (send noise only)
        self.command: CacheCommand | None = None  # rides on the next step
        self.lost = False  # the cloud session is gone or unknown: recover before the next step
        self.connection: TrunkConnection | None = None  # where its cloud session lives
        self.session_id: str | None = None
        self.seq = 0  # sequence number of its last step
        self.steps: list[StepStats] = []
        self.recoveries = 0
        self.capacity_waits = 0  # steps sent again after a capacity refusal
        self.controller: SpeculationController | None = None  # its own acceptance estimates (see EdgeEngine)
        # every committed token's hidden states, for a drafter that reads them (an EAGLE head); None: not kept
        self.features: FeatureLog | None = None

    def keep_features(self, layers: Sequence[int]) -> FeatureLog | None:
        """Keep the features of ``layers`` (see :mod:`splitspec.models.features`) of every token committed from
        now on. Only a sequence that holds no tokens yet can start (or change) its log: the tokens already
        committed have no features, and None is returned (a drafter then has nothing to read)."""
        if self.features is not None and self.features.layers == tuple(layers):
            return self.features
        self.features = None if self.tokens else FeatureLog(layers)
        return self.features

    @property
    def edge_cache_bytes(self) -> int:
        """Memory this sequence holds on the edge: its KV caches (head and tail) and the features it keeps for a
        draft head, bytes (what a kept conversation costs the prefix cache)."""
        features = 0 if self.features is None else self.features.nbytes
        return self.head_cache.nbytes + self.tail_cache.nbytes + features

    def reset(self) -> None:
        """Start a new sequence: the cloud cache is truncated on the next step."""
        self.head_cache = self.runtime.new_cache()
        self.tail_cache = self.runtime.new_cache()
        # a pending command (a truncation, a kept path) is superseded: the cloud's cache empties too
        self.command = CacheCommand(truncate_to=0) if self.tokens or self.command is not None else None
        self.tokens = []
        self.digests = []
        if self.features is not None:
            self.features.clear()

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` committed tokens on both sides (prefix reuse across chat turns).

        The edge caches change now; the cloud's change rides on the next step, merged with a
        pending keep of the last step's accepted path.
        """
        if not 0 <= length <= len(self.tokens):
            raise ValueError(f"cannot truncate {len(self.tokens)} committed tokens to {length}")
        if length == len(self.tokens):
            return
        if not self.lost:  # a lost sequence's caches may be dropped (a cancelled step): its recovery replays the rest
            pending = self.command
            command = CacheCommand(truncate_to=length)
            if pending is not None and pending.keep_last is not None:
                start = len(self.tokens) - len(pending.keep_last)  # the kept step's first entry
                if length > start:
                    command = CacheCommand(
                        truncate_to=pending.truncate_to, keep_last=pending.keep_last[: length - start]
                    )
            self.head_cache.truncate(length)
            self.tail_cache.truncate(length)
            self.command = command
        del self.tokens[length:]
        del self.digests[length:]
        if self.features is not None:
            self.features.truncate(length)

    def keep(self, indices: Sequence[int]) -> None:
        """Keep only ``indices`` of the last step's entries (the accepted path), on both sides.

        The edge caches change now; the cloud's change rides on the next step (no extra trip).
        """
        if self.command is not None:
            raise RuntimeError("a cache command is already pending")
        keep = tuple(indices)
        start = len(self.tokens) - self.tail_cache.last_step
        self.head_cache.keep_last(keep)
        self.tail_cache.keep_last(keep)
        self.tokens = self.tokens[:start] + [self.tokens[start + i] for i in keep]
        if self.digests:
            self.digests = self.digests[:start] + [self.digests[start + i] for i in keep]
        if self.features is not None:
            self.features.keep(start, keep)
        self.command = CacheCommand(keep_last=keep)

    def forget_caches(self) -> list[int]:
        """Empty the edge caches for a replay on a fresh session; return the history to replay."""
        history = list(self.tokens)
        self.head_cache, self.tail_cache = self.runtime.new_cache(), self.runtime.new_cache()
        self.tokens, self.command, self.digests = [], None, []
        if self.features is not None:
            self.features.clear()  # the replay computes them again
        return history
