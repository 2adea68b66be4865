"""Gateway load: ``splitspec serve`` (the edge engine) under concurrent OpenAI streams through an 80 ms WAN.

Processes on loopback, as a deployment has them: ``splitspec cloud serve`` (the demo base model,
float32), the WAN emulator (``splitspec netem``, 80 ms RTT), and ``splitspec serve`` with the
draft model and ``--speculate auto`` (float32). With ``--baseline REF`` a second trunk, link and
``splitspec serve`` run the code of commit REF (a git worktree of it, same venv; an older commit
may speak an older protocol) beside them, for the comparison side by side; the baseline is
measured at 1 and 16 streams. The engine's side then runs this working tree's code from a worktree
too (a commit of the tree as it is, ``engine_commit`` in the results), so both sides load alike.

The load is the official ``openai`` client: N requests in flight (N = 1, 4, 8, 16, 32) over N x ``--requests`` (8)
streamed completions, as a load tester keeps N in flight over many more requests than N. ``--schedules`` says how:
``queue`` (the default) is vLLM's ``benchmark_serving --max-concurrency N``: N workers take the next request from
one queue as each finishes, so all N stay busy until the queue is empty; ``streams`` (this benchmark's schedule
until 2026-12-05) gives each of the N streams its own ``--requests`` requests, back to back, so a level ends with
the slowest stream while those that finished leave fewer running. A second schedule is measured beside the first
at 16 and 32 streams. The prompts: a pool of 64 128-token windows cut from held-out documents; request j takes
window j mod 64 (``streams``: stream i's r-th request takes (i x requests + r) mod 64), so every level sends each
window it uses equally often, and the lone stream runs every window once (each level is compared with one stream
on the same text). Each request
is behind a request number of its own (so the server's prefix cache never lets a prompt seen before skip its
prefill), 64 tokens out, greedy. Per level: aggregate output tok/s
(completion tokens / wall time), time to first token p50/p99, inter-token latency p50/p99 (per
token: the gap between a stream's deliveries over the tokens delivered, as vLLM counts it; a
speculative step delivers several tokens at once), and the edge compute per forward and per
sequence against the batch size (the server's ``/metrics``). Then, at 16
streams, one extra request with a long prompt: the other streams' inter-token p99 while it
prefills, against their p50.

Repeats are interleaved (levels alternate direction, servers alternate order); medians and
ratios are reported. Writes ``gateway_load.json``, ``gateway_load.md`` and ``gateway_load.png``.

    python benchmarks/gateway_load.py [--repeats 3] [--schedules queue streams] [--baseline 2499b7e]
        [--levels 1 4 8 16 32] [--no-prefill] [--out benchmarks/results/gateway]

A full run takes about 20 minutes on a 2-core machine; ``--levels 1 32 --no-prefill`` measures the lone stream and
one level (the x32 figure) in about a third of that, for trying a change.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import openai
from auto_floor import POSITIONS, extended_copy
from gateway_measures import (
    BURST_FLOOR_S,
    all_active_rate,
    burst_s,
    delivery_gaps,
    edge_forwards,
    metric_samples,
    overlapping,
    per_step,
    quantile,
    step_parts,
    token_latencies,
    tpot,
)
from transformers import AutoTokenizer

from splitspec.demo import ASSETS, _stop, _wait_for_port, embedded_model, free_port
from splitspec.run_info import cpu_seconds, git_commit, run_environment

LEVELS = (1, 4, 8, 16, 32)


@contextmanager
def worktree_src(commit: str) -> Iterator[Path]:
    """The ``src`` folder of a temporary git worktree of ``commit``, removed afterwards."""
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), commit], check=True, capture_output=True)
        try:
            yield tree / "src"
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], check=False)


def working_tree_commit() -> str:
    """A commit of this working tree as it is: HEAD's, or, with changes, a new commit on HEAD of every file that is
    not ignored (tracked or not), made through a throwaway index: the index, the files and the branches stay as
    they are (the commit is unreferenced, and git's gc drops it in time)."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "GIT_INDEX_FILE": str(Path(tmp) / "index"), "GIT_AUTHOR_NAME": "benchmark",
               "GIT_AUTHOR_EMAIL": "benchmark@localhost", "GIT_COMMITTER_NAME": "benchmark",
               "GIT_COMMITTER_EMAIL": "benchmark@localhost"}  # fmt: skip

        def git(*args: str) -> str:
            return subprocess.run(["git", *args], check=True, capture_output=True, text=True, env=env).stdout.strip()

        git("read-tree", "HEAD")
        git("add", "--all")
        tree = git("write-tree")
        if tree == git("rev-parse", "HEAD^{tree}"):
            return git("rev-parse", "HEAD")
        return git("commit-tree", tree, "-p", "HEAD", "-m", "benchmark: the working tree as it was run")


