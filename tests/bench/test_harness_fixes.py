"""The harness's stop tokens, greedy reference and per-run speculation controller; the report's RTT cells."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from splitspec.bench.harness import RUNS_FILE, LocalBaselines, run_benchmark
from splitspec.bench.records import RunRecord
from splitspec.bench.report import write_markdown
from splitspec.bench.scenario import BaselineSpec, PromptSpec, Scenario
from splitspec.bench.summary import summarize
from splitspec.decoding.controller import SpeculationController, _DrafterStats
from splitspec.edge.engine import EdgeEngine
from splitspec.edge.sequence import EdgeSequence
from splitspec.run_info import read_jsonl_gz

PROMPT = [0, 5, 17, 33, 42, 8, 61, 12]

# the controller a generation decodes with, and its ngram estimates as the generation starts
Start = tuple[SpeculationController, _DrafterStats]
Bench = tuple[dict[str, Any], list[dict[str, Any]], list[Start]]


def test_local_baselines_stop_at_generation_config_stop_tokens(
    make_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    """An instruct checkpoint lists extra stop tokens in generation_config.json: both greedy baselines end there."""
    model = tmp_path / "instruct"
    shutil.copytree(make_checkpoint("llama"), model)  # config.json: eos_token_id None
    free, _ = LocalBaselines(model, torch.float32, 10).generate("local_loop", PROMPT, 12)
    assert len(free) == 12
    stop = free[4]
    first = free.index(stop)  # where a run stopping at it ends
    gen_config = model / "generation_config.json"
    data = json.loads(gen_config.read_text()) if gen_config.is_file() else {}
    gen_config.write_text(json.dumps({**data, "eos_token_id": [stop]}))

    local = LocalBaselines(model, torch.float32, 10)
    for mode in ("hf_generate", "local_loop"):
        tokens, _ = local.generate(mode, PROMPT, 12)
        assert tokens == free[: first + 1], mode


# -- one small benchmark: local_loop as the only baseline, ngram over two prompts --------------


@pytest.fixture(scope="module")
def ngram_bench(make_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Bench:
    """Run it with EdgeEngine.controller watched (a generation takes its controller there, as it starts);
    returns (summary, run records, each generation's controller and its estimates then)."""
    seen: list[Start] = []
    engine_controller = EdgeEngine.controller

    def watched(engine: EdgeEngine, sequence: EdgeSequence, drafters: Sequence[str]) -> SpeculationController:
        controller = engine_controller(engine, sequence, drafters)
        seen.append((controller, controller.prior("ngram")))  # a copy of its estimates, as they are now
        return controller

    scenario = Scenario(
        name="fixes",
        model_dir=make_checkpoint("llama"),
        rtt_ms=(0.0,),
        modes=("ngram",),
        repeats=1,
        max_new_tokens=24,
        pings=2,
        prompts=PromptSpec(sets=("code", "prose"), per_set=1, prompt_tokens=12),
        baselines=BaselineSpec(hf_generate=False, prompt_lookup=False, local_loop=True),
    )
    out = tmp_path_factory.mktemp("fixes")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(EdgeEngine, "controller", watched)
        summary = run_benchmark(scenario, out, progress=False)
    return summary, list(read_jsonl_gz(out / RUNS_FILE)), seen


def test_each_split_run_starts_from_a_fresh_controller(ngram_bench: Bench) -> None:
    """What prompt A taught the controller does not steer prompt B (nor what the warm-up taught A)."""
    _, _, seen = ngram_bench
    assert len(seen) == 3  # the warm-up, then prompt A, then prompt B
    (warmup, _), (a, a_start), (b, b_start) = seen
    assert len({id(warmup), id(a), id(b)}) == 3  # B does not go on with A's controller, nor A with the warm-up's
    assert a.prior("ngram").proposals > 0  # and A's run did teach its controller something
    for controller, start in ((a, a_start), (b, b_start)):
        assert controller.drafters == ["ngram"]
        # no estimates at all as the run starts: none seeded from the engine-wide ones of earlier prompts either
        assert start.proposals == 0
        assert not start.reached


def test_local_loop_is_the_reference_without_hf_generate(ngram_bench: Bench) -> None:
    summary, runs, _ = ngram_bench
    split = [r for r in runs if r["rtt_ms"] is not None]
    assert len(split) == 2
    for run in split:
        assert run["matches_hf_generate"] is True  # checked token for token, against local_loop
        assert run["token_reference"] == "local_loop"
    assert summary["token_reference"] == "local_loop"
    assert summary["baselines"]["local_loop"]["token_match"] is None  # the reference itself
    assert summary["split"][0]["token_match"] == [2, 2]


# -- the report --------------------------------------------------------------------------------


def _split_run(rtt: float) -> RunRecord:
    step = {"network_ms": 1.0, "edge_ms": 1.0, "cloud_ms": 1.0, "serialize_ms": 0.1, "step_ms": 3.1}
    return RunRecord(
        run_id=f"r0_sequential_rtt{rtt:g}_code0",
        mode="sequential",
        rtt_ms=rtt,
        measured_rtt_ms=rtt + 0.1,
        prompt_set="code",
        prompt_id="code0",
        repeat=0,
        prompt_tokens=8,
        new_tokens=9,
        wall_s=0.05,
        e2e_tok_s=180.0,
        decode_tok_s=200.0,
        decode_steps=8,
        accepted_per_step=1.0,
        prefill_ms=5.0,
        step_ms=step,
        bytes_per_step={"up": 100.0, "down": 10.0},
    )


def _environment() -> Iterator[tuple[str, Any]]:
    yield from {
        "started_utc": "2025-01-01T00:00:00Z",
        "wall_s": 1.0,
        "torch": "x",
        "transformers": "y",
        "cpu_count": 2,
        "torch_threads": 1,
    }.items()


def test_report_prints_fractional_rtts(make_checkpoint: Callable[..., Path]) -> None:
    scenario = Scenario(name="frac", model_dir=make_checkpoint("llama"), rtt_ms=(0.0, 0.5), prompts=PromptSpec())
    records = [_split_run(0.0), _split_run(0.5)]
    md = write_markdown(summarize(scenario, [], records, dict(_environment())))
    assert "| split sequential | 0 |" in md
    assert "| split sequential | 0.5 |" in md
