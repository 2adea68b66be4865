"""Prompt-logprob (``echo``) throughput through ``splitspec serve`` and the WAN emulator.

Processes on loopback, as ``structured_bench.py`` has them: a trunk server, the WAN emulator
(80 ms RTT) and ``splitspec serve`` on the demo models. Each request is a 1,000-token prompt (token
ids from the held-out prose corpus, a different window for every request so no cached prefix is
reused; ``--prefix-cache-size 1``, so every request, echo or not, recycles the one idle session
rather than opening a new cloud session) to ``/v1/completions``, in three modes, interleaved (the
order turns every repeat):

- ``prefill``: ``max_tokens`` 1, no logprobs: what the prompt's prefill costs anyway;
- ``echo``: ``echo`` with ``logprobs`` 1 and ``max_tokens`` 0 (lm-evaluation-harness's
  loglikelihood request, less its one generated token): every prompt token's logprob;
- ``echo-top5``: the same with 5 alternatives per token.

Prompt tokens per second = 1,000 / the request's wall time (client side). Each echo answer is
checked: 1,000 entries, the first ``null``, the two echo modes' logprobs equal to 1e-4. Apart, in
this process: the edge's own cost of turning 1,000 prefill rows (demo vocabulary) into logprobs
(:func:`~splitspec.decoding.loop.prompt_token_logprobs`, chunks of 256 rows), ms.

    python benchmarks/echo_logprobs_bench.py [--repeats 3] [--tokens 1000] [--out benchmarks/results/echo_logprobs]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import torch
from transformers import AutoTokenizer

from splitspec.decoding.loop import prompt_token_logprobs
from splitspec.demo import ASSETS, _spawn, _stop, _wait_for_port, embedded_model, free_port
from splitspec.run_info import run_environment

MODES: dict[str, dict[str, Any]] = {
    "prefill": {"max_tokens": 1},
    "echo": {"max_tokens": 0, "echo": True, "logprobs": 1},
    "echo-top5": {"max_tokens": 0, "echo": True, "logprobs": 5},
}


def corpus_ids(tokens: int, windows: int) -> list[list[int]]:
    """``windows`` disjoint prompts of ``tokens`` ids from the held-out prose (demo tokenizer)."""
    tokenizer = AutoTokenizer.from_pretrained(embedded_model("base"), local_files_only=True)
    text = "".join(p.read_text() for p in sorted((ASSETS / "corpus" / "heldout" / "prose").glob("*.txt")))
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) < tokens * windows:
        raise SystemExit(f"the corpus has {len(ids)} tokens, {tokens * windows} needed")
    return [ids[i * tokens : (i + 1) * tokens] for i in range(windows)]


def one(http: httpx.Client, base: str, prompt: list[int], mode: str) -> dict[str, Any]:
    body = {"model": "demo", "prompt": prompt, "temperature": 0, **MODES[mode]}
    t0 = time.perf_counter()
    reply = http.post(f"{base}/v1/completions", json=body)
    wall = time.perf_counter() - t0
    reply.raise_for_status()
    out = reply.json()
    choice = out["choices"][0]
    row: dict[str, Any] = {"mode": mode, "wall_s": wall, "prompt_tokens": out["usage"]["prompt_tokens"],
                           "cached_tokens": out["usage"]["prompt_tokens_details"]["cached_tokens"],
                           "prompt_tok_s": len(prompt) / wall}  # fmt: skip
    if choice["logprobs"] is not None:
        lps = choice["logprobs"]["token_logprobs"]
        if len(lps) != len(prompt) or lps[0] is not None or any(v is None for v in lps[1:]):
            raise SystemExit(f"{mode}: {len(lps)} logprobs for {len(prompt)} prompt tokens")
        row["token_logprobs"] = lps
    return row


def run(base: str, prompts: list[list[int]], repeats: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    names = list(MODES)
    with httpx.Client(timeout=600) as http:
        for mode in names:  # warm up: connections, the token-bytes table
            one(http, base, prompts[0][:64], mode)
        k = 1
        for rep in range(repeats):
            order = names[rep % len(names) :] + names[: rep % len(names)]
            by_mode = {}
            for mode in order:
                by_mode[mode] = {**one(http, base, prompts[k], mode), "repeat": rep}
                k += 1
                print(f"  repeat {rep} {mode}: {by_mode[mode]['prompt_tok_s']:.0f} prompt tok/s", file=sys.stderr)
            rows += by_mode.values()
    return rows


def check_echo_modes(base: str, prompt: list[int]) -> float:
    """Largest difference between the two echo modes' logprobs on one prompt (must be <= 1e-4)."""
    with httpx.Client(timeout=600) as http:
        a, b = one(http, base, prompt, "echo"), one(http, base, prompt, "echo-top5")
    diff = max(abs(x - y) for x, y in zip(a["token_logprobs"][1:], b["token_logprobs"][1:], strict=True))
    if diff > 1e-4:
        raise SystemExit(f"echo modes disagree by {diff}")
    return float(diff)