@contextmanager
def checkouts(baseline: str | None) -> Iterator[tuple[Path | None, Path | None]]:
    """The ``src`` folders of an A/B's two arms, (this working tree's code, commit ``baseline``'s), each from a
    temporary git worktree so that both load their code the same way (stop 62: with this checkout's editable
    install beside a worktree on ``PYTHONPATH``, identical code read 0.97, and a commit read 0.89-0.94 where both
    from worktrees read 1.02); without a baseline, (None, None): this checkout as installed."""
    if baseline is None:
        yield None, None
        return
    with worktree_src(working_tree_commit()) as engine, worktree_src(baseline) as old:
        yield engine, old


def spawn(args: list[str], src: Path | None = None) -> subprocess.Popen[bytes]:
    """A ``splitspec`` command in a child process; ``src``: run that checkout's code instead."""
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = str(src)
    cmd = [sys.executable, "-m", "splitspec.cli", "--log-level", "WARNING", *args]
    return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, env=env)


def start_link(
    rtt_ms: float, src: Path | None, procs: list[Any], base: Path | None = None, trunk_flags: Sequence[str] = ()
) -> int:
    """A trunk server (``src``'s code, or this checkout's) of ``base`` (None: the demo base model) behind the WAN
    emulator; the emulator's port. ``trunk_flags`` go after ``cloud serve``'s own (a flag given again wins)."""
    base = base or embedded_model("base")
    trunk_port, link_port = free_port(), free_port()
    procs.append(spawn(["cloud", "serve", "--model", str(base), "--port", str(trunk_port), "--dtype", "float32",
                        "--threads", "1", "--max-sessions", "256", "--max-sessions-per-connection", "8",
                        "--max-sessions-per-address", "256", "--max-connections-per-address", "256",
                        *trunk_flags], src))  # fmt: skip
    _wait_for_port(trunk_port, procs[-1], 120)
    procs.append(spawn(["netem", "--listen", f"127.0.0.1:{link_port}", "--upstream", f"127.0.0.1:{trunk_port}",
                        "--rtt-ms", str(rtt_ms)]))  # fmt: skip
    _wait_for_port(link_port, procs[-1], 60)
    return link_port


