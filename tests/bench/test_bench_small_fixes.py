"""Small reviewed defects of benchmark scripts, each checked on its pure part without running the benchmark.

structured_bench: tokens per round trip leave out the prefill's token; split_overhead and device_targets: the
split runs with speculation off, like the whole model's plain greedy generate, and records it; quant_load: the
order of the loads rotates by repeat; wire_codec: the report names the link it ran over; specfed_eval: windows
never overlap; trunk_step_profile: timed blocks interleave over repeats; privacy_frontier: points without
per-token outcomes are measured again.
"""

from __future__ import annotations

import asyncio
import json
import statistics
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import httpx
import pytest

from splitspec.edge.client import GenerationResult
from tests.bench.scripts import load_script


def _module(filename: str) -> ModuleType:
    return load_script(filename, filename.removesuffix(".py") + "_small_fixes")


def test_structured_tokens_per_trip_leave_the_prefill_token_out() -> None:
    bench = _module("structured_bench.py")
    decode = 'splitspec_serve_round_trips_total{kind="decode"}'
    metrics = iter([f'{decode} 5.0\nsplitspec_serve_round_trips_total{{kind="prefill"}} 1.0\n', f"{decode} 23.0\n"])
    chunk = {"choices": [{"text": "x"}], "usage": {"completion_tokens": 22}}

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/metrics":
            return httpx.Response(200, text=next(metrics))
        return httpx.Response(200, text=f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n")

    async def go() -> dict[str, Any]:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
            row: dict[str, Any] = await bench.one(http, "http://test", "p", False, 22)
            return row

    row = asyncio.run(go())
    assert row["tokens"] == 22
    assert row["tokens_per_trip"] == pytest.approx(21 / 18)  # 18 decode trips; the first token is the prefill's
    assert round(row["tokens_per_trip"], 3) == 1.167


class _FakeClient:
    """A SplitClient that records the speculate mode and returns two tokens from one prefill and one decode step."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.speculate: list[str] = []

    async def __aenter__(self) -> _FakeClient:
        _FakeClient.last = self
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    async def generate(self, prompt: Any, n: int, params: Any, stop_token_ids: Any, speculate: str = "auto") -> Any:
        self.speculate.append(speculate)
        return GenerationResult(prompt_ids=list(prompt), token_ids=[1, 2], seed=0, wall_s=1.0, speculate=speculate)

    last: _FakeClient


def test_split_overhead_and_device_targets_run_the_split_without_speculation(monkeypatch: pytest.MonkeyPatch) -> None:
    overhead = _module("split_overhead.py")
    monkeypatch.setattr(overhead, "SplitClient", _FakeClient)
    monkeypatch.setattr(overhead, "EdgeConfig", lambda **kwargs: kwargs)
    _, _, summary = asyncio.run(overhead.split_runs(Path("unused"), "ws://unused", [1, 2, 3], 2))
    assert _FakeClient.last.speculate == ["off"]
    assert summary["speculate"] == "off"  # what the JSON records

    targets = _module("device_targets.py")
    client = _FakeClient()
    _, _, summary = asyncio.run(targets.split_generate(client, [1, 2, 3], 2))
    assert client.speculate == ["off"]
    assert summary["speculate"] == "off"


def test_quant_load_rotates_the_order_of_the_loads_by_repeat() -> None:
    quant = _module("quant_load.py")
    orders = [quant.method_order(r) for r in range(3)]
    assert orders[0] == quant.METHODS
    assert all(sorted(order) == sorted(quant.METHODS) for order in orders)
    for position in range(len(quant.METHODS)):  # over 3 repeats each method loads once first, middle and last
        assert {order[position] for order in orders} == set(quant.METHODS)
    assert quant.method_order(3) == orders[0]


def test_wire_codec_report_names_the_link_it_ran_over() -> None:
    wire = _module("wire_codec.py")
    figures = {
        "prompt_tokens": 200,
        **dict.fromkeys(("ttft_s", "prefill_network_s", "prefill_edge_s", "prefill_cloud_s"), 1.0),
        **dict.fromkeys(("prefill_serialize_ms", "prefill_bytes_up", "prefill_bytes_down", "decode_tok_s"), 1.0),
        **dict.fromkeys(("decode_step_bytes_up", "decode_step_bytes_down"), 1.0),
    }
    link = [{"codec": codec, **figures} for codec in wire.CODECS]
    text = wire.markdown(link, [], {"commit": "abc"}, "python benchmarks/wire_codec.py", 25.0, 5.0)
    assert "WAN emulator 25 ms RTT, 5 Mbit/s each way" in text
    assert "80 ms" not in text
    assert "20 Mbit" not in text


def test_specfed_windows_of_a_short_document_do_not_overlap(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    specfed = _module("specfed_eval.py")
    heldout = tmp_path / "corpus" / "heldout" / "code"
    heldout.mkdir(parents=True)
    (heldout / "short.txt").write_text(" ".join(str(i) for i in range(256 + 76)))  # room for one window of 256
    (heldout / "long.txt").write_text(" ".join(str(i) for i in range(1000)))  # room for two, spread out
    monkeypatch.setattr(specfed, "ASSETS", tmp_path)
    tokenizer = SimpleNamespace(encode=lambda text: [int(t) for t in text.split()])
    windows = specfed.load_windows(tokenizer, ["code"], 2, 2, 256)
    names = [name for name, _ in windows]
    assert names == ["code/long@0", "code/long@372", "code/short@0"]  # the short one's window @76 left out
    for _, ids in windows:
        assert len(ids) == 256
    by_doc: dict[str, list[int]] = {}
    for name, ids in windows:
        by_doc.setdefault(name.split("@")[0], []).extend(ids)
    assert all(len(ids) == len(set(ids)) for ids in by_doc.values())  # no position counted twice


def test_trunk_step_profile_interleaves_timed_blocks_over_repeats(monkeypatch: pytest.MonkeyPatch) -> None:
    profile = _module("trunk_step_profile.py")
    monkeypatch.setattr(profile, "WARM_UP", 1)
    calls: list[str] = []
    steps = {"ours": lambda: calls.append("ours"), "transformers": lambda: calls.append("transformers")}
    import torch

    timed = profile.timed_blocks(steps, torch.device("cpu"), 2, 3)
    o, t = ["ours"] * 2, ["transformers"] * 2
    assert calls == ["ours", "transformers", *o, *t, *t, *o, *o, *t]  # warm-up, then the order alternates
    for side in steps:
        per_repeat = timed[side]["wall_ms_per_repeat"]
        assert len(per_repeat) == len(timed[side]["launch_ms_per_repeat"]) == 3
        assert timed[side]["wall_ms_median"] == statistics.median(per_repeat)


def test_privacy_frontier_measures_points_without_outcomes_again(tmp_path: Path) -> None:
    frontier = _module("privacy_frontier.py")

    def point(setting: str, outcomes: bool) -> dict[str, Any]:
        p: dict[str, Any] = {"model_name": "base", "seed": 0, "setting": setting}
        p["tokens"] = {"public": 100, "traffic": 100}
        return {**p, "outcomes": {"n": 1}} if outcomes else p

    rows = [point("stock", True), point("none", False), point("adv=0.5", True)]
    (tmp_path / "points-base-s0-old.jsonl").write_text("\n".join(json.dumps(p) for p in rows) + "\n")
    done, stored = frontier.measured(tmp_path, 200)
    assert ("base", 0, "none") in stored
    assert ("base", 0, "none") not in done
    settings = tuple(SimpleNamespace(label=label) for label in ("none", "adv=0.5", "noise=0.5"))
    todo = frontier.todo_settings(settings, "base", 0, done)
    assert [s.label for s in todo] == ["none", "noise=0.5"]  # rates-only "none" again; "adv=0.5" kept
    assert frontier.todo_settings(settings[1:2], "base", 0, done) is None  # all with outcomes: skip
    assert [s.label for s in frontier.todo_settings(settings, "base", 1, done)] == ["none", "adv=0.5", "noise=0.5"]
