"""Reviewed measurement defects of benchmark scripts, each checked on its own part without running the benchmark.

draft_under_load: a level counts the tokens that arrived within its seconds, and the lone stream runs the prompts
the levels send; gateway_soak: a gateway that never recovers fails; trunk_load: nearest-rank quantiles, steps in
flight when the prefill arrives count as during it, the wall time leaves the prefill process's exit out;
eagle_matrix: each mode runs on a client of its own; gateway_report and serve_bench: ratios paired by repeat, and
serve_bench's concurrent prompts are unique, the same at every level.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import httpx
import pytest

from tests.bench.scripts import BENCHMARKS, load_script


def _load(filename: str) -> Iterator[ModuleType]:
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(BENCHMARKS))  # the scripts import their siblings by name
        yield load_script(filename, filename.removesuffix(".py") + "_measures")


@pytest.fixture(scope="module")
def under_load() -> Iterator[ModuleType]:
    yield from _load("draft_under_load.py")


@pytest.fixture(scope="module")
def soak() -> Iterator[ModuleType]:
    yield from _load("gateway_soak.py")


@pytest.fixture(scope="module")
def trunk() -> Iterator[ModuleType]:
    yield from _load("trunk_load.py")


@pytest.fixture(scope="module")
def eagle() -> Iterator[ModuleType]:
    yield from _load("eagle_matrix.py")


@pytest.fixture(scope="module")
def report() -> Iterator[ModuleType]:
    yield from _load("gateway_report.py")


@pytest.fixture(scope="module")
def serve() -> Iterator[ModuleType]:
    yield from _load("serve_bench.py")


# -- draft_under_load -------------------------------------------------------------------------------------------------


def test_a_level_counts_only_the_tokens_that_arrived_within_its_seconds(
    under_load: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    sent: list[str] = []

    async def stream_one(client: Any, prompt: str, max_tokens: int) -> dict[str, Any]:
        # 4 tokens in the first 40 ms, then 2 more 0.5 s apart: the request outlives the level's 0.3 s
        sent.append(prompt)
        start, chunks = time.perf_counter(), []
        for gap in (0.01, 0.01, 0.01, 0.01, 0.5, 0.5):
            await asyncio.sleep(gap)
            chunks.append(time.perf_counter())
        return {"start": start, "chunks": chunks, "counts": [1] * 6, "tokens": 6, "end": time.perf_counter()}

    monkeypatch.setattr(under_load, "stream_one", stream_one)
    row = under_load.measure_level("http://127.0.0.1:9", ["a", "b", "c"], 2, 0.3, os.getpid())
    assert sent == ["a", "b"]  # one request a stream, from the queue
    assert row["tokens"] == 12  # every token the level produced (its CPU per token counts them all)
    assert row["wall_s"] > 0.9  # the requests ran on past the level's seconds ...
    assert row["window_s"] == pytest.approx(0.3)
    assert 20.0 <= row["tok_s"] <= 27.0  # ... but only their first 4 tokens count: 8 / 0.3 s (not 12 / 1.04 s)
    assert row["prompt_weights"] == [[0, pytest.approx(4 / 6)], [1, pytest.approx(4 / 6)]]
    assert row["stack_busy_cores"] >= 0.0


def test_the_lone_stream_runs_the_prompts_the_levels_send(
    under_load: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[str] = []

    async def stream_one(client: Any, prompt: str, max_tokens: int) -> dict[str, Any]:
        started.append(prompt)
        await asyncio.sleep(0.01)
        now = time.perf_counter()
        return {"start": now, "chunks": [now], "counts": [1], "tokens": 1, "end": now}

    monkeypatch.setattr(under_load, "stream_one", stream_one)
    pool = ["p0", "p1", "p2", "p3"]
    lone = asyncio.run(under_load.lone_pass("http://127.0.0.1:9", pool))
    assert started == pool  # the lone stream: the whole pool once
    assert [r["prompt"] for r in lone] == [0, 1, 2, 3]
    started.clear()
    level = asyncio.run(under_load.closed_loop("http://127.0.0.1:9", pool, 3, time.perf_counter() + 0.5))
    assert len(started) >= 6
    assert started == [pool[j % 4] for j in range(len(started))]  # request j on prompt j mod the pool, whatever
    assert sorted(r["prompt"] for r in level) == sorted(pool.index(p) for p in started)  # the stream that sent it


def _lone_row(repeat: int, seconds: dict[int, float]) -> dict[str, Any]:
    requests, t = [], 0.0
    for prompt, s in seconds.items():
        requests.append({"prompt": prompt, "tokens": 64, "start": t, "end": t + s})
        t += s
    row = {"arm": "draft", "streams": 1, "repeat": repeat, "tok_s": 64 * len(seconds) / t, "requests": requests,
           "prompt_weights": [[p, 1.0] for p in seconds]}  # fmt: skip
    return row


def test_each_level_is_compared_with_the_lone_stream_on_its_own_prompts(under_load: ModuleType) -> None:
    # prompts 0-1 are easy (1 s each alone), 2-3 hard (4 s): the 4-stream level's counted tokens were on 2-3
    figures = {"serve_cpu_ms_per_token": 1.0, "stack_busy_cores": 1.0, "stack_cpu_ms_per_token": 1.0,
               "machine_busy_cores": 1.0, "machine_cpu_ms_per_token": 1.0}  # fmt: skip
    rows = [
        {**_lone_row(0, {0: 1.0, 1: 1.0, 2: 4.0, 3: 4.0}), **figures},
        {"arm": "draft", "streams": 4, "repeat": 0, "tok_s": 64.0, "prompt_weights": [[2, 1.0], [3, 1.0]], **figures},
    ]
    cell = under_load.summarise(rows, [1, 4], 1, ["draft"])["4"]
    assert cell["draft:x_one_stream"] == pytest.approx(64.0 / (128 / 8.0))  # 4x, not 64 / 25.6 = 2.5x


def test_the_report_names_the_stacks_cpu_not_the_machines(under_load: ModuleType) -> None:
    c = {f"draft:{k}": 1.0 for k in ("tok_s", "serve_cpu_ms_per_token", "stack_busy_cores", "stack_cpu_ms_per_token")}
    results = {"environment": {"commit": "abc"}, "repeats": 1, "seconds": 25.0, "warm_s": 8.0, "rtt_ms": 80.0,
               "command": "python benchmarks/draft_under_load.py", "arms": ["draft"], "summary": {"16": c}}  # fmt: skip
    text = under_load.markdown(results)
    assert "stack busy cores" in text
    assert "machine busy cores" not in text


def test_a_flags_arm_runs_the_draft_stack_with_its_flags_after_the_stacks_own(
    under_load: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    commands: list[list[str]] = []

    def spawn(args: list[str], src: Any = None) -> Any:
        commands.append(args)
        return SimpleNamespace(pid=len(commands))

    stack = under_load.start_stack.__globals__  # gateway_load's: start_stack spawns through its own names
    monkeypatch.setitem(stack, "spawn", spawn)
    monkeypatch.setitem(stack, "_wait_for_port", lambda *a: None)
    under_load.start_stack(80.0, Path("old-src"), serve_flags=["--threads", "2"], trunk_flags=["--compute-on", "x"])
    trunks = [c for c in commands if c[:2] == ["cloud", "serve"]]
    serves = [c for c in commands if c[0] == "serve"]
    # the engine's stack first, then the baseline's: only the engine's get the flags, after their own
    assert trunks[0][-2:] == ["--compute-on", "x"]
    assert "--compute-on" not in trunks[1]
    assert serves[0][-2:] == ["--threads", "2"]
    assert serves[0].count("--threads") == 2
    assert serves[1][-2:] != ["--threads", "2"]

    seen: dict[str, Any] = {}

    def start(*args: Any, **kwargs: Any) -> Any:
        seen.update(kwargs)
        raise StopIteration  # the stack's flags are what is checked here, not a run

    monkeypatch.setattr(under_load, "start_stack", start)
    arguments = SimpleNamespace(rtt_ms=80.0, workers=None, baseline_draft="on", serve_flags=None,
                                trunk_flags="--batch-gather 0 --compute-on 'threads'")  # fmt: skip
    with pytest.raises(StopIteration):
        under_load.measure_arm("trunk-flags", arguments, [], None)
    assert seen["draft_model"]
    assert seen["trunk_flags"] == ["--batch-gather", "0", "--compute-on", "threads"]
    assert seen["serve_flags"] == ()
    for arm, src in (("draft", Path("engine/src")), ("baseline", Path("old/src")), ("no-draft", Path("engine/src"))):
        with pytest.raises(StopIteration):
            under_load.measure_arm(arm, arguments, [], Path("old/src"), Path("engine/src"))
        assert seen["engine_src"] == src  # with a baseline, every arm runs from a worktree


def test_an_ab_runs_both_arms_from_worktrees_and_the_working_tree_as_it_is(
    under_load: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a baseline, the engine's arm runs the working tree's code (changed and new files included) from a
    worktree, as the baseline's does, and the repository's index, files and branch stay as they were."""
    gateway = under_load.start_stack.__globals__

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], check=True, capture_output=True, text=True).stdout.strip()

    monkeypatch.chdir(tmp_path)
    git("init", "-q")
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "code.py").write_text("OLD = 1\n")
    git("add", "src/code.py")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "old")
    old = git("rev-parse", "HEAD")
    assert gateway["working_tree_commit"]() == old  # nothing changed: HEAD itself
    (tmp_path / "src" / "code.py").write_text("NEW = 2\n")
    (tmp_path / "src" / "added.py").write_text("ADDED = 3\n")
    status = git("status", "--porcelain")
    with gateway["checkouts"](old) as (engine, baseline):
        assert (engine / "code.py").read_text() == "NEW = 2\n"
        assert (engine / "added.py").read_text() == "ADDED = 3\n"
        assert (baseline / "code.py").read_text() == "OLD = 1\n"
        assert not (baseline / "added.py").exists()
        assert engine.resolve() != (tmp_path / "src").resolve()
    assert git("rev-parse", "HEAD") == old
    assert git("status", "--porcelain") == status  # nothing staged, nothing lost
    assert git("worktree", "list").count("\n") == 0  # both worktrees removed
    with gateway["checkouts"](None) as pair:
        assert pair == (None, None)  # no A/B: this checkout as installed