def wait_for_workers(url: str, workers: int, timeout_s: float = 180) -> None:
    """Until ``workers`` distinct worker processes answer ``/health`` on ``url`` (the port is up with one)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while len({httpx.get(f"{url}/health", timeout=5).json()["pid"] for _ in range(8 * workers)}) < workers:
        if time.monotonic() > deadline:
            raise SystemExit(f"{workers} workers of splitspec serve did not come up in {timeout_s:.0f} s")
        time.sleep(0.5)


def start_stack(
    rtt_ms: float,
    baseline_src: Path | None,
    workers: int = 1,
    draft_model: bool = True,
    engine_src: Path | None = None,
    draft_head: bool = False,
    base_dir: Path | None = None,
    serve_flags: Sequence[str] = (),
    trunk_flags: Sequence[str] = (),
) -> tuple[list[Any], dict[str, str], dict[str, dict[str, int]]]:
    """The engine's server (``workers`` processes) and, with ``baseline_src``, the baseline's (one process),
    each with its own trunk and link (an older commit may speak an older protocol); with each server's
    process ids (trunk, link, serve) for their CPU time. ``draft_model`` False: ``auto`` without the draft model.
    ``engine_src``: the engine's server runs that checkout's code (None: this one's). ``draft_head``: the engine's
    server also has the shipped EAGLE head. ``base_dir``: the base model's checkpoint (None: the demo's), for the
    trunk and the edge alike. ``serve_flags`` / ``trunk_flags``: more flags for the engine's ``splitspec serve`` /
    its ``cloud serve``, after the stack's own (argparse: a flag given again wins)."""
    base, draft = base_dir or embedded_model("base"), embedded_model("draft")
    procs: list[Any] = []
    urls = {}
    pids: dict[str, dict[str, int]] = {}
    servers: list[tuple[str, Path | None]] = [("engine", engine_src)]
    if baseline_src is not None:
        servers.append(("baseline", baseline_src))
    for label, src in servers:
        link_port = start_link(rtt_ms, src, procs, base, trunk_flags if label == "engine" else ())
        port = free_port()
        procs.append(spawn([
            "serve", "--model", str(base), *(["--draft-model", str(draft)] if draft_model else []),
            *(["--draft-head", str(embedded_model("base-eagle"))] if draft_head and label == "engine" else []),
            "--cloud", f"ws://127.0.0.1:{link_port}",
            "--served-model-name", "demo", "--port", str(port), "--dtype", "float32", "--threads", "1",
            "--max-active", "64", "--speculate", "auto", "--allow-stock-edge-weights",
            *(["--workers", str(workers)] if label == "engine" and workers > 1 else []),
            *(serve_flags if label == "engine" else []),
        ], src))  # fmt: skip
        _wait_for_port(port, procs[-1], 180)
        urls[label] = f"http://127.0.0.1:{port}"
        pids[label] = {"trunk": procs[-3].pid, "link": procs[-2].pid, "serve": procs[-1].pid}
        if label == "engine" and workers > 1:
            wait_for_workers(urls[label], workers)
    return procs, urls, pids


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds of process ``pid`` and of every live process under it (``serve --workers``' workers are its
    supervisor's children: their time is not the supervisor's own)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError):
            continue  # gone meanwhile
    tree, frontier = {pid}, [pid]
    while frontier:
        node = frontier.pop()
        children = [child for child, parent in parents.items() if parent == node]
        tree.update(children)
        frontier += children
    total = 0.0
    for member in tree:
        try:
            total += cpu_seconds(member)
        except OSError:
            continue  # gone meanwhile
    return total


def prompts(count: int, tokens: int) -> list[str]:
    """``count`` distinct prompts of about ``tokens`` tokens: disjoint windows of the held-out documents."""
    tokenizer = AutoTokenizer.from_pretrained(embedded_model("base"), local_files_only=True)
    docs = sorted((ASSETS / "corpus" / "heldout").glob("*/*.txt"))
    ids: list[int] = []
    for doc in docs:
        ids += tokenizer(doc.read_text(encoding="utf-8"))["input_ids"]
        if len(ids) >= count * tokens:
            break
    if len(ids) < count * tokens:
        raise SystemExit(f"the held-out documents hold {len(ids)} tokens, fewer than {count} x {tokens}")
    return [str(tokenizer.decode(ids[i * tokens : (i + 1) * tokens], skip_special_tokens=True)) for i in range(count)]


_REQUEST_IDS = itertools.count(1)


def unique(prompt: str) -> str:
    """``prompt`` behind a request number of its own: the server's prefix cache keeps finished sessions,
    and a prompt sent again would skip its prefill (every level and repeat draws from the same
    windows), so each request starts differently and pays its whole prefill, as a new conversation does."""
    return f"{next(_REQUEST_IDS)}: {prompt}"


async def stream_one(client: openai.AsyncOpenAI, prompt: str, max_tokens: int) -> dict[str, Any]:
    prompt = unique(prompt)
    t0 = time.perf_counter()
    chunks: list[float] = []  # content chunks' arrival times
    counts: list[int] = []  # the tokens each carried: the usage every chunk reports (vLLM's continuous_usage_stats)
    tokens = 0
    usage: Any = {"include_usage": True, "continuous_usage_stats": True}  # a vLLM key the SDK's type does not name
    stream = await client.completions.create(
        model="demo", prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True, stream_options=usage
    )
    async for chunk in stream:
        sent = tokens
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        if chunk.choices and chunk.choices[0].text:
            chunks.append(time.perf_counter())
            counts.append(tokens - sent)
    return {"start": t0, "chunks": chunks, "counts": counts, "tokens": tokens, "end": time.perf_counter()}