def edge_cost(tokens: int, repeats: int) -> dict[str, float]:
    """Median ms to turn ``tokens`` prefill rows (demo vocabulary) into prompt logprobs, per top-k."""
    vocab = int(AutoTokenizer.from_pretrained(embedded_model("base"), local_files_only=True).vocab_size)
    logits = torch.randn(tokens, vocab, generator=torch.Generator().manual_seed(0))  # (P, V)
    ids = torch.randint(vocab, (tokens,), generator=torch.Generator().manual_seed(1)).tolist()
    out = {}
    for top in (1, 5):
        times = []
        for _ in range(max(3, repeats)):
            t0 = time.perf_counter()
            prompt_token_logprobs(logits, ids, top)
            times.append((time.perf_counter() - t0) * 1000)
        out[f"top{top}_ms"] = statistics.median(times)
    return out


def markdown(results: dict[str, Any]) -> str:
    s = results["summary"]
    return "\n".join([
        f"# Prompt logprobs (echo) through splitspec serve ({results['rtt_ms']:.0f} ms RTT, demo models)",
        "",
        f"Commit `{results['commit'][:12]}`, {results['repeats']} interleaved repeats, {results['tokens']}-token "
        "prompts (a fresh corpus window per request, `--prefix-cache-size 1`: every request recycles the idle "
        "session), medians. "
        "Reproduce: `python benchmarks/echo_logprobs_bench.py`.",
        "",
        "| mode | request | prompt tok/s | wall s |",
        "|---|---|---|---|",
        *[f"| {m} | `{json.dumps(MODES[m])}` | {s[m]['prompt_tok_s']:.0f} | {s[m]['wall_s']:.3f} |" for m in MODES],
        "",
        f"Echo logprobs agree across modes to {results['echo_modes_max_diff']:.1e}; every echo answer had "
        f"{results['tokens']} entries, the first null.",
        "",
        f"The edge's own cost of {results['tokens']} rows -> logprobs (demo vocabulary, chunks of 256 rows, one "
        f"thread): {results['edge']['top1_ms']:.1f} ms with 1 alternative, {results['edge']['top5_ms']:.1f} ms "
        "with 5 (median).",
    ])  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--rtt-ms", type=float, default=80.0)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/echo_logprobs"))
    args = parser.parse_args()
    prompts = corpus_ids(args.tokens, 1 + args.repeats * len(MODES) + 1)
    base_model, draft = embedded_model("base"), embedded_model("draft")
    trunk_port, link_port, port = free_port(), free_port(), free_port()
    # float32 at both ends whatever the CPU: under --dtype auto a CPU with AVX512-FP16 computes the float16 demo
    # models in float16, where identical echo requests right after others differed by up to 7e-3 (within a second
    # of decode traffic a prefill's chunks are sized from measured times, and a float16 product's rounding depends
    # on its row count), beyond the check's 1e-4
    procs = [_spawn(["cloud", "serve", "--model", str(base_model), "--port", str(trunk_port), "--threads", "1",
                     "--dtype", "float32"])]  # fmt: skip
    try:
        _wait_for_port(trunk_port, procs[0], 120)
        procs.append(_spawn(["netem", "--listen", f"127.0.0.1:{link_port}", "--upstream",
                             f"127.0.0.1:{trunk_port}", "--rtt-ms", str(args.rtt_ms)]))  # fmt: skip
        _wait_for_port(link_port, procs[1], 60)
        procs.append(_spawn(["serve", "--model", str(base_model), "--draft-model", str(draft), "--cloud",
                             f"ws://127.0.0.1:{link_port}", "--served-model-name", "demo", "--port", str(port),
                             "--threads", "1", "--allow-stock-edge-weights", "--prefix-cache-size", "1",
                             "--dtype", "float32"]))  # fmt: skip
        _wait_for_port(port, procs[-1], 120)
        base = f"http://127.0.0.1:{port}"
        rows = run(base, prompts, args.repeats)
        diff = check_echo_modes(base, prompts[-1])
    finally:
        _stop(procs)
    edge = edge_cost(args.tokens, args.repeats)
    summary = {m: {k: statistics.median(r[k] for r in rows if r["mode"] == m) for k in ("prompt_tok_s", "wall_s")}
               for m in MODES}  # fmt: skip
    for row in rows:
        row.pop("token_logprobs", None)
    env = run_environment()
    results = {"commit": env.get("commit", ""), "repeats": args.repeats, "tokens": args.tokens,
               "rtt_ms": args.rtt_ms, "platform": platform.platform(), "environment": env, "rows": rows,
               "summary": summary, "echo_modes_max_diff": diff, "edge": edge}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "echo_logprobs_bench.json").write_text(json.dumps(results, indent=2))
    (args.out / "echo_logprobs_bench.md").write_text(markdown(results) + "\n")
    print(markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
