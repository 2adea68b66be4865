"""benchmarks/gateway_report.py: each load level is compared with the lone stream on the prompts that level sent,
paired by repeat, and the lone stream's rate on its first prompts is kept beside it."""

from __future__ import annotations

import asyncio
import importlib
import time
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest

from tests.bench.scripts import BENCHMARKS


@pytest.fixture(scope="module")
def report() -> Iterator[ModuleType]:
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(BENCHMARKS))  # the report imports gateway_load by name
        yield importlib.import_module("gateway_report")


def lone_run(repeat: int, seconds_per_prompt: dict[int, float]) -> dict[str, Any]:
    """A lone stream that ran each prompt for 64 tokens in the given seconds, back to back."""
    requests, t = [], 0.0
    for prompt, seconds in seconds_per_prompt.items():
        requests.append({"prompt": prompt, "tokens": 64, "start": t, "end": t + seconds, "gaps": [seconds / 64] * 63})
        t += seconds
    return {"streams": 1, "repeat": repeat, "tokens_per_s": 64 * len(requests) / t, "requests": requests,
            "prompts": sorted(seconds_per_prompt)}  # fmt: skip


def test_a_level_is_compared_with_the_lone_stream_on_its_own_prompts(report: ModuleType) -> None:
    # prompts 0-1 are easy (1 s each), 2-3 hard (4 s): the 2-stream level sent all four
    runs = [
        lone_run(0, {0: 1.0, 1: 1.0, 2: 4.0, 3: 4.0}),
        {"streams": 2, "repeat": 0, "tokens_per_s": 100.0, "prompts": [0, 1, 2, 3]},
    ]
    paired = report.same_requests(runs, 2)
    assert paired["x_same"] == [pytest.approx(100.0 / (256 / 10.0))]  # 25.6 tok/s over all four, not 64 on 0-1
    assert paired["lone_itl_p99_s"] == [pytest.approx(4.0 / 64)]


def test_a_prompt_the_level_sent_more_often_weighs_more_in_the_lone_rate(report: ModuleType) -> None:
    # the level sent the easy prompt 0 three times and the hard prompt 1 once: one stream on that mix
    # takes 3 x 1 s + 4 s for 4 x 64 tokens
    runs = [
        lone_run(0, {0: 1.0, 1: 4.0}),
        {"streams": 2, "repeat": 0, "tokens_per_s": 100.0, "prompts": [0, 1], "prompt_uses": [[0, 3], [1, 1]]},
    ]
    assert report.same_requests(runs, 2)["x_same"] == [pytest.approx(100.0 / (256 / 7.0))]
    runs[1].pop("prompt_uses")  # a run before 2026-12-05: each prompt it sent counts once
    assert report.same_requests(runs, 2)["x_same"] == [pytest.approx(100.0 / (128 / 5.0))]


def test_every_level_sends_its_prompts_equally_often_and_the_lone_stream_runs_them_all(report: ModuleType) -> None:
    load = importlib.import_module("gateway_load")
    requests = 8
    for n in load.LEVELS[1:]:
        sent = [load.request_prompt(i, r, requests, load.PROMPT_POOL) for i in range(n) for r in range(requests)]
        counts = {sent.count(p) for p in set(sent)}
        assert len(counts) == 1, (n, counts)
        assert set(sent) <= set(range(load.lone_requests(requests)))


def test_levels_pair_with_the_lone_run_of_their_repeat(report: ModuleType) -> None:
    runs = [
        lone_run(0, {0: 2.0, 1: 2.0}),
        lone_run(1, {0: 4.0, 1: 4.0}),  # a slower machine in the second repeat
        {"streams": 2, "repeat": 0, "tokens_per_s": 96.0, "prompts": [0, 1]},
        {"streams": 2, "repeat": 1, "tokens_per_s": 48.0, "prompts": [0, 1]},
    ]
    assert report.same_requests(runs, 2)["x_same"] == [pytest.approx(3.0), pytest.approx(3.0)]


