"""Warm-up at load (models/warm_up.py): every step width once, on an accelerator only, and what it prevents."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from splitspec.bench.scenario import ASSETS_DIR
from splitspec.cloud import server as server_module
from splitspec.cloud.config import CloudConfig
from splitspec.cloud.server import TrunkServer
from splitspec.decoding import drafters
from splitspec.decoding.controller import DEFAULT_BUDGETS
from splitspec.decoding.eagle import warm_up_draft_head
from splitspec.decoding.lockstep import Steps
from splitspec.decoding.sampling import SamplingParams
from splitspec.edge import EdgeConfig, SplitClient
from splitspec.edge import runtime as runtime_module
from splitspec.edge.runtime import EdgeRuntime
from splitspec.models.checkpoint import Checkpoint
from splitspec.models.draft_head_io import load_draft_head
from splitspec.models.loading import load_edge, load_full, load_trunk
from splitspec.models.split import SplitPlan
from splitspec.models.warm_up import (
    WARM_UP_CONTEXT,
    WARM_UP_WIDTHS,
    pays_cold_start,
    tree_parents,
    warm_up_edge,
    warm_up_stack,
)
from splitspec.netem.emulator import WanEmulator
from splitspec.netem.schedule import NetemConfig

BASE, DRAFT, HEAD = (ASSETS_DIR / "models" / name for name in ("base", "draft", "base-eagle"))
REAL_PROPOSE_STEPS = drafters.DraftModel.propose_steps


def _record_widths(module: nn.Module) -> list[int]:
    """The query widths of every forward of ``module`` (a decoder layer: hidden (1, q, H))."""
    widths: list[int] = []

    def hook(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        hidden = args[0] if args else kwargs["hidden_states"]
        widths.append(int(hidden.shape[1]))

    module.register_forward_pre_hook(hook, with_kwargs=True)
    return widths


def test_widths_are_a_token_and_a_token_plus_each_budget() -> None:
    assert (1, *(1 + budget for budget in DEFAULT_BUDGETS)) == WARM_UP_WIDTHS


def test_only_an_accelerator_pays_a_cold_start() -> None:
    assert not pays_cold_start([torch.device("cpu")])
    assert pays_cold_start([torch.device("cuda", 0)])
    assert pays_cold_start([torch.device("cpu"), torch.device("cuda", 1)])  # a trunk split over both
    assert pays_cold_start([torch.device("mps")])


def test_warm_up_steps_are_draft_trees() -> None:
    assert tree_parents(1) == [-1]
    assert tree_parents(5) == [-1, 0, 0, 1, 1]  # siblings: the tree-mask path, not a chain's


def test_the_trunk_runs_a_context_then_every_width(make_checkpoint: Callable[..., Path]) -> None:
    directory = make_checkpoint("llama", layers=6)
    ckpt = Checkpoint(directory)
    trunk = load_trunk(ckpt, SplitPlan(6, 2, 2), torch.float32)
    first, last = _record_widths(trunk.layers[0]), _record_widths(trunk.layers[-1])
    before = {name: p.clone() for name, p in trunk.named_parameters()}
    seconds = warm_up_stack(trunk, torch.float32)
    assert seconds > 0
    assert first == last == [WARM_UP_CONTEXT, *WARM_UP_WIDTHS]
    assert all(torch.equal(p, before[name]) for name, p in trunk.named_parameters())  # nothing learnt or kept


def test_the_edge_runs_head_tail_and_lm_head_at_every_width(make_checkpoint: Callable[..., Path]) -> None:
    directory = make_checkpoint("llama", layers=6)
    edge = load_edge(Checkpoint(directory), SplitPlan(6, 2, 2), torch.float32)
    head, tail = _record_widths(edge.head.layers[0]), _record_widths(edge.tail.layers[-1])
    rows: list[int] = []
    edge.lm_head.register_forward_pre_hook(lambda _, args: rows.append(int(args[0].shape[-2])))
    warm_up_edge(edge)
    assert head == tail == rows == [WARM_UP_CONTEXT, *WARM_UP_WIDTHS]


def test_the_draft_model_proposes_a_tree(make_checkpoint: Callable[..., Path]) -> None:
    model = load_full(Checkpoint(make_checkpoint("llama", layers=2)), torch.float32)
    widths = _record_widths(model.layers.layers[0])
    assert drafters.warm_up_draft_model(model) > 0
    assert widths[0] == WARM_UP_CONTEXT  # the context, then the tree's levels
    assert len(widths) >= 3  # two waves of the tree at least: its first level, and the best nodes' children


def test_the_draft_head_proposes_a_tree_from_made_up_features() -> None:
    ckpt = Checkpoint(BASE)
    edge = load_edge(ckpt, SplitPlan(ckpt.config.num_hidden_layers, 2, 2), torch.float32)
    head = load_draft_head(HEAD, ckpt, torch.device("cpu"), torch.float32)
    widths = _record_widths(head.layer)
    assert warm_up_draft_head(head, edge) > 0
    assert widths[0] == WARM_UP_CONTEXT  # the context's pairs, then the tree's levels
    assert len(widths) >= 3


def _warm_ups_at_load(monkeypatch: pytest.MonkeyPatch, accelerator: bool) -> tuple[int, ...]:
    """Warm-ups of the trunk, the edge, the draft model and the draft head while a server and a runtime load,
    with the warm-up's device test answering ``accelerator``."""
    if accelerator:  # what an accelerator would answer; the layers still run on this CPU
        monkeypatch.setattr(server_module, "pays_cold_start", lambda devices: True)
        monkeypatch.setattr(runtime_module, "pays_cold_start", lambda devices: True)
    counts = {"trunk": 0, "edge": 0, "draft": 0, "head": 0}
    for name, module, attr in (
        ("trunk", server_module, "warm_up_stack"),
        ("edge", runtime_module, "warm_up_edge"),
        ("draft", runtime_module, "warm_up_draft_model"),
        ("head", runtime_module, "warm_up_draft_head"),
    ):
        real = getattr(module, attr)

        def run(*args: Any, _name: str = name, _real: Callable[..., float] = real, **kwargs: Any) -> float:
            counts[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, attr, run)
    TrunkServer(CloudConfig(model_dir=BASE, port=0, device="cpu"))
    config = EdgeConfig(
        model_dir=BASE,
        cloud_url="ws://127.0.0.1:1",
        device="cpu",
        allow_stock_edge_weights=True,
        draft_model_dir=DRAFT,
        draft_head_dir=HEAD,
    )
    runtime = EdgeRuntime(config)
    EdgeRuntime(config, edge=runtime.model, draft_model=runtime.draft_model)  # shared weights: warmed already
    return tuple(counts.values())


