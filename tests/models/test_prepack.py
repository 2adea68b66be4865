"""oneDNN-prepacked linear layers (models/prepack.py) and the trunk server's --prepack choice."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from splitspec.cloud.config import CloudConfig
from splitspec.cloud.server import TrunkServer
from splitspec.exceptions import ConfigError
from splitspec.models import prepack as prepack_module
from splitspec.models.checkpoint import Checkpoint
from splitspec.models.kv_cache import KVCache
from splitspec.models.loading import load_trunk
from splitspec.models.prepack import PackedLinear, fastest, prepack_available, prepack_linears, row_bucket
from splitspec.models.split import SplitPlan

pytestmark = pytest.mark.skipif(not prepack_available(), reason="this torch build lacks oneDNN's packed linear")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 48), (16, 48), (2, 5, 48)])
@torch.inference_mode()
def test_a_packed_linear_computes_what_the_linear_does(bias: bool, shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(48, 80, bias=bias)
    packed = PackedLinear(linear)
    x = torch.randn(shape)
    out = packed(x)
    assert out.shape == (*shape[:-1], 80)
    torch.testing.assert_close(out, F.linear(x, linear.weight, linear.bias), rtol=1e-5, atol=1e-5)


def test_only_float32_cpu_weights_are_packed() -> None:
    with pytest.raises(ValueError, match="only float32 CPU weights"):
        PackedLinear(nn.Linear(8, 8).to(torch.bfloat16))


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # Qwen2's q/k/v projections carry a bias
@torch.inference_mode()
def test_a_prepacked_trunk_computes_what_the_trunk_does(make_checkpoint: Callable[..., Path], family: str) -> None:
    ckpt = Checkpoint(make_checkpoint(family))
    plan = SplitPlan(ckpt.config.num_hidden_layers, 2, 2)
    plain, packed = load_trunk(ckpt, plan, torch.float32), load_trunk(ckpt, plan, torch.float32)
    assert prepack_linears(packed) == 7 * len(plan.trunk_layers)  # q, k, v, o, gate, up, down per layer
    assert not any(isinstance(m, nn.Linear) for m in packed.modules())
    torch.manual_seed(1)
    for q in (9, 1, 3):  # a prefill, a decode step and a chain on top, each against its own cache
        hidden = torch.randn(1, q, ckpt.config.hidden_size)
        if q == 9:
            caches, past = (KVCache(), KVCache()), 0
        positions, parents = torch.arange(past, past + q, dtype=torch.int32), torch.arange(-1, q - 1, dtype=torch.int32)
        want = plain(hidden, positions, parents, caches[0])
        torch.testing.assert_close(packed(hidden, positions, parents, caches[1]), want, rtol=1e-4, atol=1e-5)
        past += q


@pytest.mark.parametrize(
    ("prepack", "batching", "faster", "packed"),
    [
        ("auto", True, True, True),  # auto packs a batching trunk's shapes measured faster packed ...
        ("auto", True, False, False),  # ... and only those
        ("auto", False, True, False),
        ("on", False, False, True),  # on packs whatever the timing says
        ("off", True, True, False),
    ],
)
def test_the_server_prepacks_where_it_is_asked_or_helps(
    make_checkpoint: Callable[..., Path],
    monkeypatch: pytest.MonkeyPatch,
    prepack: str,
    batching: bool,
    faster: bool,
    packed: bool,
) -> None:
    monkeypatch.setattr(prepack_module, "packed_is_faster", lambda linear, batch_hint=16: faster)
    config = CloudConfig(model_dir=make_checkpoint("llama"), port=0, prepack=prepack, batching=batching, device="cpu")
    trunk = TrunkServer(config).trunk
    assert any(isinstance(m, PackedLinear) for m in trunk.modules()) is packed
    assert any(isinstance(m, nn.Linear) for m in trunk.modules()) is not packed


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"prepack": "on", "dtype": "bfloat16"}, "--prepack on: it applies to float32 weights"),
        ({"prepack": "on", "compile": "default", "batching": False}, "--prepack on: --compile builds its own"),
        ({"prepack": "sometimes"}, "--prepack must be one of auto, on, off"),
    ],
)
def test_a_prepack_that_cannot_apply_is_refused(
    make_checkpoint: Callable[..., Path], changes: dict[str, object], message: str
) -> None:
    config = CloudConfig(model_dir=make_checkpoint("llama"), port=0, device="cpu", **changes)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=message):
        TrunkServer(config)


def test_row_counts_are_padded_to_few_sizes() -> None:
    assert [row_bucket(n) for n in (1, 7, 16, 17, 18, 19, 32, 33, 100, 128, 129, 1000)] == [
        1, 7, 16, 18, 18, 20, 32, 36, 104, 128, 144, 1024,
    ]  # fmt: skip
    buckets = [row_bucket(n) for n in range(1, 4097)]
    assert all(n <= b <= n * 1.125 for n, b in enumerate(buckets, start=1))  # at most 1/8 padding
    assert len(set(buckets)) == 16 + 8 * 8  # exact to 16, then 8 per doubling up to 4,096 rows


@pytest.mark.parametrize("rows", [17, 19, 100, 129])
@torch.inference_mode()
def test_padded_rows_compute_what_the_linear_does(rows: int) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(48, 80)
    x = torch.randn(1, rows, 48)
    out = PackedLinear(linear)(x)
    assert out.shape == (1, rows, 80)
    torch.testing.assert_close(out, F.linear(x, linear.weight, linear.bias), rtol=1e-5, atol=1e-5)


class _Slow(nn.Module):
    """A module as fast as ``inner`` plus a sleep: the slower of two candidates, unmistakably."""

    def __init__(self, inner: nn.Module, seconds: float) -> None:
        super().__init__()
        self.inner, self.seconds = inner, seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)
        out: torch.Tensor = self.inner(x)
        return out


def test_fastest_picks_the_module_that_takes_less_time() -> None:
    linear = nn.Linear(32, 32)
    assert fastest([_Slow(linear, 0.002), linear], 32, rows=(1, 4), calls=3) == 1
    assert fastest([linear, _Slow(linear, 0.002)], 32, rows=(1, 4), calls=3) == 0


def test_where_faster_packs_each_shape_as_measured_once(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[tuple[int, int]] = []

    def wider_is_faster(linear: nn.Linear, batch_hint: int = 16) -> bool:  # a CPU where packing pays when widening
        asked.append((linear.in_features, linear.out_features))
        return linear.out_features > linear.in_features

    monkeypatch.setattr(prepack_module, "packed_is_faster", wider_is_faster)
    block = nn.ModuleDict(
        {
            "up": nn.Linear(16, 64),
            "down": nn.Linear(64, 16),
            "inner": nn.ModuleDict({"up": nn.Linear(16, 64), "down": nn.Linear(64, 16)}),
        }
    )
    assert prepack_module.prepack_linears(block, where_faster=True) == 2
    assert isinstance(block["up"], PackedLinear)
    assert isinstance(block["inner"]["up"], PackedLinear)  # type: ignore[index]
    assert isinstance(block["down"], nn.Linear)
    assert isinstance(block["inner"]["down"], nn.Linear)  # type: ignore[index]
    assert sorted(asked) == [(16, 64), (64, 16)]  # each shape timed once
    everything = nn.ModuleDict({"up": nn.Linear(16, 64), "down": nn.Linear(64, 16)})
    assert prepack_module.prepack_linears(everything) == 2  # without where_faster: every one, nothing timed
    assert len(asked) == 2
    # several modules at once (an edge's head and tail): each shape timed once across them all
    head, tail = nn.ModuleDict({"up": nn.Linear(16, 64)}), nn.ModuleDict({"up": nn.Linear(16, 64)})
    assert prepack_module.prepack_linears(head, tail, where_faster=True) == 2
    assert asked[2:] == [(16, 64)]