def test_the_summary_reports_each_schedule_against_the_same_lone_stream(report: ModuleType) -> None:
    lone = lone_run(0, {0: 1.0, 1: 1.0, 2: 4.0, 3: 4.0})  # 25.6 tok/s over the four prompts
    lone["schedule"] = "queue"
    queue: dict[str, Any] = {"streams": 16, "schedule": "queue", "repeat": 0, "tokens_per_s": 256.0,
                             "prompts": [0, 1, 2, 3]}  # fmt: skip
    streams: dict[str, Any] = {**queue, "schedule": "streams", "tokens_per_s": 128.0}
    for run in (lone, queue, streams):
        run.update(ttft_p50_s=0.1, ttft_p99_s=0.2, itl_p50_s=0.01, itl_p99_s=0.05, edge_batches={})
    raw = {"levels": {"engine": [lone, queue, streams]}, "prefill": [{"ratio": 5.0, "repeat": 0}],
           "prefill_control": []}  # fmt: skip
    summary = report.summarise(raw, "queue")
    assert summary["servers"] == ["engine", "engine, streams"]
    assert [r["streams"] for r in summary["engine"]] == [1, 16]
    assert [r["streams"] for r in summary["engine, streams"]] == [16]  # the lone stream is the primary's row
    checks = summary["checks"]
    assert checks["x16 (target >= 10)"] == pytest.approx(10.0)
    assert checks["x16, streams schedule"] == pytest.approx(5.0)
    assert checks["itl p99 16 / 1 (target <= 2)"] == pytest.approx(0.05 / (4.0 / 64))
    # a run from before the schedules (no "schedule" key) is all "streams"
    old = {"levels": {"engine": [{k: v for k, v in run.items() if k != "schedule"} for run in (lone, streams)]},
           "prefill": raw["prefill"], "prefill_control": []}  # fmt: skip
    assert report.summarise(old)["checks"]["x16 (target >= 10)"] == pytest.approx(5.0)
    results = {"summary": summary, "commit": "abc", "baseline": None, "repeats": 1, "requests": 2, "max_tokens": 64,
               "command": "python benchmarks/gateway_load.py", "platform": "test", "cpu_count": 2,
               "schedules": ["queue", "streams"]}  # fmt: skip
    text = report.markdown(results)
    assert "| engine, streams | 16 | 128.0 |" in text
    assert "vLLM's `benchmark_serving --max-concurrency N`" in text
    assert "Beside it at 16 and 32 streams (rows `engine, streams`)" in text
    assert "prefill-interference prompt" not in text  # results from before it was recorded
    raw["prefill"] = [{"ratio": 5.0, "repeat": 0, "prefill_s": 2.5}, {"ratio": 4.0, "repeat": 1, "prefill_s": 1.5}]
    longer = report.markdown({**results, "raw": raw, "long_prompt": 2000, "base_positions": 4096})
    assert "The prefill-interference prompt: 2000 tokens (and prefilled in a median 2.00 s among 16 streams)" in longer
    assert "a copy of the base model declaring 4096 positions" in longer