def test_an_accelerator_warms_up_at_load_a_cpu_does_not(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _warm_ups_at_load(monkeypatch, accelerator=False) == (0, 0, 0, 0)
    # the second runtime shares the first's edge and draft model, and loads its own head
    assert _warm_ups_at_load(monkeypatch, accelerator=True) == (1, 1, 1, 2)


def _slow_first_proposal(monkeypatch: pytest.MonkeyPatch, seconds: float) -> tuple[list[int], list[int]]:
    """Make each draft model's first proposal take ``seconds`` longer, as a GPU's cold kernels did (821 ms on an
    H200): per loaded model, so a warm-up proposal on it pays it. Returns the proposals made, one entry each, and
    the indices among them of the slow ones."""
    seen: set[int] = set()
    calls: list[int] = []
    slow: list[int] = []

    def propose_steps(self: drafters.DraftModel, context: Sequence[int], budget: int) -> Steps[drafters.Draft]:
        model = id(self.sequence.model)
        first = model not in seen
        seen.add(model)
        if first:
            slow.append(len(calls))
        calls.append(budget)

        def steps() -> Steps[drafters.Draft]:  # the proposal's own time: where it runs, alone or in lockstep
            if first:
                time.sleep(seconds)
            return (yield from REAL_PROPOSE_STEPS(self, context, budget))

        return steps()

    monkeypatch.setattr(drafters.DraftModel, "propose_steps", propose_steps)
    return calls, slow


async def _proposals_per_answer(warm: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[list[int], list[int]]:
    """Greedy ``--speculate draft`` answers of 16 tokens at 60 ms RTT after a cold first proposal: proposals each,
    and slow proposals each."""
    monkeypatch.setattr(runtime_module, "pays_cold_start", lambda devices: warm)
    calls, slow = _slow_first_proposal(monkeypatch, 0.5)
    prompt = list(range(40, 104))
    async with (
        TrunkServer(CloudConfig(model_dir=BASE, port=0, device="cpu")) as server,
        WanEmulator(NetemConfig(upstream_port=server.port, rtt_ms=60)) as link,
    ):
        edge = EdgeConfig(
            model_dir=BASE,
            cloud_url=f"ws://127.0.0.1:{link.port}",
            device="cpu",
            allow_stock_edge_weights=True,
            draft_model_dir=DRAFT,
        )
        async with SplitClient(edge) as client:
            per_answer, slow_per_answer = [], []
            for _ in range(3):
                start = len(calls)
                await client.generate(prompt, 16, SamplingParams(temperature=0.0), speculate="draft")
                per_answer.append(len(calls) - start)
                slow_per_answer.append(sum(start <= i < len(calls) for i in slow))
    return per_answer, slow_per_answer


async def test_a_cold_first_proposal_is_paid_at_load_and_never_locks_the_draft_model_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cold, cold_slow = await _proposals_per_answer(False, monkeypatch)
    warm, warm_slow = await _proposals_per_answer(True, monkeypatch)
    assert warm_slow == [0, 0, 0]  # the warm-up paid it at load
    assert cold_slow == [1, 0, 0]  # without it, the first answer does
    assert all(n >= 4 for n in warm[1:]), warm  # about one proposal per 2-3 tokens
    # and the controller does not take the cold proposal for the drafter's cost: before it measured a cost once
    # again (controller.CONFIRM_AFTER) and believed the lower of two (estimates.Seconds), it judged the drafter too
    # dear and, a 16-token answer never re-probing it, hardly asked it again (on the H200: 0-1 proposals an answer)
    assert all(n >= 4 for n in cold[1:]), cold
