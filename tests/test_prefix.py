"""common_prefix: the block-compare search agrees with a token-by-token walk on every kind of pair."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from splitspec.prefix import BLOCK, common_prefix


def walk(a: Sequence[int], b: Sequence[int], limit: int | None = None) -> int:
    n = min(len(a), len(b)) if limit is None else max(0, min(len(a), len(b), limit))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def test_agrees_with_a_walk_on_random_pairs() -> None:
    rng = random.Random(7)
    mismatch_at_block_edges = 0
    for _ in range(2000):
        a = [rng.randrange(4) for _ in range(rng.randrange(0, 5 * BLOCK))]
        b = list(a[: rng.randrange(0, len(a) + 1)])  # a prefix of a ...
        b += [rng.randrange(4) for _ in range(rng.randrange(0, 3 * BLOCK))]  # ... then anything
        limit = rng.choice([None, rng.randrange(-2, len(a) + 3)])
        want = walk(a, b, limit)
        assert common_prefix(a, b, limit) == want
        assert common_prefix(tuple(b), a, limit) == want  # either order, any sequence type
        mismatch_at_block_edges += want % BLOCK in (0, BLOCK - 1) and want < min(len(a), len(b))
    assert mismatch_at_block_edges > 20  # the boundaries of the block search were exercised


@pytest.mark.parametrize(
    ("a", "b", "limit", "want"),
    [
        ([], [1], None, 0),
        ([1, 2, 3], [1, 2, 3], None, 3),
        ([1, 2, 3], [1, 2, 3, 4], 2, 2),
        ([1, 2, 3], [1, 2], -1, 0),
        (list(range(200)), [*range(130), -1], None, 130),
        (list(range(200)), [*range(BLOCK), -1], None, BLOCK),
        (list(range(200)), [*range(BLOCK - 1), -1], None, BLOCK - 1),
        ((5, 6), [5, 6, 7], None, 2),
    ],
)
def test_literal_cases(a: Sequence[int], b: Sequence[int], limit: int | None, want: int) -> None:
    assert common_prefix(a, b, limit) == want