def test_a_run_of_chosen_levels_without_the_prefill_measure_reports_what_it_measured(report: ModuleType) -> None:
    """``--levels 1 24 --no-prefill``: a 24-stream row (not one of the default levels) against the lone stream, no
    x16/x32 and no prefill checks (not measured), and no prefill sentence."""
    lone = lone_run(0, {0: 1.0, 1: 1.0})  # 64 tok/s
    level: dict[str, Any] = {"streams": 24, "schedule": "queue", "repeat": 0, "tokens_per_s": 320.0, "prompts": [0, 1]}
    for run in (lone, level):
        run.update(schedule="queue", ttft_p50_s=0.1, ttft_p99_s=0.2, itl_p50_s=0.01, itl_p99_s=0.05, edge_batches={})
    raw = {"levels": {"engine": [lone, level]}, "prefill": [], "prefill_control": []}
    summary = report.summarise(raw, "queue")
    assert [(r["streams"], r["vs_1_stream"]) for r in summary["engine"]] == [(1, 1.0), (24, pytest.approx(5.0))]
    checks = summary["checks"]
    assert checks["x16 (target >= 10)"] is None
    assert checks["x32 (target >= 16)"] is None
    assert checks["prefill p99 / p50 (target <= 3)"] is None
    results = {"summary": summary, "commit": "abc", "baseline": None, "repeats": 1, "requests": 2, "max_tokens": 64,
               "command": "python benchmarks/gateway_load.py --levels 1 24 --no-prefill", "platform": "test",
               "cpu_count": 2, "schedules": ["queue"], "levels": [1, 24], "raw": raw}  # fmt: skip
    text = report.markdown(results)
    assert "| engine | 24 | 320.0 |" in text
    assert "prefill" not in text.split("## Targets")[1].split("##")[0]  # no prefill check shown
    assert "prefill-interference prompt" not in text


def test_other_schedules_run_beside_the_first_on_the_engine_at_16_and_32_streams(report: ModuleType) -> None:
    load = importlib.import_module("gateway_load")
    labels = ["engine", "baseline"]
    assert load.level_runs(labels, ["queue", "streams"], 1, 0) == [("engine", "queue"), ("baseline", "queue")]
    assert load.level_runs(labels, ["queue", "streams"], 8, 0) == [("engine", "queue")]
    assert load.level_runs(labels, ["queue", "streams"], 16, 0) == [
        ("engine", "queue"), ("engine", "streams"), ("baseline", "queue")
    ]  # fmt: skip
    assert load.level_runs(labels, ["queue", "streams"], 32, 1) == [("engine", "streams"), ("engine", "queue")]
    assert load.level_runs(["engine"], ["streams"], 32, 1) == [("engine", "streams")]