def test_a_flags_arm_is_reported_over_the_draft_arm_paired_by_repeat(under_load: ModuleType) -> None:
    figures = {"serve_cpu_ms_per_token": 1.0, "stack_busy_cores": 1.0, "stack_cpu_ms_per_token": 1.0}
    rows = [
        {"arm": arm, "streams": 32, "repeat": k, "tok_s": tok_s, **figures}
        for arm, rates in (("draft", (300.0, 400.0)), ("trunk-flags", (330.0, 360.0)))
        for k, tok_s in enumerate(rates)
    ]
    cell = under_load.summarise(rows, [32], 2, ["draft", "trunk-flags"])["32"]
    assert cell["ratio_trunk-flags_per_repeat"] == pytest.approx([1.1, 0.9])
    results = {"environment": {"commit": "abc"}, "repeats": 2, "seconds": 20.0, "warm_s": 8.0, "rtt_ms": 80.0,
               "command": "python benchmarks/draft_under_load.py", "arms": ["draft", "trunk-flags"],
               "trunk_flags": "--compute-on threads", "summary": {"32": cell}}  # fmt: skip
    assert "`trunk-flags` (`--compute-on threads`) over `draft` (paired per repeat): 32 streams 1.00 (1.10, 0.90)" in (
        under_load.markdown(results)
    )


