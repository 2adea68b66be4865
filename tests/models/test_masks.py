"""Tree masks and cache edits: a drafted token sees the prefix and its ancestors, nothing else."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from splitspec.models.checkpoint import Checkpoint
from splitspec.models.kv_cache import KVCache
from splitspec.models.loading import load_edge
from splitspec.models.masks import ancestor_matrix, depths, step_mask, step_positions
from splitspec.models.split import SplitPlan
from splitspec.models.stack import EdgeModel

# step: 0 <- prefix, 1 <- 0, 2 <- prefix (sibling branch of 0), 3 <- 2, 4 <- 1
PARENTS = torch.tensor([-1, 0, -1, 2, 1], dtype=torch.int32)


def test_ancestors_and_depths() -> None:
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [0, 0, 1, 0, 0],
            [0, 0, 1, 1, 0],
            [1, 1, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(ancestor_matrix(PARENTS), expected)
    assert depths(PARENTS).tolist() == [0, 1, 0, 1, 2]
    chain = torch.arange(-1, 4, dtype=torch.int32)
    assert torch.equal(ancestor_matrix(chain), torch.ones(5, 5, dtype=torch.bool).tril())


def test_step_positions_are_the_past_length_plus_each_depth() -> None:
    assert step_positions(7, PARENTS.tolist()) == [7, 8, 7, 8, 9]
    assert step_positions(3, [-1, 0, 1, 2]) == [3, 4, 5, 6]  # a chain
    assert step_positions(0, [-1]) == [0]
    rng = torch.Generator().manual_seed(5)
    for q in range(1, 40):  # random trees: every parent earlier in the step, or the prefix
        parents = [int(torch.randint(-1, i, (1,), generator=rng)) for i in range(q)]
        assert step_positions(11, parents) == (11 + depths(torch.tensor(parents))).tolist()


def test_step_mask_hides_siblings_and_later_tokens() -> None:
    mask = step_mask(PARENTS, 3 + depths(PARENTS), past_length=3, dtype=torch.float32)[0, 0]
    visible = mask == 0
    assert visible.shape == (5, 8)
    assert visible[:, :3].all()  # every query sees the committed prefix
    assert not visible[2, 3]
    assert not visible[2, 4]
    assert not visible[0, 4]
    assert not visible[1, 7]
    assert visible[4, 3]
    assert visible[4, 4]
    assert visible[4, 7]


def test_sliding_window_mask() -> None:
    chain = torch.arange(-1, 2, dtype=torch.int32)
    positions = torch.arange(5, 8, dtype=torch.int32)
    visible = step_mask(chain, positions, past_length=5, dtype=torch.float32, sliding_window=3)[0, 0] == 0
    # query at position 7 sees keys at positions 5, 6, 7 only
    assert visible[2].tolist() == [False] * 5 + [True, True, True]


def test_a_window_of_keys_that_does_not_start_at_zero() -> None:
    """An EAGLE head's cache holds the pairs of its window, from the window's start: 4 keys at positions 16-19
    before a step at 20-21. With a window of 5 the query at 20 sees all of them and the one at 21 all but 16; the
    mask placed them at 0-3 and hid them all (the head's root feature then ignored its whole cached window once
    the window moved on)."""
    chain = torch.arange(-1, 1, dtype=torch.int32)
    positions = torch.arange(20, 22, dtype=torch.int32)
    visible = step_mask(chain, positions, past_length=4, dtype=torch.float32, sliding_window=5)[0, 0] == 0
    assert visible[0].tolist() == [True, True, True, True, True, False]  # keys 16-19 and itself, not 21
    assert visible[1].tolist() == [False, True, True, True, True, True]  # 16 is 5 behind 21: out of its window


@pytest.fixture
def edge(make_checkpoint: Callable[..., Path]) -> EdgeModel:
    model = make_checkpoint("llama")
    return load_edge(Checkpoint(model), SplitPlan(6, 2, 2), torch.float32)


def run_chain(edge: EdgeModel, tokens: list[int]) -> torch.Tensor:
    cache = KVCache()
    q = len(tokens)
    return edge.run_head(
        torch.tensor(tokens), torch.arange(q, dtype=torch.int32), torch.arange(-1, q - 1, dtype=torch.int32), cache
    )[0]


PREFIX = [5, 9, 17, 3]
TREE_TOKENS = [20, 21, 30, 31, 22]  # branch A: 20 -> 21 -> 22 ; branch B: 30 -> 31


def run_tree(edge: EdgeModel, cache: KVCache) -> torch.Tensor:
    run_chain_into(edge, PREFIX, cache)
    positions = (len(PREFIX) + depths(PARENTS)).to(torch.int32)
    return edge.run_head(torch.tensor(TREE_TOKENS), positions, PARENTS, cache)[0]


def run_chain_into(edge: EdgeModel, tokens: list[int], cache: KVCache) -> torch.Tensor:
    start, q = len(cache), len(tokens)
    return edge.run_head(
        torch.tensor(tokens),
        torch.arange(start, start + q, dtype=torch.int32),
        torch.arange(-1, q - 1, dtype=torch.int32),
        cache,
    )[0]


def test_tree_step_equals_each_branch_run_alone(edge: EdgeModel) -> None:
    """Fails if a drafted token could see a sibling branch (e.g. with is_causal=True)."""
    tree = run_tree(edge, KVCache())
    branch_a = run_chain(edge, [*PREFIX, 20, 21, 22])[len(PREFIX) :]
    branch_b = run_chain(edge, [*PREFIX, 30, 31])[len(PREFIX) :]
    torch.testing.assert_close(tree[[0, 1, 4]], branch_a, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tree[[2, 3]], branch_b, rtol=1e-5, atol=1e-5)


def test_keep_last_commits_the_accepted_branch(edge: EdgeModel) -> None:
    cache = KVCache()
    run_tree(edge, cache)
    cache.keep_last((2, 3))  # accept branch B: 30 -> 31
    assert len(cache) == len(PREFIX) + 2
    after = run_chain_into(edge, [40], cache)
    reference = run_chain(edge, [*PREFIX, 30, 31, 40])[-1:]
    torch.testing.assert_close(after, reference, rtol=1e-5, atol=1e-5)


def test_cache_edits_validate() -> None:
    cache = KVCache()
    k = torch.zeros(1, 2, 3, 4)
    cache.update(k, k, 0)
    cache.commit()
    with pytest.raises(ValueError, match="cannot truncate"):
        cache.truncate(4)
    with pytest.raises(ValueError, match="outside the last step"):
        cache.keep_last((3,))
    cache.update(torch.ones(1, 2, 200, 4), torch.ones(1, 2, 200, 4), 0)  # grows past initial capacity
    cache.rollback()
    assert len(cache) == 3
    cache.truncate(1)
    assert len(cache) == 1


def test_the_cache_grows_in_blocks_and_counts_its_bytes() -> None:
    cache = KVCache(block_tokens=16)
    per_entry = 2 * 2 * 4 * 4  # keys and values, 2 kv heads of 4, float32, one layer
    for step, capacity in ((3, 16), (13, 16), (1, 32), (40, 64)):
        assert cache.capacity_after(len(cache) + step) == capacity  # what the budget accounts
        cache.update(torch.ones(1, 2, step, 4), torch.ones(1, 2, step, 4), 0)
        cache.commit()
        assert cache.capacity == capacity
        assert cache.nbytes == capacity * per_entry == cache._keys[0].nbytes + cache._values[0].nbytes
    assert cache.nbytes < (len(cache) + 16) * per_entry  # at most one block beyond the entries
    with pytest.raises(ValueError, match="at least 1 entry"):
        KVCache(block_tokens=0)


def test_a_reserved_cache_grows_once_for_a_step_computed_in_chunks() -> None:
    """A 100-token prefill in 16-token chunks: reserved, its buffers are allocated (and copied) once."""
    cache = KVCache(block_tokens=16)
    cache.update(torch.ones(1, 2, 5, 4), torch.ones(1, 2, 5, 4), 0)  # an earlier step
    cache.commit()
    cache.reserve(5 + 100)
    buffers = set()
    for start in range(0, 100, 16):
        chunk = min(16, 100 - start)
        cache.update(torch.full((1, 2, chunk, 4), float(start)), torch.ones(1, 2, chunk, 4), 0)
        cache.commit()
        buffers.add(cache._keys[0].data_ptr())
    assert len(buffers) == 1  # without the reservation: a new buffer for each block crossed
    assert cache.capacity == cache.capacity_after(105) == 112
    assert len(cache) == 105
    assert torch.equal(cache._keys[0][0, 0, :5, 0], torch.ones(5))  # the earlier step survived the one growth
    assert torch.equal(cache._keys[0][0, 0, 5:105:16, 0], torch.arange(0.0, 100.0, 16))
