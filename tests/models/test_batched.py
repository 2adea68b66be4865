"""A batched trunk forward over ragged steps of several sessions equals each session's step alone (#15)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from splitspec.exceptions import ConfigError
from splitspec.models.batched import BatchedCaches, BatchRow, forward_batch
from splitspec.models.checkpoint import Checkpoint
from splitspec.models.kv_cache import KVCache
from splitspec.models.loading import load_edge, load_trunk
from splitspec.models.masks import depths
from splitspec.models.row_attention import ROWS_KWARG
from splitspec.models.split import SplitPlan
from tests.families import FAMILIES, save_family_checkpoint

# (committed prefix, parents of the step): decode, a draft tree, a prefill chunk, an empty cache
STEPS = [(9, [-1]), (4, [-1, 0, 0, 1, 2, -1]), (0, list(range(-1, 19))), (13, [-1, 0, 1])]


@pytest.mark.parametrize("family", sorted(FAMILIES))  # each family's attention, windows, norms and rotary
def test_each_row_equals_its_step_alone(tmp_path: Path, family: str) -> None:
    ckpt = Checkpoint(save_family_checkpoint(tmp_path, family, layers=6, seed=3, dtype=torch.float32))
    trunk = load_trunk(ckpt, SplitPlan(ckpt.config.num_hidden_layers, 2, 2), torch.float32)
    width = int(ckpt.config.hidden_size)
    torch.manual_seed(0)
    solo_caches, batch_caches, rows, expected = [], [], [], []
    for past, parents in STEPS:
        solo, batched = KVCache(), KVCache()
        if past:
            prefix = torch.randn(1, past, width)
            chain = torch.arange(-1, past - 1, dtype=torch.int32)
            trunk(prefix, torch.arange(past, dtype=torch.int32), chain, solo)
            trunk(prefix, torch.arange(past, dtype=torch.int32), chain, batched)
        parent_t = torch.tensor(parents, dtype=torch.int32)
        positions = (past + depths(parent_t)).to(torch.int32)
        hidden = torch.randn(1, len(parents), width)
        expected.append(trunk(hidden, positions, parent_t, solo))
        rows.append(BatchRow(hidden, positions, parent_t, batched))
        solo_caches.append(solo)
        batch_caches.append(batched)
    outs = forward_batch(trunk, rows)
    for out, want, solo, batched in zip(outs, expected, solo_caches, batch_caches, strict=True):
        assert out.shape == want.shape
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        assert (len(batched), batched.last_step) == (len(solo), solo.last_step)
        torch.testing.assert_close(batched._keys[2][:, :, : len(solo)], solo._keys[2][:, :, : len(solo)])
    # decode steps only (no padding, no masks) on the same caches
    steps = [(torch.randn(1, 1, width), torch.tensor([len(c)], dtype=torch.int32)) for c in solo_caches]
    chain1 = torch.tensor([-1], dtype=torch.int32)
    outs = forward_batch(trunk, [BatchRow(h, at, chain1, c) for (h, at), c in zip(steps, batch_caches, strict=True)])
    for out, (h, at), solo in zip(outs, steps, solo_caches, strict=True):
        torch.testing.assert_close(out, trunk(h, at, chain1, solo), rtol=1e-5, atol=1e-5)
    # a lone row (a prefill chunk, or one session decoding) takes the per-session path: same result
    solo, batched = solo_caches[0], batch_caches[0]
    at = torch.tensor([len(solo)], dtype=torch.int32)
    hidden = torch.randn(1, 1, width)
    (alone,) = forward_batch(trunk, [BatchRow(hidden, at, chain1, batched)])
    torch.testing.assert_close(alone, trunk(hidden, at, chain1, solo))
    assert len(batched) == len(solo)


def test_a_row_with_a_capture_layer_also_gets_that_layers_output(make_checkpoint: Callable[..., Path]) -> None:
    """capture: the row's output is (1, q, 2H), the stack's output then that layer's, batched or alone."""
    ckpt = Checkpoint(make_checkpoint("llama", layers=8))
    trunk = load_trunk(ckpt, SplitPlan(8, 2, 2), torch.float32)  # local layers 0 .. 3
    torch.manual_seed(1)
    hiddens = [torch.randn(1, 3, 64), torch.randn(1, 5, 64)]
    rows = []
    for hidden, capture in zip(hiddens, (1, None), strict=True):
        q = hidden.shape[1]
        positions, parents = torch.arange(q, dtype=torch.int32), torch.arange(-1, q - 1, dtype=torch.int32)
        rows.append(BatchRow(hidden, positions, parents, KVCache(), capture=capture))
    expected = [trunk.run(row.hidden, row.positions, row.parents, None) for row in rows]  # 4 x (1, q, H) each
    captured, plain = forward_batch(trunk, rows)
    torch.testing.assert_close(captured, torch.cat([expected[0][-1], expected[0][1]], -1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(plain, expected[1][-1], rtol=1e-5, atol=1e-5)
    (alone,) = forward_batch(trunk, [dataclasses.replace(rows[0], cache=KVCache())])  # the per-session path
    torch.testing.assert_close(alone, captured, rtol=1e-5, atol=1e-5)


def test_each_rows_attention_reads_its_own_cache_in_place() -> None:
    """No padded copy of the prefixes: a row attends over views of its own cache's buffers."""
    short, long_ = KVCache(), KVCache()
    for cache, past in ((short, 2), (long_, 5)):  # committed prefixes of 2 and 5 entries
        cache.update(torch.randn(1, 2, past, 4), torch.randn(1, 2, past, 4), 0)
        cache.commit()
    caches = BatchedCaches([short, long_], lengths=[1, 2], past=[2, 5])
    step_keys, step_values = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4)  # (1, kv, N, d): 1 + 2 tokens packed
    keys, values = caches.update(step_keys, step_values, 0)
    assert keys is step_keys  # row attention does not read the packed step
    assert values is step_values
    for b, (cache, length) in enumerate(((short, 3), (long_, 7))):
        row_keys, row_values = caches.keys.rows[0][b]
        assert row_keys.shape == row_values.shape == (1, 2, length, 4)
        assert row_keys.data_ptr() == cache._keys[0].data_ptr()  # a view of the cache's buffer
        assert row_values.data_ptr() == cache._values[0].data_ptr()
    # each row's step is its own slice of the packed one: the short row's token first, then the long row's two
    torch.testing.assert_close(caches.keys.rows[0][0][0][:, :, 2:], step_keys[:, :, :1])
    torch.testing.assert_close(caches.keys.rows[0][1][0][:, :, 5:], step_keys[:, :, 1:])
    torch.testing.assert_close(caches.keys.rows[0][1][1][:, :, 5:], step_values[:, :, 1:])
    with pytest.raises(RuntimeError, match="out of order"):
        caches.keys.put(0, 5, keys, values)


@pytest.mark.parametrize("family", ["llama", "gemma2"])  # gemma2: its logits are soft-capped after the LM head
def test_row_logits_equal_each_rows_own(make_checkpoint: Callable[..., Path], tmp_path: Path, family: str) -> None:
    """The edge's tail runs one LM-head product for a batch's rows: each row's logits are its own, in its shape."""
    directory = (
        make_checkpoint(family) if family == "llama" else save_family_checkpoint(tmp_path, family, 4, 0, torch.float32)
    )
    ckpt = Checkpoint(directory)
    edge = load_edge(ckpt, SplitPlan(ckpt.config.num_hidden_layers, 1, 1), torch.float32)
    torch.manual_seed(0)
    streams = [torch.randn(1, n, edge.hidden_size) for n in (2, 1, 0, 5)]  # 0: a row that wants no outputs
    with torch.inference_mode():
        joined = edge.row_logits(streams)
        alone = [edge.logits(s) for s in streams]
        (lone,) = edge.row_logits(streams[:1])
    assert [tuple(x.shape) for x in joined] == [(1, n, edge.vocab_size) for n in (2, 1, 0, 5)]
    assert all(x.dtype == torch.float32 for x in joined)
    for got, want in zip(joined, alone, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lone, alone[0], rtol=0, atol=0)


def test_a_layer_that_drops_the_row_attention_argument_is_refused_not_silently_mixed(
    make_checkpoint: Callable[..., Path],
) -> None:
    """A family whose decoder layer does not pass its attention keyword arguments on (StableLM's does not) ran
    its attention over the packed step as one sequence: each row saw the rows packed before it and none of its
    own cache, and the batch's outputs were silently wrong. forward_batch now checks every layer attended row by
    row."""
    model = make_checkpoint("llama")
    stack = load_trunk(Checkpoint(model), SplitPlan(6, 2, 2), torch.float32)
    attention = stack.layers[0].self_attn
    assert isinstance(attention, torch.nn.Module)
    forward = attention.forward

    def dropping(*args: Any, **kwargs: Any) -> Any:
        kwargs.pop(ROWS_KWARG, None)
        return forward(*args, **kwargs)

    attention.forward = dropping  # a layer that drops the keyword, as StableLM's does
    torch.manual_seed(0)
    rows = [
        BatchRow(
            torch.randn(1, q, 64),
            torch.arange(q, dtype=torch.int32),
            torch.arange(-1, q - 1, dtype=torch.int32),
            KVCache(),
        )
        for q in (3, 2)
    ]
    with pytest.raises(ConfigError, match=r"decoder layers \[2\] did not attend row by row"):
        forward_batch(stack, rows)
    assert [len(row.cache) for row in rows] == [0, 0]  # rolled back
