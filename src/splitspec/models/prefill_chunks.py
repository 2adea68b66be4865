"""How many tokens of a big prefill one batching iteration computes (the chunk-sizing rule).

Between two chunks of a prefill every waiting decode step runs (see :mod:`splitspec.cloud.batcher`),
so a decode step waits for at most one chunk. While decode traffic is live (a batch of small
steps ran within :data:`DECODE_LIVE_S`), a chunk is sized from measured costs so that its forward
takes about :data:`CHUNK_COST_RATIO` times a decode batch's: an iteration (decode batch + chunk)
then stays within about twice a decode batch, whatever the hardware. With no decode traffic the
prefill runs in chunks of the configured maximum (``--prefill-chunk``): nobody is waiting.
"""

from __future__ import annotations

DECODE_LIVE_S = 1.0  # decode traffic counts as live this long after a batch of small steps ran
CHUNK_COST_RATIO = 1.0  # a chunk among live decode traffic aims at this many decode batches' time
MIN_CHUNK_TOKENS = 16  # a prefill always advances at least this much per iteration
SMOOTHING = 0.3  # weight of the newest measurement in the running (exponential) means


def _running_mean(old: float | None, new: float) -> float:
    return new if old is None else (1 - SMOOTHING) * old + SMOOTHING * new


class ChunkSizer:
    """Measures decode batches and prefill chunks, and sizes the next chunk from them."""

    def __init__(self, max_tokens: int, min_tokens: int = MIN_CHUNK_TOKENS) -> None:
        if max_tokens < 1:
            raise ValueError(f"the largest prefill chunk must be at least 1 token, got {max_tokens}")
        self.max_tokens = max_tokens
        self.min_tokens = min(min_tokens, max_tokens)
        self.decode_ms: float | None = None  # running mean of a decode batch's forward, ms
        self.chunk_ms_per_token: float | None = None  # running mean of a chunk's forward per token, ms
        self.decode_at: float | None = None  # when the last decode batch ended (time.perf_counter)

    def observe_decode(self, ms: float, now: float) -> None:
        self.decode_ms = _running_mean(self.decode_ms, ms)
        self.decode_at = now

    def observe_chunk(self, tokens: int, ms: float) -> None:
        self.chunk_ms_per_token = _running_mean(self.chunk_ms_per_token, ms / tokens)

    def next_chunk(self, now: float) -> int:
        """Tokens for the next chunk: the maximum without live decode traffic, else what fits in
        :data:`CHUNK_COST_RATIO` decode batches (the minimum until a chunk's cost is known)."""
        if self.decode_ms is None or self.decode_at is None or now - self.decode_at > DECODE_LIVE_S:
            return self.max_tokens
        if self.chunk_ms_per_token is None:
            return self.min_tokens
        fits = int(CHUNK_COST_RATIO * self.decode_ms / self.chunk_ms_per_token)
        return max(self.min_tokens, min(self.max_tokens, fits))