def request_prompt(stream: int, r: int, requests: int, pool: int) -> int:
    """The prompt of stream ``stream``'s ``r``-th request of ``requests`` (the ``streams`` schedule): n streams send
    each prompt they use equally often whenever n x requests is a multiple of ``pool`` or at most it."""
    return (stream * requests + r) % pool


async def stream_worker(
    client: openai.AsyncOpenAI, prompts_: list[str], index: int, requests: int, max_tokens: int
) -> list[dict[str, Any]]:
    """Stream ``index``'s ``requests`` requests, back to back, on prompts ``index x requests + r`` (mod the pool);
    each result names its prompt (``prompt``)."""
    out = []
    for r in range(requests):
        prompt = request_prompt(index, r, requests, len(prompts_))
        out.append({**await stream_one(client, prompts_[prompt], max_tokens), "prompt": prompt})
    return out


async def queue_workers(
    client: openai.AsyncOpenAI, prompts_: list[str], n: int, total: int, max_tokens: int
) -> list[list[dict[str, Any]]]:
    """``total`` requests, ``n`` in flight (the ``queue`` schedule, vLLM's ``--max-concurrency``): each of ``n``
    workers takes the next request as its last one finishes, request j on prompt j mod the pool -> each worker's
    results, in the order it ran them."""
    queued = iter(range(total))  # one event loop: next() is never interleaved

    async def worker() -> list[dict[str, Any]]:
        out = []
        for j in queued:
            prompt = j % len(prompts_)
            out.append({**await stream_one(client, prompts_[prompt], max_tokens), "prompt": prompt})
        return out

    return list(await asyncio.gather(*(worker() for _ in range(n))))


SCHEDULES = ("queue", "streams")  # how a level's requests are spread over its n streams (the docstring)
PROMPT_POOL = 64  # distinct prompts the levels draw from; the lone stream runs each once


def lone_requests(requests: int) -> int:
    """Requests the lone stream runs per repeat: every prompt a level may send (the largest level's, at most the
    pool), so that each level's multiple of one stream compares the same text (see :func:`lone_rate`)."""
    return min(max(LEVELS) * requests, PROMPT_POOL)


def lone_rate(lone: list[dict[str, Any]], uses: Mapping[int, int] | Collection[int]) -> float:
    """One stream's output tok/s over the prompts a level sent, each weighted by how often it was sent
    (``uses``: prompt -> requests; a plain collection counts each once): their tokens over their wall times.

    A level sends its prompts in proportions of its own, and how many tokens a speculative step delivers depends
    on the text (prompt lookup and n-grams find matches in some prompts, not others). A lone stream's rate over its
    own first prompts only (2 of the 32 the 16-stream level sent with 2 requests a stream) measures other text: in a
    probe at ccbdee5 (closed loops of 20 s) the lone stream delivered 3.43 tokens a round trip on its first prompts
    and 2.87 on the 16-stream level's, 30.8 against 27.3 tok/s."""
    weight = dict(uses) if isinstance(uses, Mapping) else dict.fromkeys(uses, 1)
    mine = [(weight[r["prompt"]], r) for r in lone if r["prompt"] in weight]
    seconds = sum(w * (r["end"] - r["start"]) for w, r in mine)
    return sum(w * r["tokens"] for w, r in mine) / seconds if seconds > 0 else float("nan")


