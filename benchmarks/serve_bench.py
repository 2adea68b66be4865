"""``splitspec serve`` through the WAN emulator: prefix reuse across chat turns, and concurrency.

Processes on loopback, as a deployment would have them: a trunk server (``splitspec cloud serve``),
the WAN emulator (``splitspec netem``, 80 ms RTT; a second link also capped in bandwidth), and two
edge servers (``splitspec serve``) sharing that link, one with prefix reuse and one that
re-prefills every prompt. The driver is a plain HTTP client reading the SSE streams.

1. **Multi-turn chat.** A scripted five-turn conversation (greedy, replies fed back as the
   assistant's turns); per turn: time to first token (first content delta), total time, prompt
   tokens reused, bytes sent up the link (the server's ``/metrics``). Turns 2-5 are compared; both
   servers produce identical replies, which the script checks.
2. **Concurrency.** N clients (1, 4, 8) share the same 8 distinct prompts (each client streams one
   completion, then takes the next prompt left), so every level generates the same text and
   ``speedup_vs_1`` compares like with like; aggregate tok/s = all completion tokens / wall time of
   the batch. Each request's prompt starts
   with a number of its own, so the prefix-reuse server's cache never serves a prompt sent at an
   earlier level or repeat (every request pays its whole prefill).

Repeats are interleaved (reuse / re-prefill, and the N's, alternate within each repeat); medians
are reported, and each ratio is the median of the ratios paired by repeat. The demo models ship
without a chat template, so a minimal one is given with ``--chat-template``. Writes
``serve_bench.json``, ``serve_bench.md`` and two PNG plots.

    python benchmarks/serve_bench.py [--repeats 3] [--out benchmarks/results/serve]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from splitspec.demo import _spawn, _stop, _wait_for_port, embedded_model, free_port
from splitspec.run_info import run_environment

CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}QUESTION.\n{{ m['content'] }}\n"
    "{% elif m['role'] == 'assistant' %}ANSWER.\n{{ m['content'] }}\n{% else %}{{ m['content'] }}\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}ANSWER.\n{% endif %}"
)
SYSTEM = "A scene between two lords of the court, in verse. Conversation {rep}."
TURNS = [
    "KING HENRY. Now, lords, what news from France?",
    "What say the English captains of the siege?",
    "And shall we march upon the town tomorrow?",
    "Speak of the Dauphin, and his answer to our claim.",
    "Then let us part, and meet again at dawn.",
]
CONCURRENT_PROMPTS = [
    "KING HENRY.\nNow, lords,", "def main():\n    ", "HAMLET.\nTo be, or not", "class Node:\n    def __init__(self",
    "ROMEO.\nBut soft, what light", "import os\nimport sys\n\n", "MACBETH.\nTomorrow, and", "for i in range(10):\n",
]  # fmt: skip


_REQUEST_IDS = itertools.count(1)


def unique(prompt: str) -> str:
    """``prompt`` behind a request number of its own (as ``gateway_load.unique``): the prefix-reuse server keeps
    finished sessions, and the same prompt sent again at every level and repeat would skip its prefill."""
    return f"{next(_REQUEST_IDS)}: {prompt}"


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split(" ")[1])
    return 0.0


async def stream_request(http: httpx.AsyncClient, url: str, body: dict[str, Any]) -> dict[str, Any]:
    """POST a streaming request; time to first content, total time, text and usage."""
    t0 = time.perf_counter()
    ttft, text, usage = None, [], None
    async with http.stream("POST", url, json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk["choices"]:
                piece = choice.get("delta", {}).get("content") or choice.get("text") or ""
                if piece and ttft is None:
                    ttft = time.perf_counter() - t0
                text.append(piece)
    return {"ttft_s": ttft, "total_s": time.perf_counter() - t0, "text": "".join(text), "usage": usage}


async def conversation(http: httpx.AsyncClient, base: str, rep: int, max_tokens: int) -> list[dict[str, Any]]:
    messages = [{"role": "system", "content": SYSTEM.format(rep=rep)}]
    turns = []
    for user in TURNS:
        messages.append({"role": "user", "content": user})
        before = metric((await http.get(f"{base}/metrics")).text, 'splitspec_serve_wire_bytes_total{direction="up"}')
        body = {"model": "demo", "messages": messages, "max_tokens": max_tokens, "temperature": 0}
        result = await stream_request(http, f"{base}/v1/chat/completions", body)
        after = metric((await http.get(f"{base}/metrics")).text, 'splitspec_serve_wire_bytes_total{direction="up"}')
        usage = result["usage"]
        turns.append({
            "ttft_s": result["ttft_s"], "total_s": result["total_s"], "text": result["text"],
            "prompt_tokens": usage["prompt_tokens"], "completion_tokens": usage["completion_tokens"],
            "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"], "bytes_up": after - before,
        })  # fmt: skip
        messages.append({"role": "assistant", "content": result["text"]})
    return turns


async def concurrent_batch(http: httpx.AsyncClient, base: str, n: int, rep: int, max_tokens: int) -> dict[str, Any]:
    """``n`` clients streaming the :data:`CONCURRENT_PROMPTS` between them, each taking the next one left."""
    bodies = [
        {"model": "demo", "prompt": unique(prompt), "max_tokens": max_tokens, "temperature": 0, "seed": rep}
        for prompt in CONCURRENT_PROMPTS
    ]
    left = iter(bodies)
    results: list[dict[str, Any]] = []

    async def client() -> None:
        for body in left:  # one shared iterator: each body is taken once, by whichever client is free
            results.append(await stream_request(http, f"{base}/v1/completions", body))

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(n)))
    wall = time.perf_counter() - t0
    tokens = sum(r["usage"]["completion_tokens"] for r in results)
    return {"clients": n, "wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
            "median_ttft_s": statistics.median(r["ttft_s"] for r in results)}  # fmt: skip


def start_stack(rtt_ms: float, bandwidth_mbit: float | None, template: Path) -> tuple[list[Any], dict[str, str]]:
    base, draft = embedded_model("base"), embedded_model("draft")
    trunk_port, link_port = free_port(), free_port()
    # float32 (the gateway benchmark's too): a CPU with AVX512-FP16 computes the float16 demo in float16 under auto,
    # where verification widths that follow the link's timing flip greedy near-ties, and the replies of the two
    # servers (and of one server twice) differ without anything being wrong
    procs = [_spawn(["cloud", "serve", "--model", str(base), "--port", str(trunk_port), "--threads", "1",
                     "--dtype", "float32"])]  # fmt: skip
    _wait_for_port(trunk_port, procs[0], 120)
    netem = ["netem", "--listen", f"127.0.0.1:{link_port}", "--upstream", f"127.0.0.1:{trunk_port}",
             "--rtt-ms", str(rtt_ms)]  # fmt: skip
    if bandwidth_mbit is not None:
        netem += ["--bandwidth-mbit", str(bandwidth_mbit)]
    procs.append(_spawn(netem))
    _wait_for_port(link_port, procs[1], 60)
    urls = {}
    for label, extra in (("reuse", []), ("re-prefill", ["--no-prefix-reuse"])):
        port = free_port()
        procs.append(_spawn([
            "serve", "--model", str(base), "--draft-model", str(draft), "--cloud", f"ws://127.0.0.1:{link_port}",
            "--served-model-name", "demo", "--port", str(port), "--chat-template", str(template), "--threads", "1",
            "--dtype", "float32",
            "--allow-stock-edge-weights", *extra,
        ]))  # fmt: skip
        _wait_for_port(port, procs[-1], 120)
        urls[label] = f"http://127.0.0.1:{port}"
    return procs, urls


async def run_link(urls: dict[str, str], repeats: int, max_tokens: int, levels: list[int]) -> dict[str, Any]:
    chats: dict[str, list[list[dict[str, Any]]]] = {label: [] for label in urls}
    conc: list[dict[str, Any]] = []
    async with httpx.AsyncClient(timeout=300) as http:
        await conversation(http, urls["reuse"], -1, 4)  # warm both servers (connections, controller)
        await conversation(http, urls["re-prefill"], -1, 4)
        for rep in range(repeats):
            order = list(urls) if rep % 2 == 0 else list(reversed(urls))
            for label in order:
                chats[label].append(await conversation(http, urls[label], rep, max_tokens))
                print(f"  repeat {rep} {label}: turn totals",
                      [round(t["total_s"], 2) for t in chats[label][-1]], file=sys.stderr)  # fmt: skip
            for n in levels if rep % 2 == 0 else list(reversed(levels)):
                conc.append({**await concurrent_batch(http, urls["reuse"], n, rep, max_tokens), "repeat": rep})
    for rep in range(repeats):  # greedy: both servers must have said exactly the same
        if [t["text"] for t in chats["reuse"][rep]] != [t["text"] for t in chats["re-prefill"][rep]]:
            raise SystemExit(f"repeat {rep}: replies differ between prefix reuse and re-prefill")
    return {"chat": chats, "concurrency": conc}


def summarize(raw: dict[str, Any], levels: list[int]) -> dict[str, Any]:
    chats, rows = raw["chat"], []
    for turn in range(1, len(TURNS)):
        row: dict[str, Any] = {"turn": turn + 1}
        for label in chats:
            ts = [c[turn] for c in chats[label]]
            row[label] = {k: statistics.median(t[k] for t in ts)
                          for k in ("ttft_s", "total_s", "prompt_tokens", "cached_tokens", "bytes_up")}  # fmt: skip
        # re-prefill over reuse in the same repeat, median over repeats
        pairs = list(zip(chats["re-prefill"], chats["reuse"], strict=True))
        row["ttft_ratio"] = statistics.median(b[turn]["ttft_s"] / a[turn]["ttft_s"] for b, a in pairs)
        row["total_ratio"] = statistics.median(b[turn]["total_s"] / a[turn]["total_s"] for b, a in pairs)
        row["bytes_ratio"] = statistics.median(b[turn]["bytes_up"] / max(1.0, a[turn]["bytes_up"]) for b, a in pairs)
        rows.append(row)
    conc = []
    lone = {c["repeat"]: c["tokens_per_s"] for c in raw["concurrency"] if c["clients"] == levels[0]}
    for n in levels:
        runs = [c for c in raw["concurrency"] if c["clients"] == n]
        conc.append({
            "clients": n, "runs": len(runs), "tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs),
            "median_ttft_s": statistics.median(r["median_ttft_s"] for r in runs),
            # over the first level's (one client's) tok/s in the same repeat, median over repeats
            "speedup_vs_1": statistics.median(r["tokens_per_s"] / lone[r["repeat"]] for r in runs),
        })  # fmt: skip
    return {"turns": rows, "concurrency": conc}


def markdown(results: dict[str, Any]) -> str:
    lines = [
        "# splitspec serve: prefix reuse and concurrency through the WAN emulator",
        "",
        f"Commit `{results['commit'][:12]}`, {results['repeats']} interleaved repeats, medians; demo models "
        f"(base split 2+4+2, draft model drafting, `--speculate auto`, float32), greedy, "
        f"{results['max_tokens']} tokens per turn.",
        "Reproduce: `python benchmarks/serve_bench.py`.",
        "Ratios (TTFT, total, vs 1 client) are medians of the ratios paired by repeat, not ratios of the medians; "
        "each concurrent request's prompt is unique (a number of its own in front), so none hits the prefix cache; "
        "every level serves the same 8 prompts (n clients take the next one left).",
    ]
    for link in results["links"]:
        lines += ["", f"## Link: {link['name']}", "", "### Turns 2-5 of a five-turn chat", "",
                  "| turn | prompt tokens | reused | TTFT reuse (s) | TTFT re-prefill (s) | TTFT ratio "
                  "| total reuse (s) | total re-prefill (s) | total ratio | bytes up reuse | bytes up re-prefill |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for r in link["summary"]["turns"]:
            a, b = r["reuse"], r["re-prefill"]
            lines.append(
                f"| {r['turn']} | {a['prompt_tokens']:.0f} | {a['cached_tokens']:.0f} | {a['ttft_s']:.3f} | "
                f"{b['ttft_s']:.3f} | {r['ttft_ratio']:.2f}x | {a['total_s']:.3f} | {b['total_s']:.3f} | "
                f"{r['total_ratio']:.2f}x | {a['bytes_up']:,.0f} | {b['bytes_up']:,.0f} |"
            )
        lines += ["", "### Concurrent clients (prefix-reuse server, completions)", "",
                  "| clients | aggregate tok/s | vs 1 client | median TTFT (s) |", "|---|---|---|---|"]  # fmt: skip
        for c in link["summary"]["concurrency"]:
            lines.append(
                f"| {c['clients']} | {c['tokens_per_s']:.1f} | {c['speedup_vs_1']:.2f}x | {c['median_ttft_s']:.3f} |"
            )
    lines += ["", f"Machine: {results['machine']}. Shared and noisy: read the ratios, not lone absolute times.", ""]
    return "\n".join(lines)


def plot(results: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    links = results["links"]
    fig, axes = plt.subplots(1, 2 * len(links), figsize=(6 * len(links) + 2, 4), squeeze=False)
    for i, link in enumerate(links):
        turns = [r["turn"] for r in link["summary"]["turns"]]
        for j, key in enumerate(("ttft_s", "total_s")):
            ax = axes[0][2 * i + j]
            for k, (label, colour) in enumerate((("reuse", "tab:blue"), ("re-prefill", "tab:orange"))):
                values = [r[label][key] for r in link["summary"]["turns"]]
                ax.bar([t + (k - 0.5) * 0.38 for t in turns], values, 0.38, label=label, color=colour)
            ax.set_xticks(turns)
            ax.set_xlabel("turn")
            ax.set_ylabel("seconds (median)")
            ax.set_title(f"{'time to first token' if key == 'ttft_s' else 'turn total'}\n{link['name']}", fontsize=9)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "serve_turns.png", dpi=120)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(5, 4))
    for link, colour in zip(links, ("tab:blue", "tab:green"), strict=False):
        conc = link["summary"]["concurrency"]
        ax.plot([c["clients"] for c in conc], [c["tokens_per_s"] for c in conc], "o-", label=link["name"], color=colour)
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("aggregate tok/s (median)")
    ax.set_title("splitspec serve: aggregate throughput")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "serve_concurrency.png", dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per turn / per concurrent request")
    parser.add_argument("--rtt-ms", type=float, default=80.0)
    parser.add_argument("--bandwidth-mbit", type=float, default=20.0, help="rate of the second link (0: skip it)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "serve")
    args = parser.parse_args()
    levels = [1, 4, 8]
    links = [(f"{args.rtt_ms:g} ms RTT", None)]
    if args.bandwidth_mbit > 0:
        links.append((f"{args.rtt_ms:g} ms RTT, {args.bandwidth_mbit:g} Mbit/s", args.bandwidth_mbit))
    results: dict[str, Any] = {
        **run_environment(), "repeats": args.repeats, "max_tokens": args.max_tokens, "levels": levels,
        "machine": f"{platform.machine()} {platform.system()}, Python {platform.python_version()}", "links": [],
    }  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        template = Path(tmp) / "chat.jinja"
        template.write_text(CHAT_TEMPLATE)
        for name, bandwidth in links:
            print(f"link {name}", file=sys.stderr)
            procs, urls = start_stack(args.rtt_ms, bandwidth, template)
            try:
                raw = asyncio.run(run_link(urls, args.repeats, args.max_tokens, levels))
            finally:
                _stop(procs)
            results["links"].append({"name": name, "bandwidth_mbit": bandwidth, "raw": raw,
                                     "summary": summarize(raw, levels)})  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "serve_bench.json").write_text(json.dumps(results, indent=1))
    (args.out / "serve_bench.md").write_text(markdown(results))
    plot(results, args.out)
    print(markdown(results))


if __name__ == "__main__":
    main()
