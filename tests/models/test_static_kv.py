"""Static KV buffers and the fixed-shape decode step (#14 item 4).

* a :class:`StaticKVCache` under the same steps as the growable :class:`KVCache` (prefill, a draft
  tree, keep_last of its accepted path, truncate, decode steps through the fixed-shape path) gives
  the same outputs, lengths and entries; it is allocated once and accounted whole;
* the step paths never read a device value on the host: run on the ``meta`` device, whose tensors
  have no data, any ``.item()``, ``.tolist()``, ``.cpu()``, ``bool()`` or ``torch.equal`` raises;
* the compiled decode step is one graph (``fullgraph``: a host sync inside would fail the compile,
  shown with a layer that reads a value), reused by every cache of the same size.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters
from transformers import LlamaConfig

from splitspec.cloud.sessions import KVBudget, SessionStore
from splitspec.exceptions import CapacityExceeded, CompileFailed, ConfigError
from splitspec.models.checkpoint import Checkpoint
from splitspec.models.family import skeleton
from splitspec.models.fixed_decode import compile_mode_for
from splitspec.models.kv_cache import KVCache
from splitspec.models.loading import load_trunk
from splitspec.models.split import SplitPlan
from splitspec.models.stack import EdgeModel, LayerStack
from splitspec.models.static_kv import StaticKVCache

H = 64  # the tiny checkpoints' hidden size


def _ints(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def _script(stack: LayerStack, cache: KVCache, device: torch.device, seed: int = 0) -> list[torch.Tensor]:
    """A generation's life on one cache: prefill 10, a draft tree of 4 with its path (0, 2) kept,
    5 decode steps, truncate to 11, 3 more decode steps. Returns every step's output."""
    gen = torch.Generator().manual_seed(seed)

    def hidden(q: int) -> torch.Tensor:
        with torch.inference_mode():  # as a step's activations and HostStaging's copies are
            return torch.randn(1, q, H, generator=gen).to(device)  # (1, q, H)

    outs = [stack(hidden(10), _ints(list(range(10))), _ints(list(range(-1, 9))), cache)]
    outs.append(stack(hidden(4), _ints([10, 11, 11, 12]), _ints([-1, 0, 0, 2]), cache))
    cache.keep_last((0, 2))
    for step in range(5):
        outs.append(stack(hidden(1), _ints([len(cache)]), _ints([-1]), cache))
        assert len(cache) == 13 + step
    cache.truncate(11)
    for _ in range(3):
        outs.append(stack(hidden(1), _ints([len(cache)]), _ints([-1]), cache))
    return outs


@pytest.fixture(scope="module", params=["llama", "mistral"])  # mistral: a sliding window of 8
def trunks(request: pytest.FixtureRequest, make_checkpoint: Callable[..., Path]) -> tuple[LayerStack, LayerStack]:
    """Two loads of one trunk: a plain one, and one whose one-token steps take the fixed-shape path."""
    ckpt = Checkpoint(make_checkpoint(request.param))
    plan = SplitPlan(ckpt.config.num_hidden_layers, 2, 2)
    plain = load_trunk(ckpt, plan, torch.float32)
    fixed = load_trunk(ckpt, plan, torch.float32)
    fixed.enable_fixed_decode()
    return plain, fixed