def test_the_queue_schedule_keeps_every_stream_busy_until_the_queue_is_empty(
    report: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    load = importlib.import_module("gateway_load")
    seconds = {0: 0.2}  # prompt 0 is slow, the others quick

    async def fake_stream(client: object, prompt: str, max_tokens: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        await asyncio.sleep(seconds.get(int(prompt), 0.01))
        now = time.perf_counter()
        return {"start": t0, "chunks": [now], "counts": [max_tokens], "tokens": max_tokens, "end": now}

    monkeypatch.setattr(load, "stream_one", fake_stream)
    pool = [str(p) for p in range(8)]
    per_worker = asyncio.run(load.queue_workers(None, pool, 2, 8, 16))
    prompts = [[r["prompt"] for r in worker] for worker in per_worker]
    # the first worker's slow request 0 outlasts the other seven, which the second takes one after another (the
    # streams schedule would have given each stream four whatever they cost)
    assert prompts == [[0], [1, 2, 3, 4, 5, 6, 7]]
    assert [r["prompt"] for r in asyncio.run(load.queue_workers(None, pool, 1, 12, 16))[0]] == [*range(8), 0, 1, 2, 3]
    assert all(r["tokens"] == 16 for worker in per_worker for r in worker)


@pytest.fixture(scope="module")
def measures(report: ModuleType) -> ModuleType:
    return importlib.import_module("gateway_measures")  # on the path the report fixture put it


def test_a_speculative_steps_chunks_are_one_delivery(measures: ModuleType) -> None:
    # tokens at 0 s; 3 in one step at 0.100 s; 1 at 0.200 s
    chunks, ones = [0.0, 0.100, 0.1005, 0.101, 0.200], [1] * 5
    burst = measures.burst_s(80.0)
    assert burst == pytest.approx(0.02)  # a quarter of the round trip every step of a stream crosses
    gaps = [(0.101, pytest.approx(0.101)), (0.200, pytest.approx(0.099))]
    assert measures.delivery_gaps(chunks, ones, burst) == gaps
    per_token = measures.token_latencies(chunks, ones, burst)
    assert [latency for _, latency in per_token] == pytest.approx([0.101 / 3] * 3 + [0.099])
    # a step's chunks reach a busy client milliseconds apart: still one delivery (was three at a 2 ms threshold)
    spread = [0.0, 0.100, 0.1025, 0.104]
    assert measures.deliveries(spread, [1] * 4, burst) == [(0.104, pytest.approx(0.104), 3)]
    assert measures.burst_s(0.0) == measures.BURST_FLOOR_S
    assert measures.tpot({"chunks": chunks, "counts": ones}) == pytest.approx(0.05)
    assert measures.tpot({"chunks": [0.0], "counts": [1]}) is None
    # the same tokens with the step as one chunk of 3 (serve since stop 64): the same figures
    whole, counts = [0.0, 0.101, 0.200], [1, 3, 1]
    assert measures.delivery_gaps(whole, counts, burst) == gaps
    assert [x for _, x in measures.token_latencies(whole, counts, burst)] == pytest.approx([0.101 / 3] * 3 + [0.099])
    assert measures.tpot({"chunks": whole, "counts": counts}) == pytest.approx(0.05)


def test_nearest_rank_quantiles(measures: ModuleType) -> None:
    values = [float(v) for v in range(100)]
    assert measures.quantile(values, 0.99) == 98.0  # the 99th of 100, not the largest
    assert measures.quantile(values, 0.5) == 49.0
    assert measures.quantile(values, 1.0) == 99.0
    assert measures.quantile([3.0], 0.99) == 3.0
    assert measures.quantile([], 0.5) != measures.quantile([], 0.5)  # NaN


def test_a_delivery_that_waited_through_the_prefill_counts_during_it(measures: ModuleType) -> None:
    # a 3-token delivery 0.25 s after the previous one, 0.1 s past the window's end: it waited through the window
    chunks = [0.0, 0.95, 1.2, 1.2005, 1.201]
    per_token, per_delivery = measures.overlapping(chunks, [1] * 5, 0.02, (1.0, 1.1))
    assert per_delivery == [pytest.approx(0.251)]
    assert per_token == pytest.approx([0.251 / 3] * 3)  # the per-token rule dropped it (at > end + gap / k)
    assert measures.overlapping(chunks, [1] * 5, 0.02, (1.25, 1.3)) == ([], [])  # nothing waited through a later window


def test_the_all_active_rate_leaves_out_the_ramp_down(measures: ModuleType) -> None:
    # two streams from t0 = 0: one finishes at 1 s, the other runs alone until 3 s
    fast = [{"chunks": [0.25, 0.5, 0.75, 1.0], "counts": [1, 1, 1, 1], "tokens": 4, "end": 1.0}]
    slow = [{"chunks": [0.5, 1.0, 2.0, 3.0], "counts": [1, 1, 1, 1], "tokens": 4, "end": 3.0}]
    assert measures.all_active_rate([fast, slow], 0.0) == pytest.approx(6.0)  # 6 tokens in the first second
    assert measures.all_active_rate([slow], 0.0) == pytest.approx(4 / 3)  # a lone stream: its whole run
    stepped = [{"chunks": [0.5, 1.0, 3.0], "counts": [1, 2, 1], "tokens": 4, "end": 3.0}]  # a 2-token chunk at 1 s
    assert measures.all_active_rate([fast, stepped], 0.0) == pytest.approx(7.0)  # counted by its tokens


def test_an_unknown_schedule_is_refused_before_any_request(report: ModuleType) -> None:
    load = importlib.import_module("gateway_load")
    with pytest.raises(ValueError, match="schedule must be one of queue, streams"):
        asyncio.run(load.run_level("http://127.0.0.1:9", 2, ["p"], 1, 4, metrics=False, schedule="stream", burst=0.02))