async def run_level(
    url: str,
    n: int,
    prompts_: list[str],
    requests: int,
    max_tokens: int,
    metrics: bool = True,
    pids: dict[str, int] | None = None,
    schedule: str = "queue",
    burst: float = BURST_FLOOR_S,
) -> dict[str, Any]:
    """One load level: ``n`` streams over ``n x requests`` requests, spread by ``schedule``. ``metrics`` False: no
    edge compute from /metrics (with several workers each scrape reaches one worker, so before/after would not be
    of the same process). ``pids``: processes (name -> pid) whose CPU time is read around the level, with this
    one's as ``load``. ``burst``: chunks closer than this are one delivery (:func:`gateway_measures.burst_s`)."""
    import httpx

    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")

    async def scrape() -> tuple[dict[tuple[str, int], tuple[float, float]], dict[str, float]]:
        if not metrics:
            return {}, {}
        async with httpx.AsyncClient() as http:
            samples = metric_samples((await http.get(f"{url}/metrics")).text)
        return edge_forwards(samples), step_parts(samples)

    watched = {**(pids or {}), "load": os.getpid()} if pids is not None else {}
    before, parts0 = await scrape()

    def used(name: str, pid: int) -> float:  # the load's own: its children are the servers measured beside it
        return cpu_seconds(pid) if name == "load" else tree_cpu_seconds(pid)

    cpu0 = {name: used(name, pid) for name, pid in watched.items()}
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
    t0 = time.perf_counter()
    if schedule == "queue":
        per_stream = await queue_workers(client, prompts_, n, n * requests, max_tokens)
    else:
        per_stream = await asyncio.gather(*(stream_worker(client, prompts_, i, requests, max_tokens) for i in range(n)))
    wall = time.perf_counter() - t0
    await client.close()
    cpu = {name: used(name, pid) - cpu0[name] for name, pid in watched.items()}
    after, parts1 = await scrape()
    results = [r for stream in per_stream for r in stream]
    ttft = [r["chunks"][0] - r["start"] for r in results if r["chunks"]]
    # each request's inter-token latencies, per token and per delivery
    latencies = [
        (
            [latency for _, latency in token_latencies(r["chunks"], r["counts"], burst)],
            [gap for _, gap in delivery_gaps(r["chunks"], r["counts"], burst)],
        )
        for r in results
    ]
    gaps = [latency for per_token, _ in latencies for latency in per_token]
    per_delivery = [gap for _, deliveries_ in latencies for gap in deliveries_]
    tpots = [x for x in map(tpot, results) if x is not None]
    batches = {}
    for key, (count, ms) in after.items():
        c0, m0 = before.get(key, (0.0, 0.0))
        if count > c0:
            part, rows = key
            batches[f"{part}:{rows}"] = {"forwards": count - c0, "ms_per_forward": (ms - m0) / (count - c0),
                                         "ms_per_sequence": (ms - m0) / (count - c0) / rows}  # fmt: skip
    tokens = sum(r["tokens"] for r in results)
    return {
        "streams": n, "schedule": schedule, "wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
        "ttft_p50_s": quantile(ttft, 0.5), "ttft_p99_s": quantile(ttft, 0.99),
        "itl_p50_s": quantile(gaps, 0.5), "itl_p99_s": quantile(gaps, 0.99), "edge_batches": batches,
        "all_active_tokens_per_s": all_active_rate(per_stream, t0),
        "delivery_itl_p50_s": quantile(per_delivery, 0.5), "delivery_itl_p99_s": quantile(per_delivery, 0.99),
        "tpot_p50_s": quantile(tpots, 0.5), "tpot_p99_s": quantile(tpots, 0.99),
        # cores each process kept busy over the level, and its CPU per output token (ms)
        "cores": {name: seconds / wall for name, seconds in cpu.items()},
        "cpu_ms_per_token": {name: 1e3 * seconds / max(1, tokens) for name, seconds in cpu.items()},
        "per_step": per_step(parts0, parts1) if metrics else {},
        "prompts": sorted({r["prompt"] for r in results}),
        "prompt_uses": [[p, c] for p, c in sorted(Counter(r["prompt"] for r in results).items())],  # [prompt, sent]
        # the lone stream's requests one by one (lone_rate), with their tokens' latencies
        **({"requests": [{"prompt": r["prompt"], "tokens": r["tokens"], "start": r["start"], "end": r["end"],
                          "gaps": per_token, "delivery_gaps": deliveries_}
                         for r, (per_token, deliveries_) in zip(results, latencies, strict=True)]}
           if n == 1 else {}),
    }  # fmt: skip