def test_static_cache_matches_the_growable_cache(trunks: tuple[LayerStack, LayerStack]) -> None:
    plain, fixed = trunks
    grow, static = KVCache(), StaticKVCache(32)
    assert static.capacity == 0
    assert static.nbytes == 0
    steps_before = fixed.fixed_decode.steps if fixed.fixed_decode else 0
    cpu = torch.device("cpu")
    for a, b in zip(_script(plain, grow, cpu), _script(fixed, static, cpu), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert fixed.fixed_decode is not None
    assert fixed.fixed_decode.steps - steps_before == 8
    assert (len(static), static.last_step) == (len(grow), grow.last_step) == (14, 1)
    for layer in (2, 3):
        torch.testing.assert_close(static._keys[layer][:, :, :14], grow._keys[layer][:, :, :14])
    # allocated once, whole: what the trunk's KV budget accounts from the first step on
    assert static.capacity == static.capacity_after(1) == static.capacity_after(32) == 32
    assert static.nbytes == 2 * 2 * (2 * 32 * 16) * 4  # K and V x 2 layers x (2 kv heads x 32 x 16) x fp32
    with pytest.raises(ValueError, match="do not fit"):
        static.capacity_after(33)
    with pytest.raises(ValueError, match="overflows"):
        fixed(torch.zeros(1, 19, H), _ints(list(range(14, 33))), _ints(list(range(-1, 18))), static)
    assert len(static) == 14  # the refused step left nothing behind


def test_a_static_session_is_accounted_whole() -> None:
    per_token = 1024
    store = SessionStore(8, 60.0, budget=KVBudget(100 * per_token, per_token), new_cache=partial(StaticKVCache, 128))
    session = store.open(owner=1)
    assert isinstance(session.cache, StaticKVCache)
    with pytest.raises(CapacityExceeded, match="more than the whole KV budget") as refused:
        store.reserve(session, 5)  # 5 entries, but the buffers hold 128
    assert refused.value.retry_after_s is None
    with pytest.raises(ConfigError, match="at least one entry"):
        StaticKVCache(0)


def _meta_pieces() -> tuple[LayerStack, EdgeModel]:
    """A trunk and an edge of a tiny Llama on the meta device: tensors without data."""
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=H,
        intermediate_size=2 * H,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    skel = skeleton(config, torch.float32)
    plan = SplitPlan(6, 2, 2)
    return LayerStack(skel, plan.trunk_layers).eval(), EdgeModel(skel, plan).eval()


@pytest.mark.parametrize("static", [False, True])
def test_step_paths_never_read_the_device(static: bool) -> None:
    """Prefill, draft tree, keep_last, truncate and decode on ``meta``: a host read of any device
    value (a sync on an accelerator) raises there. The result's copy to the host is the caller's."""
    trunk, edge = _meta_pieces()
    meta = torch.device("meta")
    if static:
        trunk.enable_fixed_decode()
        edge.head.enable_fixed_decode()
        edge.tail.enable_fixed_decode()
    new: Callable[[], KVCache] = partial(StaticKVCache, 64) if static else KVCache
    outs = _script(trunk, new(), meta)
    assert all(out.device == meta for out in outs)
    head_cache, tail_cache = new(), new()
    steps = (([5, 9, 17], [0, 1, 2], [-1, 0, 1]), ([3, 4], [3, 3], [-1, -1]), ([8], [4], [-1]))
    for tokens, positions, parents in steps:
        hidden = edge.run_head(torch.tensor(tokens), _ints(positions), _ints(parents), head_cache)
        logits = edge.run_tail(hidden, _ints(positions), _ints(parents), tail_cache)
        assert logits.shape == (len(tokens), 96)
        assert logits.device == meta
        if len(tokens) == 2:
            head_cache.keep_last((1,))
            tail_cache.keep_last((1,))
    if static:
        assert trunk.fixed_decode is not None
        assert trunk.fixed_decode.steps == 8
        assert edge.head.fixed_decode is not None
        assert edge.head.fixed_decode.steps == 1


def test_compiled_decode_is_one_graph_for_every_session(trunks: tuple[LayerStack, LayerStack]) -> None:
    """``backend="eager"``: dynamo's whole-graph capture (what inductor compiles) without code generation."""
    plain, _ = trunks
    compiled = LayerStack(plain._skeleton, plain.layer_indices).eval()
    fixed = compiled.enable_fixed_decode("auto", backend="eager")
    assert fixed.mode == "default"  # auto on the CPU; reduce-overhead (CUDA graphs) on CUDA
    before = counters["stats"]["unique_graphs"]
    fixed.warm_up(32)
    cpu = torch.device("cpu")
    for seed in (1, 2):  # two sessions: two caches of the same size
        expected = _script(plain, KVCache(), cpu, seed)
        for a, b in zip(expected, _script(compiled, StaticKVCache(32), cpu, seed), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert counters["stats"]["unique_graphs"] - before == 1
    assert fixed.steps == 2 + 2 * 8  # the warm-up's two, then every decode step of both sessions


class _ReadsAValue(nn.Module):
    """A decoder layer that branches on a device value: a host sync inside the decode step."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, hidden: torch.Tensor, **kwargs: object) -> torch.Tensor:
        out: torch.Tensor = self.layer(hidden, **kwargs)
        return out * 2 if float(out.abs().max()) > 1e9 else out


def test_a_host_sync_in_the_decode_step_fails_the_compile(trunks: tuple[LayerStack, LayerStack]) -> None:
    plain, _ = trunks
    stack = LayerStack(plain._skeleton, plain.layer_indices).eval()
    stack.layers[0] = _ReadsAValue(stack.layers[0])
    with pytest.raises(CompileFailed, match=r"^--compile: torch.compile \(mode default\) of the decode step"):
        stack.enable_fixed_decode("default", backend="eager").warm_up(16)
    with pytest.raises(ConfigError, match="not one of"):
        compile_mode_for("fastest", torch.device("cpu"))
    assert compile_mode_for("auto", torch.device("cuda")) == "reduce-overhead"
