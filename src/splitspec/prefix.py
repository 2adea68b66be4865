"""The longest common prefix of two token sequences: how much of a cache a new context can keep; and where a
windowed cache starts.

Every cache that follows a growing context (a draft model's, an n-gram pool's, the local model's,
a federated link's, a conversation's) asks this on every step, over contexts of thousands of
tokens. A Python loop over the tokens costs about 0.2 us a token (0.4 ms at 2,000); comparing
lists compares in C, so the common case (one context extends the other) is one comparison, and a
mismatch is found a block at a time, walking by hand only inside the block that holds it.
"""

from __future__ import annotations

from collections.abc import Sequence

BLOCK = 64  # tokens compared at once while looking for the block that holds the first mismatch


def _head(tokens: Sequence[int], n: int) -> list[int]:
    part = tokens[:n]
    return part if isinstance(part, list) else list(part)


def common_prefix(a: Sequence[int], b: Sequence[int], limit: int | None = None) -> int:
    """Length of the longest common prefix of ``a`` and ``b`` (at most ``limit``, at least 0)."""
    n = min(len(a), len(b)) if limit is None else max(0, min(len(a), len(b), limit))
    x, y = _head(a, n), _head(b, n)
    if x == y:
        return n
    start = 0
    while start + BLOCK < n and x[start : start + BLOCK] == y[start : start + BLOCK]:
        start += BLOCK
    i = start  # the first mismatch lies in [start, n)
    while x[i] == y[i]:
        i += 1
    return i


def window_start(length: int, window: int | None) -> int:
    """The index of the first of ``length`` tokens a cache holding at most ``window`` of them starts at (None: 0,
    all of them): 0 up to the window, then moving in steps of half of it, so that length - start stays in
    [window // 2, window]. A cache that follows a growing context is fed again from its new start once every
    half window of tokens, not at every token."""
    if window is None or length <= window:
        return 0
    half = window // 2
    return ((length - window) // half + 1) * half
