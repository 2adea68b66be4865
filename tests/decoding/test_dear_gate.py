"""The engine's gate on dear drafters under load: epochs with and without them, the better measured arm kept,
the other one explored now and then, per load band; a lone sequence never gated. Literal clock readings."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import pytest
import torch

from splitspec.decoding.aside import DraftExecutor
from splitspec.decoding.controller import BlindPolicy, Choice
from splitspec.decoding.dear_gate import DearGate, load_band
from splitspec.decoding.drafters import Draft, Drafter
from splitspec.decoding.local import LocalSequence
from splitspec.decoding.loop import decode
from splitspec.decoding.sampling import SamplingParams
from splitspec.models.checkpoint import Checkpoint
from splitspec.models.loading import load_full

PROMPT = [5, 9, 17, 3, 44, 2, 8, 5, 9, 17, 3, 61]


def run_epoch(gate: DearGate, start: float, tokens: int | dict[bool, int], decoding: int = 16) -> bool:
    """One epoch from ``start`` delivering ``tokens`` (or so many under each arm): its arm."""
    arm = gate.allows(decoding, start)
    gate.delivered(tokens if isinstance(tokens, int) else tokens[arm])
    return arm


def test_load_bands_are_powers_of_two() -> None:
    assert [load_band(n) for n in (2, 3, 4, 7, 8, 15, 16, 31, 32)] == [1, 1, 2, 2, 3, 3, 4, 4, 5]


def test_a_lone_sequence_is_never_gated_and_nothing_is_measured() -> None:
    gate = DearGate(epoch_s=1.0)
    assert all(gate.allows(1, t) for t in (0.0, 5.0, 10.0))
    gate.delivered(100)
    assert gate.rate(2, True) is None
    assert gate.rate(2, False) is None


def test_each_arm_is_tried_then_the_better_kept_and_the_other_explored() -> None:
    gate = DearGate(epoch_s=1.0, explore_every=4, decay=0.0)
    per_arm = {True: 100, False: 150}  # tokens an epoch delivers with the dear drafters and without
    assert run_epoch(gate, 0.0, per_arm) is True  # untried: with the dear drafters first
    assert run_epoch(gate, 1.0, per_arm) is False  # then without them
    arms = [run_epoch(gate, 2.0 + k, per_arm) for k in range(7)]
    assert gate.rate(16, True) == pytest.approx(100.0)
    assert gate.rate(16, False) == pytest.approx(150.0)
    # without them is better; the band's 4th and 8th epochs explore the arm that measured worse
    assert arms == [False, True, False, False, False, True, False]


def test_an_explored_arm_that_measures_better_takes_over() -> None:
    gate = DearGate(epoch_s=1.0, explore_every=3, decay=0.0)
    run_epoch(gate, 0.0, 100)  # with: 100/s
    run_epoch(gate, 1.0, 150)  # without: 150/s
    assert run_epoch(gate, 2.0, 300) is True  # the 3rd epoch explores "with", which now delivers 300/s
    assert run_epoch(gate, 3.0, 300) is True  # measured as the next epoch starts: "with" takes over
    assert gate.rate(16, True) == pytest.approx(300.0)
    assert run_epoch(gate, 4.0, 300) is True
    assert run_epoch(gate, 5.0, 300) is False  # the 6th explores again


def test_the_rates_decay_towards_new_epochs() -> None:
    gate = DearGate(epoch_s=1.0, decay=0.5)
    run_epoch(gate, 0.0, 100)
    run_epoch(gate, 1.0, 50)
    run_epoch(gate, 2.0, 0)  # "with" again (better), now delivering 300/s
    gate.delivered(300)
    gate.allows(16, 3.0)
    assert gate.rate(16, True) == pytest.approx(0.5 * 100 + 0.5 * 300)


def test_load_bands_are_measured_apart() -> None:
    gate = DearGate(epoch_s=1.0, decay=0.0)
    run_epoch(gate, 0.0, 100, decoding=16)
    run_epoch(gate, 1.0, 200, decoding=16)
    assert run_epoch(gate, 2.0, 10, decoding=2) is True  # a new band starts untried
    gate.allows(2, 3.0)
    assert gate.rate(2, True) == pytest.approx(10.0)
    assert gate.rate(16, True) == pytest.approx(100.0)


def test_an_epoch_is_measured_in_the_band_its_arm_was_chosen_for() -> None:
    """The load crosses a band's edge within every epoch (3 sequences as each starts, 4 a moment later): what an
    epoch delivered is the band it started in's measurement of its arm, so the other arm is tried there too (recorded
    under the band the load reached, the start band stayed untried and its first arm was kept for good)."""
    gate = DearGate(epoch_s=1.0, decay=0.0)
    arms = []
    for k in range(40):
        arms.append(gate.allows(3, 2.0 * k))  # the epoch starts (the last one ends) with 3 sequences decoding
        gate.delivered(100 if arms[-1] else 300)  # without the dear drafters the engine delivers more
        gate.allows(4, 2.0 * k + 1.0 - 1e-6)  # a 4th joins within the epoch
    assert arms[:2] == [True, False]  # each arm tried in the band the epochs start in
    assert gate.rate(3, True) == pytest.approx(50.0)  # 100 tokens over the 2 s each epoch ran
    assert gate.rate(3, False) == pytest.approx(150.0)
    assert gate.rate(4, True) is None  # no epoch started with 4: none chose an arm for that band
    assert arms.count(False) > arms.count(True)  # the better arm kept, the other explored now and then


def test_an_epoch_interrupted_by_a_lone_sequence_is_dropped() -> None:
    gate = DearGate(epoch_s=1.0)
    assert gate.allows(8, 0.0) is True
    gate.delivered(100)
    assert gate.allows(1, 0.5) is True  # the others finished
    gate.delivered(5)
    assert gate.allows(8, 2.0) is True  # a new epoch, still untried "with": the dropped one measured nothing
    assert gate.rate(8, True) is None


@pytest.mark.parametrize("kwargs", [{"epoch_s": 0.0}, {"explore_every": 1}, {"decay": 1.0}, {"decay": -0.1}])
def test_bad_settings_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="epoch_s"):
        DearGate(**kwargs)  # type: ignore[arg-type]


class Fixed:
    """A drafter proposing a fixed continuation, noting each proposal; dear when ``dear``."""

    def __init__(self, name: str, tokens: list[int], *, dear: bool) -> None:
        self.name = name
        self.tokens = tokens
        self.aside = dear  # dear to ask: the gate's business under load
        self.shadow = not dear  # the cheap one: inline
        self.asked = 0

    def propose(self, context: Sequence[int], budget: int) -> Draft:
        self.asked += 1
        chain = self.tokens[:budget]
        return Draft(chain, list(range(-1, len(chain) - 1)))


class DearFirst(BlindPolicy):
    def ranked(self, context_tokens: int = 0, waits: Mapping[str, float] | None = None) -> list[Choice]:
        return [Choice("dear", 2, 2.0), Choice("cheap", 2, 1.0), Choice(None, 0, 0.0)]


@pytest.fixture
def verifier(make_checkpoint: Callable[..., Path]) -> LocalSequence:
    return LocalSequence(load_full(Checkpoint(make_checkpoint("llama")), torch.float32))


def gate_without_dear_drafters(decoding: int) -> DearGate:
    """A gate in an epoch without dear drafters, for ``decoding`` sequences, lasting long past the test."""
    gate = DearGate(epoch_s=1e6)
    now = time.monotonic()
    gate.allows(decoding, now - 1e6 - 1.0)  # with them: measured at 0 tokens
    gate.allows(decoding, now - 1.0)  # without them, untried: this epoch runs until long after the test
    return gate


async def generate(verifier: LocalSequence, drafters: dict[str, Drafter], executor: DraftExecutor) -> list[int]:
    params, generator = SamplingParams(temperature=0.8), torch.Generator().manual_seed(0)  # no aside
    out = decode(verifier, PROMPT, 6, params, generator, drafters, DearFirst(), draft_executor=executor)
    return [e.token for e in [x async for x in out]]


async def test_under_load_the_loop_asks_dear_drafters_only_when_the_gate_allows(verifier: LocalSequence) -> None:
    dear, cheap = Fixed("dear", [1, 2], dear=True), Fixed("cheap", [3, 4], dear=False)
    drafters: dict[str, Drafter] = {"dear": dear, "cheap": cheap}
    executor = DraftExecutor(gate=gate_without_dear_drafters(2))
    try:
        with executor.decoding(), executor.decoding():  # this sequence and another one decode
            tokens = await generate(verifier, drafters, executor)
        assert len(tokens) == 6
        assert dear.asked == 0  # gated: the cheap drafter was asked instead
        assert cheap.asked > 0
        assert executor.gate._tokens == 6  # the engine's delivered tokens are counted into the epoch
        with executor.decoding():  # alone: never gated
            await generate(verifier, drafters, executor)
        assert dear.asked > 0
        # a mode of one dear drafter asks it under load too: its user chose it
        solo = Fixed("dear", [1, 2], dear=True)
        executor.gate = gate_without_dear_drafters(2)
        with executor.decoding(), executor.decoding():
            out = decode(verifier, PROMPT, 4, SamplingParams(temperature=0.8), torch.Generator().manual_seed(0),
                         {"dear": solo}, DearFirst(), draft_executor=executor)  # fmt: skip
            assert len([e async for e in out]) == 4
        assert solo.asked > 0
    finally:
        executor.shutdown()
