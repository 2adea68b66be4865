"""benchmarks/fuzz.py: its seeds stay valid as the protocol evolves, and it classifies outcomes right.

The script itself runs >= 10^6 inputs outside CI; these checks are what would silently rot: a seed
the protocol no longer accepts (the script broke once when Welcome gained a field), or a hang
criterion that counts waiting as computing.
"""

from __future__ import annotations

import time
from types import ModuleType

import pytest

from splitspec.exceptions import MalformedFrame
from splitspec.federated.codec import decode_topk
from splitspec.protocol.fed import decode_fed
from splitspec.protocol.messages import decode_message
from tests.bench.scripts import load_script


@pytest.fixture(scope="module")
def fuzz() -> ModuleType:
    return load_script("fuzz.py", "fuzz_script")


def test_every_seed_is_a_valid_input(fuzz: ModuleType) -> None:
    split = fuzz.split_seeds()
    assert len(split) == 13  # with a Step and a StepResult in each of the int8 and bf16 codecs
    for data in split:
        decode_message(data)  # raises if a seed no longer matches the protocol
    for data in fuzz.fed_seeds(8192):
        decode_fed(data)
    for stream, positions in fuzz.codec_seeds(8192):
        decode_topk(stream, positions, 8192, max_k=200)


def test_outcomes_are_classified(fuzz: ModuleType) -> None:
    stats = fuzz.TargetStats("t")

    def refuse(_: bytes) -> None:
        raise MalformedFrame("no")

    def crash(_: bytes) -> None:
        raise ValueError("bug")

    fuzz.run_sync(stats, lambda _: None, b"ok", measure=True)
    fuzz.run_sync(stats, refuse, b"bad", measure=False)
    fuzz.run_sync(stats, crash, b"boom", measure=True)
    assert (stats.accepted, stats.refused, stats.crashes, stats.inputs) == (1, 1, 1, 3)
    assert stats.mem_samples == 1  # the crashing input is not measured again
    assert "ValueError" in stats.crash_examples[0]


def test_a_hang_is_cpu_time_and_a_stall_wall_time(fuzz: ModuleType) -> None:
    stats = fuzz.TargetStats("t")
    fuzz.record_time(stats, b"waited", wall=fuzz.HANG_S * 3, cpu=0.01)
    assert (stats.hangs, stats.stalls) == (0, 1)
    fuzz.record_time(stats, b"computed", wall=fuzz.HANG_S * 3, cpu=fuzz.HANG_S * 2)
    fuzz.record_time(stats, b"interrupted", wall=0.5, cpu=0.5, interrupted=True)
    assert (stats.hangs, stats.stalls, stats.inputs) == (2, 2, 3)
    assert stats.slowest_cpu_s == fuzz.HANG_S * 2


def test_the_watchdog_interrupts_an_endless_input(fuzz: ModuleType) -> None:
    stats = fuzz.TargetStats("t")

    def spin(_: bytes) -> None:
        while True:
            time.sleep(0.01)

    fuzz.run_sync(stats, spin, b"spin", measure=False, abort_s=0.2)
    assert stats.hangs == 1
    assert stats.crashes == 0
