"""EAGLE drafting against the other drafters, over the split and an emulated WAN: the #27 matrix.

Processes on loopback: ``splitspec cloud serve`` (the target, float32, one thread) and one WAN
emulator (``splitspec netem``) per round-trip time; the edge runs in this process (one
:class:`~splitspec.edge.runtime.EdgeRuntime` per RTT over the same loaded weights, so every mode
decodes with the same edge). The target is a copy of the model whose config allows 4,096
positions (the demo models were trained to 1,024; rotary positions extend as they are), so the
long-context rows can run 2,000-token prompts; the head's target check does not count the
position limit.

Per RTT (20, 80, 150 ms), temperature (0 and 0.8) and prompt, each mode generates once per
repeat, modes interleaved and their order rotated each repeat. Each mode has a client of its own (its own
engine and sequence over the shared weights), warmed once per RTT: an EAGLE run leaves its sequence
recording features, and an engine's step-time estimates carry from run to run, so no mode starts from
the state another mode left:

* ``off`` (one token per trip), ``ngram``, ``prompt-lookup``, ``draft`` (the draft model),
  ``eagle`` (the draft head), ``auto`` (every drafter; the controller picks), and ``draft-chain``,
  ``eagle-chain``: the same drafters drafting a single chain (``--draft-tree-width 1``) instead of
  a tree, for the trees-against-chain ratio;
* prompts neither the model nor the shipped head saw in training: held-out documents the head's
  model card lists as kept out (``assets/corpus/heldout``: two code, one prose), cut to 96 tokens
  from a third of the way in, 64 tokens out (``--answer-tokens``);
* ``--long``: 2,000-token prompts (``--long-tokens``) of kept-out code and prose with 32- and 96-token answers;
  ``draft-whole`` (with ``--modes``) is ``draft`` with the draft model's config extended to 4,096 positions, so that
  it reads the whole context (as before stop 50) where the shipped one reads a window of its latest tokens past its
  256 positions.

Reported: decode tok/s (tokens after the first / time after the first), end-to-end tok/s, and
tokens per round trip after the prefill; medians over repeats, and each mode's ratio to ``off``
and the head's to the draft model (geometric mean over prompts). Writes ``eagle_matrix.json``,
``eagle_matrix.md`` and ``eagle_matrix.png``.

    python benchmarks/eagle_matrix.py [--repeats 3] [--rtts 20,80,150] [--long] [--model worker --draft-head DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from auto_floor import extended_copy  # the sibling benchmark (this directory is on sys.path when run)
from transformers import AutoTokenizer

from splitspec.decoding.loop import SpecStep
from splitspec.decoding.sampling import SamplingParams
from splitspec.demo import ASSETS, _spawn, _stop, _wait_for_port, embedded_model, free_port
from splitspec.edge import EdgeConfig, SplitClient
from splitspec.edge.runtime import EdgeRuntime
from splitspec.run_info import run_environment

MODES = ("off", "ngram", "prompt-lookup", "draft", "eagle", "auto", "draft-chain", "eagle-chain", "draft-whole")
DEFAULT_MODES = MODES[:-1]  # draft-whole: asked for by name
CHAIN_MODES = ("draft-chain", "eagle-chain")  # the drafter with --draft-tree-width 1: a single chain
PAIRS = (("eagle", "draft"), ("eagle", "eagle-chain"), ("draft", "draft-chain"), ("draft", "draft-whole"))
HELDOUT = ASSETS / "corpus" / "heldout"
SHORT_PROMPT_TOKENS = 96
SHORT_ANSWER_TOKENS = 64  # tokens out per short prompt (--answer-tokens)
LONG_PROMPT_TOKENS = 2000  # --long's prompts, tokens (--long-tokens)


def prompts(
    tokenizer: Any, long: bool, long_tokens: int = LONG_PROMPT_TOKENS, answer_tokens: int = SHORT_ANSWER_TOKENS
) -> list[tuple[str, list[int], int]]:
    """(label, prompt ids, answer tokens): held-out code and prose (``answer_tokens`` out), or long code prompts."""
    out: list[tuple[str, list[int], int]] = []
    if long:
        ids = tokenizer(
            (HELDOUT / "code" / "email._header_value_parser.txt").read_text(), add_special_tokens=False
        ).input_ids
        prose = tokenizer((HELDOUT / "prose" / "alls_well_that_ends_well.txt").read_text(), add_special_tokens=False)
        start = len(prose.input_ids) // 3  # mid-play, past the etext's header
        for answer in (32, 96):
            size = f"{long_tokens / 1000:g}k"
            out.append((f"code-{size}/{answer}", ids[:long_tokens], answer))
            out.append((f"prose-{size}/{answer}", prose.input_ids[start : start + long_tokens], answer))
        return out
    for domain, names in (("code", ("trace.txt", "pkgutil.txt")), ("prose", ("alls_well_that_ends_well.txt",))):
        for name in names:
            text = (HELDOUT / domain / name).read_text()
            ids = tokenizer(text, add_special_tokens=False).input_ids
            start = len(ids) // 3  # mid-document: past the licence header
            out.append(
                (f"{domain}:{name.removesuffix('.txt')}", ids[start : start + SHORT_PROMPT_TOKENS], answer_tokens)
            )
    return out


async def one(
    client: SplitClient, prompt: list[int], answer: int, mode: str, temperature: float, seed: int
) -> dict[str, Any]:
    params = SamplingParams(temperature=temperature, seed=seed) if temperature > 0 else SamplingParams()
    first_step = len(client.steps)
    t0 = time.perf_counter()
    first = None
    tokens = 0
    trace: list[SpecStep] = []
    async for _ in client.stream(prompt, answer, params, stop_token_ids=(), speculate=mode, trace=trace):
        tokens += 1
        if first is None:
            first = time.perf_counter()
    end = time.perf_counter()
    steps = client.steps[first_step:]
    trips = sum(1 for s in steps if s.kind == "decode")
    assert first is not None
    return {
        "tokens": tokens,
        "decode_tok_s": (tokens - 1) / (end - first) if tokens > 1 else float("nan"),
        "e2e_tok_s": tokens / (end - t0),
        "tokens_per_trip": (tokens - 1) / trips if trips else float("nan"),
        "ttft_s": first - t0,
        # the steps each drafter made (auto: which it chose), and its drafting time per step, ms
        "drafted_by": dict(Counter(s.drafter or "none" for s in trace)),
        "draft_ms_per_step": 1e3 * sum(s.draft_s for s in trace) / max(1, len(trace)),
        # the drafted steps' tree sizes (the controller's budgets) and accepted tokens, means
        "draft_tokens_mean": statistics.fmean([s.draft_tokens for s in trace if s.drafter] or [0]),
        "accepted_mean": statistics.fmean([s.accepted for s in trace if s.drafter] or [0]),
    }


def geomean(values: list[float]) -> float:
    good = [v for v in values if v > 0 and math.isfinite(v)]
    return math.exp(sum(map(math.log, good)) / len(good)) if good else float("nan")


async def run_matrix(
    args: argparse.Namespace, target: Path, links: dict[int, int]
) -> tuple[list[dict[str, Any]], EdgeRuntime]:
    tokenizer = AutoTokenizer.from_pretrained(target, local_files_only=True)
    base = EdgeConfig(
        model_dir=target, cloud_url="ws://unused", draft_model_dir=args.draft_model, draft_head_dir=args.draft_head,
        allow_stock_edge_weights=True, dtype="float32", edge_layers=args.edge_layers,
    )  # fmt: skip
    loaded = EdgeRuntime(base)  # weights loaded once; each RTT's runtime shares them
    whole = None  # draft-whole: the draft model reading whole contexts (its config extended to 4,096 positions)
    if "draft-whole" in args.modes:
        whole = EdgeRuntime(dataclasses.replace(base, draft_model_dir=args.whole_draft_model), loaded.model)
    rows: list[dict[str, Any]] = []
    cases = prompts(tokenizer, args.long, args.long_tokens, args.answer_tokens)
    modes = [m for m in MODES if m in args.modes]
    for rtt, port in links.items():
        config = dataclasses.replace(base, cloud_url=f"ws://127.0.0.1:{port}")
        runtime = EdgeRuntime(config, loaded.model, loaded.draft_model)
        chains = dataclasses.replace(config, draft_tree_width=1)
        chain_runtime = EdgeRuntime(chains, loaded.model, loaded.draft_model)
        whole_config, whole_runtime = config, runtime  # unless draft-whole runs
        if whole is not None:
            whole_config = dataclasses.replace(config, draft_model_dir=args.whole_draft_model)
            whole_runtime = EdgeRuntime(whole_config, loaded.model, whole.draft_model)
        async with contextlib.AsyncExitStack() as stack:
            # a client (its own engine and sequence) per mode, over the runtimes' shared weights: a sequence keeps
            # recording features once an EAGLE run turned them on, and an engine's step-time estimates carry from
            # run to run, so a client shared by the modes would start each mode from the state the last one left
            clients: dict[str, SplitClient] = {}
            for mode in modes:
                if mode.startswith("eagle") and runtime.draft_head is None:
                    continue
                if mode in CHAIN_MODES:
                    mine, mine_runtime = chains, chain_runtime
                elif mode == "draft-whole":
                    mine, mine_runtime = whole_config, whole_runtime
                else:
                    mine, mine_runtime = config, runtime
                client = await stack.enter_async_context(SplitClient(mine, runtime=mine_runtime))
                await client.generate(cases[0][1][:16], 4, SamplingParams(), speculate="off")  # warm the link
                clients[mode] = client
            for repeat in range(args.repeats):
                for temperature in args.temperatures:
                    for label, prompt, answer in cases:
                        order = modes[repeat % len(modes) :] + modes[: repeat % len(modes)]
                        for mode in order:
                            if mode not in clients:  # eagle without a head
                                continue
                            seed = 1000 * repeat + 7
                            speculate = mode.removesuffix("-chain").removesuffix("-whole")
                            row = await one(clients[mode], prompt, answer, speculate, temperature, seed)
                            row |= {"rtt_ms": rtt, "temperature": temperature, "prompt": label, "mode": mode,
                                    "repeat": repeat, "answer": answer}  # fmt: skip
                            rows.append(row)
                            print(json.dumps(row), flush=True)
    return rows, loaded


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    keys = sorted({(r["rtt_ms"], r["temperature"], r["prompt"], r["mode"]) for r in rows})
    cells: dict[str, dict[str, float]] = {}
    for rtt, temp, prompt, mode in keys:
        mine = [r for r in rows if (r["rtt_ms"], r["temperature"], r["prompt"], r["mode"]) == (rtt, temp, prompt, mode)]
        cells[f"{rtt}|{temp}|{prompt}|{mode}"] = {
            k: statistics.median(r[k] for r in mine) for k in ("decode_tok_s", "e2e_tok_s", "tokens_per_trip")
        }
    ratios: dict[str, dict[str, float]] = {}
    for rtt, temp in sorted({(k[0], k[1]) for k in keys}):
        labels = sorted({k[2] for k in keys if k[:2] == (rtt, temp)})
        out: dict[str, float] = {}
        for mode in MODES:
            vs_off = [
                cells[f"{rtt}|{temp}|{p}|{mode}"]["decode_tok_s"] / cells[f"{rtt}|{temp}|{p}|off"]["decode_tok_s"]
                for p in labels
                if f"{rtt}|{temp}|{p}|{mode}" in cells
            ]
            out[f"{mode}/off"] = geomean(vs_off)
        for top, bottom in PAIRS:
            if all(f"{rtt}|{temp}|{p}|{m}" in cells for p in labels for m in (top, bottom)):
                out[f"{top}/{bottom}"] = geomean(
                    [
                        cells[f"{rtt}|{temp}|{p}|{top}"]["decode_tok_s"]
                        / cells[f"{rtt}|{temp}|{p}|{bottom}"]["decode_tok_s"]
                        for p in labels
                    ]
                )
        ratios[f"{rtt}|{temp}"] = out
    choices: dict[str, dict[str, int]] = {}  # what auto chose, steps per drafter, by RTT and temperature
    for r in rows:
        if r["mode"] == "auto":
            counts = choices.setdefault(f"{r['rtt_ms']}|{r['temperature']}", {})
            for drafter, n in r["drafted_by"].items():
                counts[drafter] = counts.get(drafter, 0) + n
    return {"cells": cells, "ratios": ratios, "auto_choices": choices}


def markdown(results: dict[str, Any]) -> str:
    lines = [
        f"# EAGLE matrix ({results['model']}, commit {results['commit'][:10]}, {results['repeats']} repeats)",
        "",
        "Decode tok/s (median) / tokens per round trip; ratios: geometric means over prompts.",
        "",
        "| RTT ms | temp | prompt | " + " | ".join(MODES) + " |",
        "|---|---|---|" + "---|" * len(MODES),
    ]
    cells = results["summary"]["cells"]
    for key in sorted({k.rsplit("|", 1)[0] for k in cells}, key=lambda k: (float(k.split("|")[0]), k)):
        rtt, temp, prompt = key.split("|")
        row = []
        for mode in MODES:
            cell = cells.get(f"{key}|{mode}")
            row.append("-" if cell is None else f"{cell['decode_tok_s']:.1f} / {cell['tokens_per_trip']:.2f}")
        lines.append(f"| {rtt} | {temp} | {prompt} | " + " | ".join(row) + " |")
    pairs = [f"{a}/{b}" for a, b in PAIRS]
    lines += ["", "| RTT ms | temp | " + " | ".join([*(f"{m}/off" for m in MODES), *pairs]) + " |",
              "|---|---|" + "---|" * (len(MODES) + len(pairs))]  # fmt: skip
    for key, out in sorted(results["summary"]["ratios"].items(), key=lambda kv: float(kv[0].split("|")[0])):
        rtt, temp = key.split("|")
        values = [f"{out.get(f'{m}/off', float('nan')):.2f}" for m in MODES] + [
            f"{out.get(p, float('nan')):.2f}" for p in pairs
        ]
        lines.append(f"| {rtt} | {temp} | " + " | ".join(values) + " |")
    lines += ["", "What `auto` chose (decode steps per drafter, all prompts and repeats):", ""]
    for key, counts in sorted(results["summary"]["auto_choices"].items(), key=lambda kv: float(kv[0].split("|")[0])):
        rtt, temp = key.split("|")
        lines.append(f"- {rtt} ms, temperature {temp}: " + ", ".join(f"{d} {n}" for d, n in sorted(counts.items())))
    head = results.get("head")
    if head:
        lines += ["", f"Draft head: {head['parameters']:,} parameters, {head['bytes'] / 2**20:.2f} MiB; "
                  f"draft model: {results['draft_model']['parameters']:,} parameters, "
                  f"{results['draft_model']['bytes'] / 2**20:.2f} MiB (edge memory of the weights)."]  # fmt: skip
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ratios = results["summary"]["ratios"]
    temps = sorted({k.split("|")[1] for k in ratios})
    fig, axes = plt.subplots(1, len(temps), figsize=(5 * len(temps), 3.5), squeeze=False)
    for ax, temp in zip(axes[0], temps, strict=True):
        rtts = sorted({float(k.split("|")[0]) for k in ratios if k.split("|")[1] == temp})
        for mode in MODES[1:]:
            ys = [ratios[f"{int(r) if r.is_integer() else r}|{temp}"].get(f"{mode}/off", float("nan")) for r in rtts]
            ax.plot(rtts, ys, marker="o", label=mode)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_title(f"temperature {temp}")
        ax.set_xlabel("RTT, ms")
        ax.set_ylabel("decode tok/s / off (geomean)")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def weights(module: torch.nn.Module) -> dict[str, int]:
    return {"parameters": sum(p.numel() for p in module.parameters()),
            "bytes": sum(p.numel() * p.element_size() for p in module.parameters())}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rtts", default="20,80,150", help="round-trip times, ms, comma-separated")
    parser.add_argument("--temperatures", default="0,0.8", help="comma-separated (0 = greedy)")
    parser.add_argument(
        "--modes",
        default=",".join(DEFAULT_MODES),
        help="comma-separated subset of " + ", ".join(MODES) + " (off always runs)",
    )
    parser.add_argument("--long", action="store_true", help="2,000-token prompts, 32- and 96-token answers")
    parser.add_argument("--long-tokens", type=int, default=LONG_PROMPT_TOKENS, help="--long's prompt tokens")
    parser.add_argument(
        "--answer-tokens",
        type=int,
        default=SHORT_ANSWER_TOKENS,
        help=f"tokens out per held-out prompt (default {SHORT_ANSWER_TOKENS}; --long's answers are 32 and 96)",
    )
    parser.add_argument("--model", default="base", help="embedded model name or a directory (default base)")
    parser.add_argument("--draft-model", type=Path, default=None, help="default: the embedded draft model")
    parser.add_argument("--draft-head", type=Path, default=None, help="default: the embedded base model's head")
    parser.add_argument("--edge-layers", default="2,2", help="HEAD,TAIL edge layers (default 2,2; worker: 1,1)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/eagle"))
    args = parser.parse_args()
    args.temperatures = [float(t) for t in args.temperatures.split(",")]
    args.modes = args.modes.split(",")
    unknown = sorted(set(args.modes) - set(MODES))
    if unknown:
        parser.error(f"--modes: unknown {', '.join(unknown)} (choose from {', '.join(MODES)})")
    if args.answer_tokens < 2:
        parser.error(f"--answer-tokens must be at least 2 (a decode rate needs two), got {args.answer_tokens}")
    if "off" not in args.modes:
        args.modes.append("off")  # every ratio in the report is against off
    edge_layers_text = args.edge_layers
    args.edge_layers = tuple(int(n) for n in edge_layers_text.split(","))
    model = Path(args.model) if Path(args.model).is_dir() else embedded_model(args.model)
    args.draft_model = args.draft_model or embedded_model("draft")
    if args.draft_head is None and args.model == "base":
        args.draft_head = embedded_model("base-eagle")
    rtts = [int(r) for r in args.rtts.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        target = extended_copy(model, Path(tmp) / "target")
        args.whole_draft_model = extended_copy(args.draft_model, Path(tmp) / "draft-whole")
        trunk_port = free_port()
        procs = [_spawn(["cloud", "serve", "--model", str(target), "--port", str(trunk_port), "--threads", "1",
                         "--dtype", "float32", "--edge-layers", edge_layers_text])]  # fmt: skip
        try:
            _wait_for_port(trunk_port, procs[0], 120)
            links: dict[int, int] = {}
            for rtt in rtts:
                links[rtt] = free_port()
                procs.append(_spawn(["netem", "--listen", f"127.0.0.1:{links[rtt]}", "--upstream",
                                     f"127.0.0.1:{trunk_port}", "--rtt-ms", str(rtt)]))  # fmt: skip
                _wait_for_port(links[rtt], procs[-1], 60)
            torch.set_num_threads(1)
            rows, probe = asyncio.run(run_matrix(args, target, links))
        finally:
            _stop(procs)
    env = run_environment()
    results: dict[str, Any] = {
        "commit": env.get("commit", ""), "environment": env, "model": args.model, "repeats": args.repeats,
        "long": args.long, "rows": rows, "summary": summarise(rows),
        "head": None if probe.draft_head is None else weights(probe.draft_head),
        "draft_model": None if probe.draft_model is None else weights(probe.draft_model),
    }  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "eagle_matrix_long" if args.long else "eagle_matrix"
    (args.out / f"{stem}.json").write_text(json.dumps(results, indent=2))
    (args.out / f"{stem}.md").write_text(markdown(results) + "\n")
    plot(results, args.out / f"{stem}.png")
    print(markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