# -- gateway_soak -----------------------------------------------------------------------------------------------------


def test_a_gateway_answering_typed_errors_after_the_first_fault_fails(soak: ModuleType) -> None:
    verdict = soak.judge({"outcomes": ["ok"] + ["typed-503"] * 500, "samples": []})
    assert not verdict["passed"]
    assert any("typed errors" in f for f in verdict["failures"])


def test_a_gateway_must_serve_a_request_soon_after_each_recovery(soak: ModuleType) -> None:
    # 100 ok requests before the trunk's kill at 30 s, its restart at 33 s, then typed 503s only (10 of them)
    outcomes = ["ok"] * 100 + ["typed-503"] * 10
    ended = [0.3 * i for i in range(100)] + [34.0 + i for i in range(10)]
    timeline: list[list[Any]] = [["fault", 30.0], ["recovered", 33.0]]
    raw = {"outcomes": outcomes, "ended": ended, "timeline": timeline, "samples": []}
    verdict = soak.judge(raw, 15.0)
    assert not verdict["passed"]
    assert verdict["failures"] == ["no request completed ok within 15.0 s of the recovery at 33.0 s"]
    raw["outcomes"] = [*outcomes[:-1], "ok"]  # one ok at 43 s: it recovered
    assert soak.judge(raw, 15.0)["passed"]
    assert soak.judge({**raw, "timeline": [*timeline, ["fault", 40.0]]}, 15.0)["failures"] == [
        "no request completed ok within 7.0 s of the recovery at 33.0 s"  # the next fault came first
    ]


