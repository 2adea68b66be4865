"""SpecFed end to end through the WAN emulator: tok/s, uplink bytes, and the drift bound.

Two SpecFed workers run in this process on loopback, each behind its own
:class:`~splitspec.netem.emulator.WanEmulator` (added RTT per link, optional per-direction rate
limit): by default the demo ``base`` model and the code-heavy demo ``worker`` model (``draft``
when ``worker`` is not there), equal weights. The coordinator drafts with the demo ``draft``
model (γ = 4) and samples at T = 1 with a fixed seed per prompt; prompts are the openings of
held-out documents (prose and code), ~32 new tokens each.

Compression modes, each run on every prompt and link:

* ``full``: K = |V| (every worker sends its whole distribution, float16 values);
* ``k1pct_f16``: fixed K = 1 % of |V| with float16 values (what the value quantization buys);
* ``k1pct``: fixed K = 1 % of |V|, quantized values (the default codec);
* ``adaptive``: adaptive K with target ε = ``--target-epsilon`` at every position;
* ``adaptive_round_mean_eps``: adaptive K per round whose target is the *mean* ε that ``k1pct``
  left on the same prompts: the fewest tokens whose mean ε over the round is at most that
  (``--epsilon-scope round``), i.e. the same average error as fixed K;
* ``adaptive_pos_mean_eps``: every position held to that mean ε (``--epsilon-scope position``):
  flat positions then need many tokens, so this one costs more than fixed K;
* ``adaptive_pos_max_eps``: every position held to the *largest* ε that ``k1pct`` left, i.e. the
  same worst-case guarantee (the per-position bounds are stated in ε, so this is the guarantee a
  fixed K actually gives).

Adaptive targets are residual masses τ (1 − Σ top-K, the paper's ε): the matched modes take the
mean / largest residual that ``k1pct`` received. ε is what the workers report: ‖p − p̃‖₁, the tail
mass plus the quantization error. Sampling makes every mode follow its own trajectory, so matched
targets are matched over different positions; ``benchmarks/specfed_eval.py`` compares the
adaptive rules with fixed K on identical positions.

Uplink = worker → coordinator (the FedScores replies): whole frames as the coordinator received
them, the top-K payload inside them, and the TCP bytes the emulator forwarded (which add the
handshake and websocket framing). "Dense float16" is 2·|V| bytes per position.

Audit: every mode is run again at the first RTT with ``audit`` on (workers also send their full
laws, so these runs are not timed); per drafted position the coordinator checks the measured
acceptance-rate drift |α − α̂| against Σ w_i ε_i (exact ε = ‖p_i − p̃_i‖₁, quantization included)
and against ½Δ.

Writes ``specfed_wan.json``, ``specfed_wan.md`` and ``specfed_wan.png`` to
``benchmarks/results/specfed_wan/``. Medians are over prompts.

    python benchmarks/specfed_wan.py                      # ~2 minutes on one core
    python benchmarks/specfed_wan.py --prompts 1 --new-tokens 8 --rtt-ms 20 --out /tmp/x   # smoke
    python benchmarks/specfed_wan.py --plot-only
    python benchmarks/specfed_wan.py --bandwidth-mbps 20 --no-audit --out benchmarks/results/specfed_wan_20mbit
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from splitspec.decoding.sampling import SamplingParams
from splitspec.federated.config import CoordinatorConfig
from splitspec.federated.coordinator import Coordinator
from splitspec.federated.lm import LoadedModel, load_model
from splitspec.federated.records import FedResult
from splitspec.federated.worker import FedWorker, WorkerConfig
from splitspec.netem.emulator import WanEmulator
from splitspec.netem.schedule import NetemConfig
from splitspec.paths import display_path
from splitspec.run_info import run_environment

log = logging.getLogger("specfed_wan")

REPO = Path(__file__).resolve().parents[1]
ASSETS = REPO / "src" / "splitspec" / "assets"
MODELS = ASSETS / "models"
TARGET_RATIO = 0.01  # uplink bytes per position per worker <= 1/100 of dense float16
TOLERANCE = 1e-5  # float slack on the drift checks
# (domain, file, character offset: the prompt starts at the line after it)
PROMPT_SOURCES = (
    ("prose", "alls_well_that_ends_well.txt", 10_000),
    ("code", "pkgutil.txt", 0),
    ("prose", None, 2_000),  # None: the first document of the domain (sorted) not used yet
    ("code", None, 2_000),
    ("prose", None, 2_000),
    ("code", None, 1_000),
)


def default_workers() -> list[Path]:
    worker = MODELS / "worker"
    second = worker if (worker / "model.safetensors").is_file() else MODELS / "draft"
    return [MODELS / "base", second]


def load_prompts(tokenizer: Any, n: int, length: int) -> list[tuple[str, list[int]]]:
    """``n`` prompts of ``length`` tokens (``<|bos|>`` included) from held-out documents."""
    out: list[tuple[str, list[int]]] = []
    used: set[str] = set()
    for domain, name, offset in PROMPT_SOURCES[:n]:
        folder = ASSETS / "corpus" / "heldout" / domain
        path = folder / name if name else next(p for p in sorted(folder.glob("*.txt")) if p.name not in used)
        used.add(path.name)
        text = path.read_text(encoding="utf-8")
        offset = min(offset, len(text) // 2)  # short documents: start half-way
        if offset:
            text = text[text.index("\n", offset) + 1 :]
        ids = list(tokenizer.encode(text))[:length]
        out.append((f"{domain}/{path.stem}", ids))
    return out


def modes(vocab: int, target_epsilon: float) -> list[dict[str, Any]]:
    k1 = max(1, round(0.01 * vocab))
    fixed: dict[str, Any] = {"target_epsilon": None, "scope": "position"}
    adaptive: dict[str, Any] = {"top_k": None, "codec": "quantized"}
    return [
        {"mode": "full", "top_k": vocab, "codec": "float16", **fixed},
        {"mode": "k1pct_f16", "top_k": k1, "codec": "float16", **fixed},
        {"mode": "k1pct", "top_k": k1, "codec": "quantized", **fixed},
        {"mode": "adaptive", "target_epsilon": target_epsilon, "scope": "position", **adaptive},
        # target ε filled in from the k1pct runs at the same RTT (mean / max of their per-position ε)
        {
            "mode": "adaptive_round_mean_eps",
            "target_epsilon": None,
            "scope": "round",
            "match": "mean_residual",
            **adaptive,
        },
        {
            "mode": "adaptive_pos_mean_eps",
            "target_epsilon": None,
            "scope": "position",
            "match": "mean_residual",
            **adaptive,
        },
        {
            "mode": "adaptive_pos_max_eps",
            "target_epsilon": None,
            "scope": "position",
            "match": "max_residual",
            **adaptive,
        },
    ]


def summarize(result: FedResult, wall_s: float, urls: Sequence[str], vocab: int) -> dict[str, Any]:
    """Per-generation figures (one prompt, one mode, one link)."""
    rounds = result.rounds
    tokens = len(result.token_ids)
    per_worker: dict[str, dict[str, float]] = {}
    for i, url in enumerate(urls):
        recs = [w for r in rounds for w in r.workers if w.url == url and w.status in ("ok", "rejoined")]
        positions = sum(len(w.k) for w in recs)
        up = sum(w.bytes_down for w in recs)  # the worker's uplink is the coordinator's downlink
        payload = sum(w.payload_bytes for w in recs)
        per_worker[f"w{i}"] = {
            "positions": positions,
            "uplink_bytes": up,
            "frame_bytes_per_position": up / positions if positions else float("nan"),
            "payload_bytes_per_position": payload / positions if positions else float("nan"),
            "mean_k": statistics.fmean([k for w in recs for k in w.k]) if recs else float("nan"),
            "mean_epsilon": statistics.fmean([e for w in recs for e in w.epsilon]) if recs else float("nan"),
            "max_epsilon": max((e for w in recs for e in w.epsilon), default=float("nan")),
            "mean_residual": statistics.fmean([e for w in recs for e in w.residual]) if recs else float("nan"),
            "max_residual": max((e for w in recs for e in w.residual), default=float("nan")),
            "rounds_missed": sum(1 for r in rounds for w in r.workers if w.url == url and w.status != "ok"),
        }
    drafted = sum(r.drafted for r in rounds)
    accepted = sum(r.accepted for r in rounds)
    uplink = sum(v["uplink_bytes"] for v in per_worker.values())
    out: dict[str, Any] = {
        "tokens": tokens,
        "rounds": len(rounds),
        "wall_s": wall_s,
        "tok_per_s": tokens / wall_s if wall_s > 0 else float("nan"),
        "acceptance": accepted / drafted if drafted else float("nan"),
        "tokens_per_round": tokens / len(rounds) if rounds else float("nan"),
        "uplink_bytes_per_token": uplink / tokens if tokens else float("nan"),
        "mean_weighted_epsilon": statistics.fmean([e for r in rounds for e in r.weighted_epsilon]),
        "median_round_ms": statistics.median([r.round_ms for r in rounds]),
        "workers": per_worker,
    }
    audits = [r.audit for r in rounds if r.audit is not None]
    if audits:
        drift = [d for a in audits for d in a.drift]
        weps = [e for a in audits for e in a.weighted_epsilon[: len(a.drift)]]
        half_delta = [0.5 * d for a in audits for d in a.delta[: len(a.drift)]]
        out["audit"] = {
            "positions": len(drift),
            "drift": drift,
            "weighted_epsilon": weps,
            "half_delta": half_delta,
            "drift_over_weps": sum(1 for d, e in zip(drift, weps, strict=True) if d > e + TOLERANCE),
            "drift_over_half_delta": sum(1 for d, b in zip(drift, half_delta, strict=True) if d > b + TOLERANCE),
            "coordinator_violations": sum(len(a.violations) for a in audits),
        }
    return out


async def run_mode(
    urls: list[str],
    draft: LoadedModel,
    mode: dict[str, Any],
    prompts: list[tuple[str, list[int]]],
    args: argparse.Namespace,
    audit: bool,
) -> list[dict[str, Any]]:
    config = CoordinatorConfig(
        draft_dir=args.draft,
        worker_urls=tuple(urls),
        top_k=mode["top_k"],
        target_epsilon=mode["target_epsilon"],
        epsilon_scope=mode["scope"],
        prob_codec=mode["codec"],
        max_k=draft.vocab_size,
        reconstruct=args.reconstruct,
        gamma=args.gamma,
        audit=audit,
        round_timeout_s=60.0,
    )
    out = []
    async with Coordinator(config, draft) as coordinator:
        for i, (name, ids) in enumerate(prompts):
            params = SamplingParams(temperature=args.temperature, seed=args.seed + i)
            t0 = time.perf_counter()
            result = await coordinator.generate(ids, args.new_tokens, params)
            wall = time.perf_counter() - t0
            row = summarize(result, wall, urls, draft.vocab_size)
            row["prompt"] = name
            row["seed"] = result.seed
            out.append(row)
    return out


def median(rows: list[dict[str, Any]], *keys: str) -> float:
    values = []
    for r in rows:
        v: Any = r
        for k in keys:
            v = v[k]
        values.append(float(v))
    return statistics.median(values)


def aggregate_rows(rows: list[dict[str, Any]], n_workers: int, vocab: int) -> dict[str, Any]:
    dense16 = 2 * vocab
    agg: dict[str, Any] = {
        "tok_per_s": median(rows, "tok_per_s"),
        "acceptance": median(rows, "acceptance"),
        "tokens_per_round": median(rows, "tokens_per_round"),
        "median_round_ms": median(rows, "median_round_ms"),
        "uplink_bytes_per_token": median(rows, "uplink_bytes_per_token"),
        "mean_weighted_epsilon": median(rows, "mean_weighted_epsilon"),
        "workers": {},
    }
    for w in range(n_workers):
        key = f"w{w}"
        frame = median(rows, "workers", key, "frame_bytes_per_position")
        payload = median(rows, "workers", key, "payload_bytes_per_position")
        agg["workers"][key] = {
            "frame_bytes_per_position": frame,
            "payload_bytes_per_position": payload,
            "frame_ratio_to_dense_f16": frame / dense16,
            "payload_ratio_to_dense_f16": payload / dense16,
            "mean_k": median(rows, "workers", key, "mean_k"),
            "mean_epsilon": median(rows, "workers", key, "mean_epsilon"),
            "max_epsilon": max(r["workers"][key]["max_epsilon"] for r in rows),
            "mean_residual": median(rows, "workers", key, "mean_residual"),
        }
    agg["max_frame_ratio_to_dense_f16"] = max(v["frame_ratio_to_dense_f16"] for v in agg["workers"].values())
    agg["max_payload_ratio_to_dense_f16"] = max(v["payload_ratio_to_dense_f16"] for v in agg["workers"].values())
    return agg


async def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    worker_models = [load_model(d) for d in args.worker]
    draft = load_model(args.draft)
    vocab = draft.vocab_size
    if {m.tokenizer_fingerprint for m in [*worker_models, draft]} != {draft.tokenizer_fingerprint}:
        raise SystemExit("the workers and the drafter must share one tokenizer")
    prompts = load_prompts(draft.tokenizer, args.prompts, args.prompt_tokens)
    mode_list = modes(vocab, args.target_epsilon)
    bandwidth = args.bandwidth_mbps * 1e6 if args.bandwidth_mbps > 0 else None
    log.info("|V| = %d, workers %s, drafter %s, %d prompts", vocab, args.worker, args.draft, len(prompts))
    runs: list[dict[str, Any]] = []
    audits: list[dict[str, Any]] = []
    emulator_bytes: dict[str, Any] = {}
    t_start = time.perf_counter()
    async with contextlib.AsyncExitStack() as stack:
        workers = [
            await stack.enter_async_context(FedWorker(WorkerConfig(model_dir=d, port=0), m))
            for d, m in zip(args.worker, worker_models, strict=True)
        ]
        for rtt in args.rtt_ms:
            async with contextlib.AsyncExitStack() as links:
                emus = [
                    await links.enter_async_context(
                        WanEmulator(NetemConfig(upstream_port=w.port, rtt_ms=rtt, bandwidth_bps=bandwidth, seed=i))
                    )
                    for i, w in enumerate(workers)
                ]
                urls = [f"ws://{e.host}:{e.port}" for e in emus]
                for mode in mode_list:
                    if "match" in mode and mode["target_epsilon"] is None:
                        k1 = [r for r in runs if r["mode"] == "k1pct" and r["rtt_ms"] == rtt]
                        eps = [r["workers"][w][mode["match"]] for r in k1 for w in r["workers"]]
                        # mean ε: over prompts and workers; max ε: the worst position (rounded down, never looser)
                        if mode["match"] == "mean_residual":
                            mode["target_epsilon"] = round(statistics.fmean(eps), 4)
                        else:
                            mode["target_epsilon"] = math.floor(max(eps) * 1e4) / 1e4
                    before = [e.stats() for e in emus]
                    rows = await run_mode(urls, draft, mode, prompts, args, audit=False)
                    after = [e.stats() for e in emus]
                    emulator_bytes[f"{rtt}/{mode['mode']}"] = [
                        {
                            "to_worker": a.bytes_upstream - b.bytes_upstream,
                            "from_worker": a.bytes_downstream - b.bytes_downstream,
                        }
                        for a, b in zip(after, before, strict=True)
                    ]
                    for r in rows:
                        r.update(
                            mode=mode["mode"], rtt_ms=rtt, top_k=mode["top_k"], target_epsilon=mode["target_epsilon"]
                        )
                    runs += rows
                    log.info(
                        "RTT %g ms %s: %.1f tok/s, acceptance %.2f, %.0f uplink B/token (%.0f s so far)",
                        rtt, mode["mode"], median(rows, "tok_per_s"), median(rows, "acceptance"),
                        median(rows, "uplink_bytes_per_token"), time.perf_counter() - t_start,
                    )  # fmt: skip
                if rtt == args.rtt_ms[0] and not args.no_audit:
                    for mode in mode_list:
                        rows = await run_mode(urls, draft, mode, prompts, args, audit=True)
                        for r in rows:
                            r.update(mode=mode["mode"], rtt_ms=rtt, target_epsilon=mode["target_epsilon"])
                        audits += rows
                        log.info("audit %s done (%.0f s so far)", mode["mode"], time.perf_counter() - t_start)
    table = []
    for rtt in args.rtt_ms:
        for mode in mode_list:
            rows = [r for r in runs if r["rtt_ms"] == rtt and r["mode"] == mode["mode"]]
            agg = aggregate_rows(rows, len(args.worker), vocab)
            agg.update(rtt_ms=rtt, mode=mode["mode"], top_k=mode["top_k"], target_epsilon=mode["target_epsilon"])
            agg["emulator_bytes"] = emulator_bytes[f"{rtt}/{mode['mode']}"]
            table.append(agg)
    audit_table = []
    for mode in mode_list:
        rows = [r for r in audits if r["mode"] == mode["mode"]]
        if not rows:
            continue
        drift = [d for r in rows for d in r["audit"]["drift"]]
        weps = [e for r in rows for e in r["audit"]["weighted_epsilon"]]
        audit_table.append(
            {
                "mode": mode["mode"],
                "target_epsilon": mode["target_epsilon"],
                "positions": len(drift),
                "mean_weighted_epsilon": statistics.fmean(weps),
                "mean_drift": statistics.fmean(drift),
                "max_drift": max(drift),
                "max_drift_minus_weps": max(d - e for d, e in zip(drift, weps, strict=True)),
                "drift_over_weps": sum(r["audit"]["drift_over_weps"] for r in rows),
                "drift_over_half_delta": sum(r["audit"]["drift_over_half_delta"] for r in rows),
                "coordinator_violations": sum(r["audit"]["coordinator_violations"] for r in rows),
                "acceptance": statistics.median(r["acceptance"] for r in rows),
                "scatter": list(zip(weps, drift, strict=True)),
            }
        )
    return {
        **run_environment(),
        "host": platform.node(),
        "workers": [display_path(d, REPO) for d in args.worker],
        "drafter": display_path(args.draft, REPO),
        "weights": "equal",
        "vocab_size": vocab,
        "dense_f16_bytes_per_position": 2 * vocab,
        "prompts": [{"name": n, "tokens": len(ids)} for n, ids in prompts],
        "new_tokens": args.new_tokens,
        "gamma": args.gamma,
        "temperature": args.temperature,
        "reconstruct": args.reconstruct,
        "seeds": [args.seed + i for i in range(len(prompts))],
        "rtt_ms": args.rtt_ms,
        "bandwidth_mbps": args.bandwidth_mbps or None,
        "elapsed_s": time.perf_counter() - t_start,
        "table": table,
        "audit": audit_table,
        "runs": runs,
        "targets": targets(table, audit_table),
    }


def _mean_frame(row: dict[str, Any]) -> float:
    """Uplink frame bytes per scored position, averaged over the workers."""
    return statistics.fmean(v["frame_bytes_per_position"] for v in row["workers"].values())


def targets(table: list[dict[str, Any]], audit_table: list[dict[str, Any]]) -> dict[str, Any]:
    by_mode = {r["mode"]: r for r in table}  # the last RTT; byte figures do not depend on RTT
    out: dict[str, Any] = {}
    for mode in (
        "k1pct_f16",
        "k1pct",
        "adaptive",
        "adaptive_round_mean_eps",
        "adaptive_pos_mean_eps",
        "adaptive_pos_max_eps",
    ):
        r = by_mode[mode]
        out[f"{mode}_frame_le_1pct_dense_f16"] = r["max_frame_ratio_to_dense_f16"] <= TARGET_RATIO
        out[f"{mode}_payload_le_1pct_dense_f16"] = r["max_payload_ratio_to_dense_f16"] <= TARGET_RATIO
    if audit_table:
        out["drift_le_weighted_epsilon_all_positions"] = all(a["drift_over_weps"] == 0 for a in audit_table)
        out["drift_le_half_delta_all_positions"] = all(a["drift_over_half_delta"] == 0 for a in audit_table)
    k_fixed = statistics.fmean(v["mean_k"] for v in by_mode["k1pct"]["workers"].values())
    out["k1pct_k"] = k_fixed
    out["k1pct_mean_frame_bytes"] = _mean_frame(by_mode["k1pct"])
    for mode in ("adaptive_round_mean_eps", "adaptive_pos_mean_eps", "adaptive_pos_max_eps"):
        k_adapt = statistics.fmean(v["mean_k"] for v in by_mode[mode]["workers"].values())
        out[f"{mode}_mean_k"] = k_adapt
        out[f"{mode}_smaller_than_k1pct"] = k_adapt < k_fixed
        out[f"{mode}_mean_frame_bytes"] = _mean_frame(by_mode[mode])
        out[f"{mode}_fewer_bytes_than_k1pct"] = _mean_frame(by_mode[mode]) < _mean_frame(by_mode["k1pct"])
    return out


def _per_worker(workers: dict[str, dict[str, float]], key: str, spec: str) -> str:
    return " / ".join(format(workers[w][key], spec) for w in sorted(workers))


def markdown(res: dict[str, Any]) -> str:
    v = res["vocab_size"]
    bw = f"{res['bandwidth_mbps']:g} Mbit/s per direction" if res["bandwidth_mbps"] else "no rate limit"
    lines = [
        "# SpecFed end to end through the WAN emulator",
        "",
        f"Workers: {', '.join(f'w{i} = `{w}`' for i, w in enumerate(res['workers']))} (equal weights), each behind "
        f"its own WAN emulator ({bw}); drafter `{res['drafter']}`, γ = {res['gamma']}, T = {res['temperature']}, "
        f"reconstruction `{res['reconstruct']}`; ids exp-Golomb coded, values quantized (ρ = 0.05) unless the "
        f"mode says float16. |V| = {v}: dense float16 = "
        f"{2 * v:,} B per position, 1/100 of it = {0.02 * v:.0f} B. {len(res['prompts'])} held-out prompts "
        f"({', '.join(p['name'] for p in res['prompts'])}; {res['prompts'][0]['tokens']} tokens each), "
        f"{res['new_tokens']} new tokens, seeds {res['seeds']}; medians over prompts. "
        f"Torch threads: {res['torch_threads']}; everything (workers, emulators, coordinator) in one process on a "
        f"shared CPU, so compare rows, not absolute speeds. Total {res['elapsed_s']:.0f} s.",
        "",
        "Uplink = worker → coordinator. *frame* = whole FedScores frames per scored position (what the coordinator "
        "received: a 25-byte header per reply plus the bit stream), *payload* = the top-K bit stream inside them; "
        "ratio = frame / dense float16. ε = ‖p − p̃‖₁ as the workers reported it (tail mass + quantization error).",
        "",
        "| RTT ms | mode | K (mean w0 / w1) | target τ | mean τ (w0 / w1) | mean ε (w0 / w1) | tok/s "
        "| acceptance | tok/round "
        "| round ms | uplink B/token | frame B/pos/worker (w0 / w1) | payload B/pos/worker | ratio (max) | ≤ 1/100 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["table"]:
        w = r["workers"]
        te = "—" if r["target_epsilon"] is None else f"{r['target_epsilon']:g}"
        lines.append(
            f"| {r['rtt_ms']:g} | {r['mode']} | {_per_worker(w, 'mean_k', '.1f')} | {te} "
            f"| {_per_worker(w, 'mean_residual', '.3f')} | {_per_worker(w, 'mean_epsilon', '.3f')} "
            f"| {r['tok_per_s']:.1f} "
            f"| {r['acceptance']:.2f} | {r['tokens_per_round']:.2f} | {r['median_round_ms']:.0f} "
            f"| {r['uplink_bytes_per_token']:,.0f} "
            f"| {_per_worker(w, 'frame_bytes_per_position', ',.0f')} "
            f"| {_per_worker(w, 'payload_bytes_per_position', ',.0f')} "
            f"| 1/{1 / r['max_frame_ratio_to_dense_f16']:.0f} "
            f"| {'yes' if r['max_frame_ratio_to_dense_f16'] <= TARGET_RATIO else 'no'} |"
        )
    if res["audit"]:
        lines += [
            "",
            f"## Acceptance-rate drift vs Σwε (audit mode, RTT {res['rtt_ms'][0]:g} ms)",
            "",
            "Per drafted position: drift = |α − α̂| with α = Σ min(p, q) against the exact aggregate p and α̂ against "
            "the rebuilt one; Σwε with the exact ε = ‖p − p̃‖₁ (tail mass plus quantization error). Audit runs also "
            "carry the full laws, so they are not timed.",
            "",
            "| mode | target τ | positions | mean Σwε | mean drift | max drift | max (drift − Σwε) "
            "| # drift > Σwε | # drift > ½Δ | bound violations | acceptance |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for a in res["audit"]:
            te = "—" if a["target_epsilon"] is None else f"{a['target_epsilon']:g}"
            lines.append(
                f"| {a['mode']} | {te} | {a['positions']} | {a['mean_weighted_epsilon']:.4f} | {a['mean_drift']:.4f} "
                f"| {a['max_drift']:.4f} | {a['max_drift_minus_weps']:.2e} | {a['drift_over_weps']} "
                f"| {a['drift_over_half_delta']} | {a['coordinator_violations']} | {a['acceptance']:.2f} |"
            )
    t = res["targets"]
    lines += ["", "## Targets", ""]
    for key, value in t.items():
        lines.append(f"- `{key}`: **{value if not isinstance(value, float) else round(value, 2)}**")
    return "\n".join(lines) + "\n"


def plots(res: dict[str, Any], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = res["table"]
    mode_names = list(dict.fromkeys(r["mode"] for r in table))
    fig, axes = plt.subplots(1, 3 if res["audit"] else 2, figsize=(16 if res["audit"] else 11, 4.5))
    width = 0.8 / len(res["rtt_ms"])
    for j, rtt in enumerate(res["rtt_ms"]):
        rows = {r["mode"]: r for r in table if r["rtt_ms"] == rtt}
        xs = [i + j * width for i in range(len(mode_names))]
        axes[0].bar(xs, [rows[m]["tok_per_s"] for m in mode_names], width, label=f"RTT {rtt:g} ms")
    axes[0].set_xticks(
        [i + width * (len(res["rtt_ms"]) - 1) / 2 for i in range(len(mode_names))], mode_names, rotation=30, ha="right"
    )
    axes[0].set_ylabel("tokens / s (median over prompts)")
    axes[0].set_title("generation speed")
    axes[0].legend()
    last = {r["mode"]: r for r in table if r["rtt_ms"] == res["rtt_ms"][-1]}
    n_workers = len(res["workers"])
    for w in range(n_workers):
        xs = [i + w * 0.8 / n_workers for i in range(len(mode_names))]
        axes[1].bar(
            xs,
            [last[m]["workers"][f"w{w}"]["frame_bytes_per_position"] for m in mode_names],
            0.8 / n_workers,
            label=f"w{w} {Path(res['workers'][w]).name}",
        )
    axes[1].axhline(2 * res["vocab_size"], color="red", linestyle=":", label="dense float16")
    axes[1].axhline(0.02 * res["vocab_size"], color="green", linestyle="--", label="1/100 dense float16")
    axes[1].set_yscale("log")
    axes[1].set_xticks(
        [i + 0.4 * (n_workers - 1) / n_workers for i in range(len(mode_names))], mode_names, rotation=30, ha="right"
    )
    axes[1].set_ylabel("bytes / position / worker")
    axes[1].set_title("uplink frames per scored position")
    axes[1].legend(fontsize=7)
    if res["audit"]:
        for a in res["audit"]:
            if not a["scatter"]:
                continue
            axes[2].scatter([e for e, _ in a["scatter"]], [d for _, d in a["scatter"]], s=6, alpha=0.5, label=a["mode"])
        top = max((e for a in res["audit"] for e, _ in a["scatter"]), default=1.0)
        axes[2].plot([0, top], [0, top], color="black", linestyle=":", label="drift = Σwε")
        axes[2].set_xlabel("Σ w ε (exact: tail mass + quantization error)")
        axes[2].set_ylabel("|α − α̂| per drafted position")
        axes[2].set_title("acceptance-rate drift vs bound (audit)")
        axes[2].legend(fontsize=7)
    fig.tight_layout()
    path = out / "specfed_wan.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--worker", type=Path, action="append", help="worker model dir (repeat; default base, worker)")
    parser.add_argument("--draft", type=Path, default=MODELS / "draft", help="drafter model dir (default draft)")
    parser.add_argument("--rtt-ms", type=float, nargs="+", default=[20.0, 80.0], help="added RTT per link, ms")
    parser.add_argument("--bandwidth-mbps", type=float, default=0.0, help="rate per direction, Mbit/s (0: none)")
    parser.add_argument("--prompts", type=int, default=6, help=f"held-out prompts (at most {len(PROMPT_SOURCES)})")
    parser.add_argument("--prompt-tokens", type=int, default=48, help="tokens per prompt")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens to generate per prompt")
    parser.add_argument("--gamma", type=int, default=4, help="draft tokens per round")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (0: greedy)")
    parser.add_argument("--target-epsilon", type=float, default=0.2, help="target ε of the adaptive mode")
    parser.add_argument("--reconstruct", choices=["renorm", "residual"], default="renorm")
    parser.add_argument("--seed", type=int, default=1000, help="seed of the first prompt (+1 per prompt)")
    parser.add_argument("--no-audit", action="store_true", help="skip the audit runs")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (shared machines: 1)")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "specfed_wan")
    parser.add_argument("--plot-only", action="store_true", help="redraw the plot and table from the saved JSON")
    args = parser.parse_args(argv)
    if args.plot_only:
        saved = json.loads((args.out / "specfed_wan.json").read_text())
        plots(saved, args.out)
        (args.out / "specfed_wan.md").write_text(markdown(saved))
        return 0
    args.worker = args.worker or default_workers()
    args.prompts = max(1, min(args.prompts, len(PROMPT_SOURCES)))
    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    for noisy in ("websockets", "splitspec"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    result = asyncio.run(benchmark(args))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "specfed_wan.json").write_text(json.dumps(result, indent=1) + "\n")
    table = markdown(result)
    (args.out / "specfed_wan.md").write_text(table)
    plots(result, args.out)
    sys.stdout.write(table)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