async def run_prefill_interference(
    url: str,
    prompts_: list[str],
    long_prompt: str | None,
    max_tokens: int,
    burst: float,
    window_s: float | None = None,
) -> dict[str, Any]:
    """16 streams decode; one long prompt arrives in the middle: their gaps while it prefills, against their p50.

    ``long_prompt`` None is the control: the same 16 streams with no long prompt, their gaps in a window of
    ``window_s`` at the same offset. Speculation makes a stream's per-token p50 small (a step delivers several
    tokens) while a one-token step is a whole round trip, so p99 / p50 is well above 1 with no prefill at all;
    the control says how much of the ratio the prefill adds."""
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
    workers = [asyncio.ensure_future(stream_worker(client, prompts_, i, 1, max_tokens)) for i in range(16)]
    await asyncio.sleep(1.5)  # every stream is decoding
    if long_prompt is not None:
        long = await stream_one(client, long_prompt, 4)
        window = (long["start"], long["chunks"][0] if long["chunks"] else long["end"])
    else:
        start = time.perf_counter()
        await asyncio.sleep(window_s or 0.0)
        window = (start, start + (window_s or 0.0))
    results = [r for stream in await asyncio.gather(*workers) for r in stream]
    await client.close()
    all_gaps = [latency for r in results for _, latency in token_latencies(r["chunks"], r["counts"], burst)]
    # the deliveries that waited through part of the window (came after it opened, began waiting before it
    # closed), per delivery (vLLM's inter-token latency) and per token (each of a delivery's k tokens, g / k)
    overlaps = [overlapping(r["chunks"], r["counts"], burst, window) for r in results]
    during = [latency for per_token, _ in overlaps for latency in per_token]
    inside = [gap for _, per_delivery in overlaps for gap in per_delivery]
    p50 = quantile(all_gaps, 0.5)
    delivery_p50 = quantile([gap for r in results for _, gap in delivery_gaps(r["chunks"], r["counts"], burst)], 0.5)
    return {"prefill_s": window[1] - window[0], "itl_p50_s": p50, "itl_p99_during_s": quantile(during, 0.99),
            "ratio": quantile(during, 0.99) / p50, "gaps_during": len(during),
            "delivery_itl_p50_s": delivery_p50, "delivery_itl_p99_during_s": quantile(inside, 0.99),
            "delivery_ratio": quantile(inside, 0.99) / delivery_p50, "deliveries_during": len(inside),
            "burst_s": burst,
            # what the figures came from, for a re-analysis: the window and every stream's chunk arrivals, in
            # seconds from the window's opening
            "window_s": [0.0, window[1] - window[0]],
            "chunks_s": [[round(t - window[0], 6) for t in r["chunks"]] for r in results],
            "chunk_tokens": [r["counts"] for r in results]}  # fmt: skip


def level_runs(labels: list[str], schedules: list[str], n: int, repeat: int) -> list[tuple[str, str]]:
    """The (server, schedule) runs of level ``n`` in repeat ``repeat``, in order: the first schedule on every server
    (the baseline only at 1 and 16 streams, where it is compared); the others on the engine at 16 and 32 streams
    (one stream runs the same requests whatever the schedule); the schedules' order alternates by repeat."""
    runs = []
    for label in labels:
        if label != "engine" and n not in (1, 16):
            continue
        extra = schedules[1:] if label == "engine" and n in (16, 32) else []
        mine = [schedules[0], *extra]
        runs += [(label, schedule) for schedule in (mine if repeat % 2 == 0 else reversed(mine))]
    return runs


async def run_all(
    urls: dict[str, str], args: argparse.Namespace, pids: dict[str, dict[str, int]] | None = None
) -> dict[str, Any]:
    pids = pids or {}
    texts = prompts(PROMPT_POOL + 1, 128)[1:]  # the first window starts the long prompt
    long_text = prompts(1, args.long_prompt)[0]
    burst = burst_s(args.rtt_ms)
    for url in urls.values():  # warm-up: connections, the controllers' step times (of every worker)
        await run_level(url, 8, texts, 1, 32, metrics=False, burst=burst)
    raw: dict[str, list[dict[str, Any]]] = {label: [] for label in urls}
    prefill: list[dict[str, Any]] = []
    control: list[dict[str, Any]] = []  # the same window with no long prompt
    for rep in range(args.repeats):
        levels = sorted(args.levels) if rep % 2 == 0 else sorted(args.levels, reverse=True)
        for n in levels:
            labels = list(urls) if (rep + n) % 2 == 0 else list(reversed(urls))
            for label, schedule in level_runs(labels, args.schedules, n, rep):
                single = label != "engine" or args.workers == 1
                requests = lone_requests(args.requests) if n == 1 else args.requests
                level = await run_level(urls[label], n, texts, requests, args.max_tokens, metrics=single,
                                        pids=pids.get(label), schedule=schedule, burst=burst)  # fmt: skip
                raw[label].append({**level, "repeat": rep})
                print(f"  repeat {rep} {label} {n:>2} streams ({schedule}): {level['tokens_per_s']:.1f} tok/s, "
                      f"itl p99 {level['itl_p99_s'] * 1e3:.0f} ms", file=sys.stderr)  # fmt: skip
        if args.no_prefill:
            continue
        measured = await run_prefill_interference(urls["engine"], texts, long_text, args.max_tokens, burst)
        prefill.append({**measured, "repeat": rep})
        control.append({**await run_prefill_interference(urls["engine"], texts, None, args.max_tokens, burst,
                                                         measured["prefill_s"]), "repeat": rep})  # fmt: skip
        print(f"  repeat {rep} prefill interference: {prefill[-1]['ratio']:.2f}x "
              f"(control, no prefill: {control[-1]['ratio']:.2f}x)", file=sys.stderr)  # fmt: skip
    return {"levels": raw, "prefill": prefill, "prefill_control": control}


