"""A batched trunk forward over ragged steps of several sessions equals each session's step alone (#15)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from splitspec.models.batched import BatchedCaches, BatchRow, forward_batch
from splitspec.models.checkpoint import Checkpoint
from splitspec.models.kv_cache import KVCache
from splitspec.models.masks import depths
from splitspec.models.split import SplitPlan
from splitspec.models.stack import load_edge, load_trunk
from tests.families import save_family_checkpoint

# (committed prefix, parents of the step): decode, a draft tree, a prefill chunk, an empty cache
STEPS = [(9, [-1]), (4, [-1, 0, 0, 1, 2, -1]), (0, list(range(-1, 19))), (13, [-1, 0, 1])]


@pytest.mark.parametrize("family", ["llama", "mistral"])  # mistral: a sliding window of 8
def test_each_row_equals_its_step_alone(make_checkpoint: Callable[..., Path], family: str) -> None:
    ckpt = Checkpoint(make_checkpoint(family))
    trunk = load_trunk(ckpt, SplitPlan(ckpt.config.num_hidden_layers, 2, 2), torch.float32)
    torch.manual_seed(0)
    solo_caches, batch_caches, rows, expected = [], [], [], []
    for past, parents in STEPS:
        solo, batched = KVCache(), KVCache()
        if past:
            prefix = torch.randn(1, past, 64)
            chain = torch.arange(-1, past - 1, dtype=torch.int32)
            trunk(prefix, torch.arange(past, dtype=torch.int32), chain, solo)
            trunk(prefix, torch.arange(past, dtype=torch.int32), chain, batched)
        parent_t = torch.tensor(parents, dtype=torch.int32)
        positions = (past + depths(parent_t)).to(torch.int32)
        hidden = torch.randn(1, len(parents), 64)
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
    # a lone row (a prefill chunk, or one session decoding) takes the per-session path: same result
    solo, batched = solo_caches[0], batch_caches[0]
    at = torch.tensor([len(solo)], dtype=torch.int32)
    hidden = torch.randn(1, 1, 64)
    (alone,) = forward_batch(trunk, [BatchRow(hidden, at, torch.tensor([-1], dtype=torch.int32), batched)])
    torch.testing.assert_close(alone, trunk(hidden, at, torch.tensor([-1], dtype=torch.int32), solo))
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


def test_padding_keys_are_zero_whatever_the_allocator_held() -> None:
    """A shorter row's padded keys get zero weight from the mask, and are zero: 0 x NaN would be NaN."""
    short, long_ = KVCache(), KVCache()
    for cache, past in ((short, 2), (long_, 5)):  # committed prefixes of 2 and 5 entries
        cache.update(torch.randn(1, 2, past, 4), torch.randn(1, 2, past, 4), 0)
        cache.commit()
    caches = BatchedCaches([short, long_], lengths=[1, 1], past=[2, 5])
    garbage = torch.full((2, 2, 6, 4), float("nan"))
    del garbage  # the freed block is what the next allocation of this size is likely to get
    keys, values = caches.update(torch.randn(2, 2, 1, 4), torch.randn(2, 2, 1, 4), 0)  # (B, kv, past_max + 1, d)
    assert keys.shape == (2, 2, 6, 4)
    for out in (keys, values):
        assert torch.equal(out[0, :, 2:5], torch.zeros(2, 3, 4))  # the short row's padding
        assert torch.isfinite(out).all()
    assert torch.equal(keys[1, :, :5], long_._keys[0][0, :, :5])  # the long row's prefix, in place


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