# -- trunk_load -------------------------------------------------------------------------------------------------------


def test_trunk_load_quantiles_are_nearest_rank(trunk: ModuleType) -> None:
    values = [float(v) for v in range(100)]
    assert trunk.quantile(values, 0.99) == 98.0  # the 99th of 100, not the largest
    assert trunk.quantile(values, 0.5) == 49.0
    assert trunk.quantile(values, 0.07) == 6.0  # 0.07 x 100 is 7.000000000000001
    assert trunk.quantile(values, 1.0) == 99.0
    assert trunk.quantile([3.0], 0.99) == 3.0


def test_a_step_in_flight_when_the_prefill_arrives_counts_during_it(trunk: ModuleType) -> None:
    steps = [(0.90, 50.0), (0.95, 300.0), (1.20, 40.0), (1.49, 20.0), (1.60, 10.0)]  # (sent at, ms)
    during, outside = trunk.split_by_window(steps, (1.0, 1.5))
    assert during == [300.0, 40.0, 20.0]  # the second was sent before 1.0 s and waited through it
    assert outside == [50.0, 10.0]
    assert trunk.split_by_window(steps, (0.0, 0.0)) == ([], [s[1] for s in steps])  # no prefill: none during


def test_the_mix_wall_time_leaves_the_prefill_process_exit_out(
    trunk: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    class FakeSession:
        def __init__(self, endpoint: Any) -> None:
            self.sid, self.length = "s", 0
            self.latencies: list[tuple[float, float]] = []
            self.channel = SimpleNamespace(close=lambda: asyncio.sleep(0))

        async def open(self) -> None:
            return None

        async def step(self, q: int) -> float:
            self.length += q
            return 0.0

        async def decode_while(self, done: asyncio.Event) -> None:
            while not done.is_set():
                sent = time.perf_counter()
                await asyncio.sleep(0.01)
                self.latencies.append((sent, 10.0))

    class FakePrefill:
        def __init__(self, endpoint: Any, tokens: int) -> None:
            pass

        async def ready(self) -> str:
            return "heavy"

        async def prefill(self) -> tuple[float, float]:
            now = time.perf_counter()
            await asyncio.sleep(0.02)
            return now, now + 0.02

        async def close(self) -> None:
            await asyncio.sleep(0.6)  # the prefill process's interpreter exiting

    class FakeServer:
        endpoint = SimpleNamespace(max_positions=4096, bytes_per_token=8)
        asked = 0

        async def kv_bytes(self) -> dict[str, int]:
            self.asked += 1
            return {} if self.asked == 1 else {"heavy": 800, "s": 80}

    monkeypatch.setattr(trunk, "Session", FakeSession)
    monkeypatch.setattr(trunk, "PrefillEdge", FakePrefill)
    run = asyncio.run(trunk.run_load(FakeServer(), 1, 0.2, True, prefill=100))
    assert run["steps_per_s"] > run["steps"] / 0.5  # over ~0.12 s of decoding, not the prefill process's exit too
    assert run["wall_s"] < 0.5


# -- eagle_matrix -----------------------------------------------------------------------------------------------------


def test_every_mode_runs_on_a_client_of_its_own(eagle: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    class FakeRuntime:
        def __init__(self, config: Any, model: Any = None, draft_model: Any = None) -> None:
            self.model, self.draft_model, self.draft_head = "edge", "draft", "head"

    class FakeClient:
        def __init__(self, config: Any, runtime: Any = None) -> None:
            self.config = config
            self.modes: list[str] = []
            made.append(self)

        async def __aenter__(self) -> FakeClient:
            return self

        async def __aexit__(self, *exc: object) -> None:
            return None

        async def generate(self, *args: Any, **kwargs: Any) -> None:
            return None

    made: list[FakeClient] = []

    async def one(client: FakeClient, prompt: Any, answer: int, mode: str, temperature: float, seed: int) -> Any:
        client.modes.append(mode)
        return {"mode": mode}

    monkeypatch.setattr(eagle, "EdgeRuntime", FakeRuntime)
    monkeypatch.setattr(eagle, "SplitClient", FakeClient)
    monkeypatch.setattr(eagle, "EdgeConfig", lambda **kwargs: SimpleNamespace(**kwargs))
    monkeypatch.setattr(eagle.dataclasses, "replace", lambda c, **kw: SimpleNamespace(**{**vars(c), **kw}))
    monkeypatch.setattr(eagle.AutoTokenizer, "from_pretrained", lambda *a, **k: None)
    monkeypatch.setattr(eagle, "prompts", lambda *a: [("p", list(range(32)), 8)])
    monkeypatch.setattr(eagle, "one", one)
    modes = ["off", "ngram", "draft", "eagle", "auto", "eagle-chain"]
    args = SimpleNamespace(draft_model=None, draft_head=None, edge_layers=(2, 2), modes=modes, long=False,
                           long_tokens=0, answer_tokens=8, repeats=2, temperatures=[0.0])  # fmt: skip
    rows, _ = asyncio.run(eagle.run_matrix(args, Path("unused"), {20: 1}))
    assert len(rows) == 2 * len(modes)
    used = [c for c in made if c.modes]
    assert sorted(c.modes[0] for c in used) == sorted(m.removesuffix("-chain") for m in modes)
    assert all(len(set(c.modes)) == 1 and len(c.modes) == 2 for c in used)  # one mode a client, every repeat
    chain = next(c for c in used if c.config.__dict__.get("draft_tree_width") == 1)
    assert chain.modes == ["eagle", "eagle"]  # eagle-chain's client drafts chains


# -- gateway_report ---------------------------------------------------------------------------------------------------


def _level(streams: int, repeat: int, tok_s: float, itl_p99: float, schedule: str = "queue") -> dict[str, Any]:
    return {"streams": streams, "repeat": repeat, "schedule": schedule, "tokens_per_s": tok_s, "prompts": [0],
            "ttft_p50_s": 0.1, "ttft_p99_s": 0.2, "itl_p50_s": 0.01, "itl_p99_s": itl_p99,
            "edge_batches": {}}  # fmt: skip


def test_gateway_ratios_are_paired_by_repeat(report: ModuleType) -> None:
    # three repeats on a machine whose speed drifts: per repeat the 16-stream p99 is 2x, 2x and 0.5x the lone one's
    lone_p99 = [0.1, 0.2, 0.4]
    level_p99 = [0.2, 0.4, 0.2]
    engine, baseline = [], []
    for k in range(3):
        lone = _level(1, k, 30.0, 0.0)
        lone["requests"] = [{"prompt": 0, "tokens": 64, "start": 0.0, "end": 2.0, "gaps": [lone_p99[k]] * 10}]
        engine += [lone, _level(16, k, [100.0, 200.0, 400.0][k], level_p99[k])]
        baseline += [_level(1, k, 30.0, 0.0), _level(16, k, [50.0, 400.0, 200.0][k], 0.1)]
    raw = {"levels": {"engine": engine, "baseline": baseline}, "prefill": [{"ratio": 1.0, "repeat": 0}]}
    checks = report.summarise(raw, "queue")["checks"]
    assert checks["itl p99 16 / 1 (target <= 2)"] == pytest.approx(2.0)  # median(2, 2, 0.5); medians: 0.2 / 0.2
    assert checks["itl p99 16 / 1 per repeat"] == pytest.approx([2.0, 2.0, 0.5])
    assert checks["16 streams engine / baseline"] == pytest.approx(2.0)  # median(2, 0.5, 2); medians: 200 / 200
    assert checks["16 streams per repeat"] == pytest.approx([2.0, 0.5, 2.0])


# -- serve_bench ------------------------------------------------------------------------------------------------------


def test_serve_bench_ratios_are_paired_by_repeat(serve: ModuleType) -> None:
    def chat(ttft: float) -> list[dict[str, Any]]:
        turn = {"ttft_s": ttft, "total_s": ttft, "prompt_tokens": 10, "cached_tokens": 0, "bytes_up": 100}
        return [dict(turn) for _ in serve.TURNS]

    reuse, again = [1.0, 2.0, 4.0], [2.0, 4.0, 2.0]  # re-prefill over reuse: 2, 2, 0.5 per repeat
    conc = [{"clients": n, "repeat": k, "tokens_per_s": t, "median_ttft_s": 0.1}
            for k, (one, four) in enumerate([(10.0, 40.0), (20.0, 20.0), (40.0, 50.0)])
            for n, t in ((1, one), (4, four))]  # fmt: skip
    raw = {"chat": {"reuse": [chat(t) for t in reuse], "re-prefill": [chat(t) for t in again]}, "concurrency": conc}
    summary = serve.summarize(raw, [1, 4])
    assert summary["turns"][0]["ttft_ratio"] == pytest.approx(2.0)  # median(2, 2, 0.5); medians: 2 / 2
    assert summary["turns"][0]["total_ratio"] == pytest.approx(2.0)
    assert summary["concurrency"][1]["speedup_vs_1"] == pytest.approx(1.25)  # median(4, 1, 1.25); medians: 40 / 20


def test_serve_bench_levels_share_the_prompts_and_send_each_request_a_unique_one(serve: ModuleType) -> None:
    prompts: list[list[str]] = []
    chunk = {"choices": [{"text": "x"}], "usage": {"completion_tokens": 1}}
    running, most = 0, 0

    async def handler(request: httpx.Request) -> httpx.Response:
        nonlocal running, most
        prompts[-1].append(json.loads(request.content)["prompt"])
        running += 1
        most = max(most, running)
        await asyncio.sleep(0.01)
        running -= 1
        return httpx.Response(200, text=f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n")

    async def go() -> None:
        nonlocal most
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
            for rep in range(2):
                for n in (1, 4):
                    prompts.append([])
                    most = 0
                    row = await serve.concurrent_batch(http, "http://test", n, rep, 4)
                    assert most == n  # n clients at once, no more
                    assert row["tokens"] == len(serve.CONCURRENT_PROMPTS)

    asyncio.run(go())
    every = [p for batch in prompts for p in batch]
    assert len(every) == 4 * len(serve.CONCURRENT_PROMPTS)
    assert len(set(every)) == len(every)  # no prompt twice: none can hit the prefix-reuse server's cache
    for batch in prompts:  # one client or four: the same texts behind the numbers (speedup_vs_1 is like for like)
        assert sorted(p.split(": ", 1)[1] for p in batch) == sorted(serve.CONCURRENT_PROMPTS)