def main() -> None:
    from gateway_report import markdown, plot, summarise  # the report imports this module

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--requests", type=int, default=8, help="streamed requests per stream and level")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--long-prompt", type=int, default=2000,
        help="tokens of the prefill-interference prompt (past the demo base model's 1,024 positions, both ends load "
        "a copy of it whose config declares 4,096: default RoPE, weights linked)",
    )  # fmt: skip
    parser.add_argument("--rtt-ms", type=float, default=80.0)
    parser.add_argument(
        "--levels", type=int, nargs="+", default=list(LEVELS),
        help="concurrent streams per level (default 1 4 8 16 32); 1, the lone stream every level is compared with, "
        "is required",
    )  # fmt: skip
    parser.add_argument(
        "--no-prefill", action="store_true",
        help="skip the prefill-interference measure (16 streams beside a long prompt, and its control) of every repeat",
    )  # fmt: skip
    parser.add_argument(
        "--baseline", default=None, help="a commit whose `splitspec serve` runs beside, for the lone stream"
    )
    parser.add_argument(
        "--schedules", nargs="+", choices=SCHEDULES, default=["queue"],
        help="how a level's requests are spread over its streams (the module's docstring); the first at every level, "
        "the others beside it at 16 and 32 streams",
    )  # fmt: skip
    parser.add_argument("--workers", type=int, default=1, help="`splitspec serve --workers` of the engine's server")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "gateway")
    args = parser.parse_args()
    if len(set(args.schedules)) < len(args.schedules):
        parser.error(f"--schedules names a schedule twice: {' '.join(args.schedules)}")
    if 1 not in args.levels or min(args.levels) < 1 or len(set(args.levels)) < len(args.levels):
        named = " ".join(map(str, args.levels))
        parser.error(f"--levels must include 1 and name distinct positive counts, got {named}")
    results: dict[str, Any] = {**run_environment(), "repeats": args.repeats, "requests": args.requests,
                               "schedules": args.schedules, "workers": args.workers,
                               "levels": sorted(args.levels),
                               **({} if args.no_prefill else {"long_prompt": args.long_prompt}),
                               "max_tokens": args.max_tokens, "baseline": args.baseline,
                               "command": "python benchmarks/gateway_load.py " + shlex.join(sys.argv[1:])}  # fmt: skip
    with checkouts(args.baseline) as (engine_src, src), tempfile.TemporaryDirectory() as work:
        base = embedded_model("base")
        positions = json.loads((base / "config.json").read_text())["max_position_embeddings"]
        # the long prompt and its 4 tokens out, with room to spare
        if not args.no_prefill and args.long_prompt + 8 > positions:
            base = extended_copy(base, Path(work) / "base")
            results["base_positions"] = POSITIONS  # what the copy declares (the report names it)
        if engine_src is not None:
            results["engine_commit"] = git_commit(engine_src)  # the working tree as it ran (a new commit if changed)
        procs, urls, pids = start_stack(args.rtt_ms, src, args.workers, engine_src=engine_src, base_dir=base)
        try:
            raw = asyncio.run(run_all(urls, args, pids))
        finally:
            _stop(procs)
    results["raw"] = raw
    results["summary"] = summarise(raw, args.schedules[0])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gateway_load.json").write_text(json.dumps(results, indent=1))
    (args.out / "gateway_load.md").write_text(markdown(results))
    plot(results, args.out)
    print(markdown(results))


if __name__ == "__main__":
    main()
