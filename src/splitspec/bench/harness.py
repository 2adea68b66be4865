"""Benchmark harness: split decoding over emulated WAN links beside local-only baselines.

One call of :func:`run_benchmark` runs a :class:`~splitspec.bench.scenario.Scenario` in this
process, on loopback:

1. builds the prompts from held-out documents (:mod:`splitspec.bench.prompts`);
2. loads the full model once for the local baselines (transformers ``generate`` greedy, and
   transformers prompt-lookup decoding) and starts one :class:`TrunkServer`;
3. for each repeat: runs every baseline on every prompt, then for each RTT (ascending on even
   repeats, descending on odd ones, so drift hits every RTT alike) puts a fresh
   :class:`WanEmulator` in front of the server, measures the link's real RTT with control round
   trips, connects a :class:`SplitClient` through it and runs every mode on every prompt;
4. writes, under the output folder: ``runs/<run_id>.json`` (one per run, every step's stats),
   ``summary.json``, ``summary.md`` (markdown tables), ``tok_s_vs_rtt.png`` (medians with the
   fitted ``1000·a / (RTT + f)`` curve and the local baselines) and ``step_breakdown.png``
   (stacked per-step medians: network, edge, cloud, serialization).

Because baselines and split runs interleave within each repeat, their ratios are measured side by
side; the report gives medians and paired ratios, never a lone absolute time (``DESIGN.md`` §5).

Definitions (per run):

* ``e2e tok/s`` = new tokens / wall time of the whole generation, prefill included.
* ``decode tok/s`` = tokens produced by decode steps / (wall time − prefill steps' time). The first
  token comes from the prefill's logits, so decode steps produce ``new_tokens − 1`` tokens.
* ``accepted/step`` = (new tokens − 1) / decode steps: exactly 1 for sequential decoding, the mean
  tokens committed per round trip for speculative modes.
* per-step breakdown: medians over decode steps of network (round trip minus the cloud's reported
  compute), edge compute, cloud compute and edge-side serialization, and bytes each way.

Decoding modes are looked up in :data:`MODES` (name -> async runner); speculative modes register
there. Split greedy output is checked token for token against the ``hf_generate`` baseline.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import platform
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, cast

import torch
from tqdm import tqdm

from splitspec.bench.probe import measure_pings, step_total_ms
from splitspec.bench.prompts import Prompt, TokenizerLike, build_prompts
from splitspec.bench.scenario import Scenario, check_paths
from splitspec.cloud.config import CloudConfig
from splitspec.cloud.server import TrunkServer
from splitspec.decoding.sampling import SamplingParams
from splitspec.edge import EdgeConfig, GenerationResult, SplitClient
from splitspec.exceptions import ConfigError
from splitspec.netem.emulator import NetemConfig, WanEmulator
from splitspec.netem.projection import fit_projection

__all__ = [
    "BASELINES",
    "MODES",
    "ModeRunner",
    "RunRecord",
    "run_benchmark",
    "summarize",
    "write_markdown",
    "write_plots",
]

log = logging.getLogger(__name__)

ModeRunner = Callable[[SplitClient, Sequence[int], int], Awaitable[GenerationResult]]


async def _sequential(client: SplitClient, prompt_ids: Sequence[int], max_new_tokens: int) -> GenerationResult:
    """Plain greedy decoding: one round trip per token."""
    return await client.generate(prompt_ids, max_new_tokens, SamplingParams(temperature=0.0))


def _speculative(mode: str) -> ModeRunner:
    async def run(client: SplitClient, prompt_ids: Sequence[int], max_new_tokens: int) -> GenerationResult:
        return await client.generate(prompt_ids, max_new_tokens, SamplingParams(temperature=0.0), speculate=mode)

    run.__doc__ = f"Greedy speculative decoding, --speculate {mode}."
    return run


MODES: dict[str, ModeRunner] = {
    "sequential": _sequential,
    **{mode: _speculative(mode) for mode in ("ngram", "prompt-lookup", "draft", "mix", "auto")},
}
"""Split decoding modes by name. A mode is ``async (client, prompt_ids, max_new_tokens) ->
GenerationResult`` and must decode greedily (its tokens are checked against ``hf_generate``)."""

BASELINES = ("hf_generate", "hf_prompt_lookup", "local_loop")
"""Local-only baselines: transformers ``generate`` (greedy), transformers prompt-lookup decoding,
and a bare KV-cached greedy loop over the full model (the local compute floor without
``generate()``'s per-call and per-token bookkeeping)."""

_COMPONENTS = ("network_ms", "edge_ms", "cloud_ms", "serialize_ms")


@dataclass
class RunRecord:
    """One generation: a split run (``rtt_ms`` set) or a local baseline (``rtt_ms`` None)."""

    run_id: str
    mode: str  # a MODES key or a BASELINES name
    rtt_ms: float | None  # emulated RTT setting, ms; None for local baselines
    measured_rtt_ms: float | None  # median control round trip through the emulator, ms
    prompt_set: str
    prompt_id: str
    repeat: int
    prompt_tokens: int  # tokens
    new_tokens: int  # tokens
    wall_s: float  # whole generation, seconds
    e2e_tok_s: float  # new tokens / wall, tokens/second
    decode_tok_s: float | None  # decode-phase throughput, tokens/second (split runs only)
    decode_steps: int | None  # round trips after the prefill, count
    accepted_per_step: float | None  # (new tokens − 1) / decode steps, tokens/step
    prefill_ms: float | None  # prefill steps' total time, ms
    step_ms: dict[str, float] = field(default_factory=dict)  # medians over decode steps, ms
    bytes_per_step: dict[str, float] = field(default_factory=dict)  # medians over decode steps, bytes
    matches_hf_generate: bool | None = None  # token-identical to the hf_generate baseline
    token_ids: list[int] = field(default_factory=list)
    steps: list[dict[str, Any]] = field(default_factory=list)  # every StepStats, as dicts

    @property
    def is_split(self) -> bool:
        return self.rtt_ms is not None


def _median(values: Iterable[float]) -> float:
    data = list(values)
    return float(statistics.median(data)) if data else float("nan")


def _quartiles(values: Sequence[float]) -> tuple[float, float]:
    if len(values) < 2:
        v = values[0] if values else float("nan")
        return float(v), float(v)
    q = statistics.quantiles(values, n=4, method="inclusive")
    return float(q[0]), float(q[2])


def split_record(
    result: GenerationResult,
    *,
    run_id: str,
    mode: str,
    rtt_ms: float,
    measured_rtt_ms: float,
    prompt: Prompt,
    repeat: int,
) -> RunRecord:
    """Derive the per-run figures (see the module doc) from a split generation."""
    decode = [s for s in result.steps if s.kind == "decode"]
    prefill_ms = sum(step_total_ms(s) for s in result.steps if s.kind == "prefill")
    n = len(result.token_ids)
    decode_s = result.wall_s - prefill_ms / 1e3
    step_ms = {k: _median(getattr(s, k) for s in decode) for k in _COMPONENTS}
    step_ms["step_ms"] = _median(step_total_ms(s) for s in decode)
    return RunRecord(
        run_id=run_id,
        mode=mode,
        rtt_ms=rtt_ms,
        measured_rtt_ms=measured_rtt_ms,
        prompt_set=prompt.prompt_set,
        prompt_id=prompt.prompt_id,
        repeat=repeat,
        prompt_tokens=len(prompt.token_ids),
        new_tokens=n,
        wall_s=result.wall_s,
        e2e_tok_s=n / result.wall_s if result.wall_s > 0 else float("nan"),
        decode_tok_s=(n - 1) / decode_s if decode and decode_s > 0 else None,
        decode_steps=len(decode),
        accepted_per_step=(n - 1) / len(decode) if decode else None,
        prefill_ms=prefill_ms,
        step_ms=step_ms,
        bytes_per_step={
            "up": _median(float(s.bytes_up) for s in decode),
            "down": _median(float(s.bytes_down) for s in decode),
        },
        token_ids=list(result.token_ids),
        steps=[asdict(s) for s in result.steps],
    )


# -- local baselines -------------------------------------------------------------------------------


class LocalBaselines:
    """The whole model in this process, generating with transformers (greedy)."""

    def __init__(self, model_dir: Path, dtype: torch.dtype, prompt_lookup_num_tokens: int) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, local_files_only=True).eval()
        config = self.model.config
        eos = getattr(config, "eos_token_id", None)
        self.pad_token_id = int(eos if isinstance(eos, int) else (eos[0] if eos else 0))
        self.eos_token_id = eos
        self.prompt_lookup_num_tokens = prompt_lookup_num_tokens

    def generate(self, mode: str, prompt_ids: Sequence[int], max_new_tokens: int) -> tuple[list[int], float]:
        """Generate with ``mode`` (a BASELINES name) -> (new token ids, wall seconds)."""
        input_ids = torch.tensor([list(prompt_ids)], dtype=torch.long)
        if mode == "local_loop":
            return self._loop(input_ids, max_new_tokens)
        extra: dict[str, Any] = {}
        if mode == "hf_prompt_lookup":
            extra["prompt_lookup_num_tokens"] = self.prompt_lookup_num_tokens
        elif mode != "hf_generate":
            raise ValueError(f"unknown baseline {mode!r}")
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=self.pad_token_id,
                eos_token_id=self.eos_token_id,
                **extra,
            )
        wall = time.perf_counter() - t0
        return [int(t) for t in out[0, input_ids.shape[1] :].tolist()], wall

    def _loop(self, input_ids: torch.Tensor, max_new_tokens: int) -> tuple[list[int], float]:
        eos = self.eos_token_id
        stops = set() if eos is None else {eos} if isinstance(eos, int) else set(eos)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.model(input_ids=input_ids, use_cache=True)
            token = int(out.logits[0, -1].argmax())
            tokens = [token]
            while len(tokens) < max_new_tokens and token not in stops:
                out = self.model(input_ids=torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
                token = int(out.logits[0, -1].argmax())
                tokens.append(token)
        return tokens, time.perf_counter() - t0


def _baseline_record(mode: str, tokens: list[int], wall: float, prompt: Prompt, repeat: int) -> RunRecord:
    return RunRecord(
        run_id=f"r{repeat}_{mode}_{prompt.prompt_id}",
        mode=mode,
        rtt_ms=None,
        measured_rtt_ms=None,
        prompt_set=prompt.prompt_set,
        prompt_id=prompt.prompt_id,
        repeat=repeat,
        prompt_tokens=len(prompt.token_ids),
        new_tokens=len(tokens),
        wall_s=wall,
        e2e_tok_s=len(tokens) / wall if wall > 0 else float("nan"),
        decode_tok_s=None,
        decode_steps=None,
        accepted_per_step=None,
        prefill_ms=None,
        token_ids=tokens,
    )


# -- the run -----------------------------------------------------------------------------------------


def _rtt_order(rtts: Sequence[float], repeat: int) -> list[float]:
    ordered = sorted(rtts)
    return ordered if repeat % 2 == 0 else ordered[::-1]


def _environment() -> dict[str, Any]:
    import transformers

    return {
        "started_utc": datetime.now(UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }


async def _run(scenario: Scenario, prompts: list[Prompt], records: list[RunRecord], bar: tqdm[Any]) -> None:
    """Baselines and split runs, interleaved by repeat; appends to ``records``."""
    sc = scenario
    enabled = {
        "hf_generate": sc.baselines.hf_generate,
        "hf_prompt_lookup": sc.baselines.prompt_lookup,
        "local_loop": sc.baselines.local_loop,
    }
    baselines = [m for m in BASELINES if enabled[m]]
    dtype = getattr(torch, sc.dtype)
    local = LocalBaselines(sc.model_dir, dtype, sc.baselines.prompt_lookup_num_tokens) if baselines else None
    reference: dict[str, list[int]] = {}
    if local is not None:
        for mode in baselines:  # warm-up, not recorded
            local.generate(mode, prompts[0].token_ids, min(8, sc.max_new_tokens))

    cloud = CloudConfig(model_dir=sc.model_dir, edge_layers=sc.edge_layers, port=0, dtype=sc.dtype)
    edge_model = None
    async with TrunkServer(cloud) as server:
        for repeat in range(sc.repeats):
            if local is not None:
                for prompt in prompts:
                    for mode in baselines:
                        tokens, wall = local.generate(mode, prompt.token_ids, sc.max_new_tokens)
                        rec = _baseline_record(mode, tokens, wall, prompt, repeat)
                        if mode == "hf_generate":
                            reference.setdefault(prompt.prompt_id, tokens)
                        records.append(rec)
                        bar.update(1)
            for rtt in _rtt_order(sc.rtt_ms, repeat):
                netem = NetemConfig(
                    upstream_port=server.port,
                    rtt_ms=rtt,
                    jitter_ms=sc.jitter_ms,
                    bandwidth_bps=None if sc.bandwidth_mbit is None else sc.bandwidth_mbit * 1e6,
                    seed=repeat,
                )
                async with WanEmulator(netem) as emu:
                    url = f"ws://{emu.host}:{emu.port}"
                    edge_cfg = EdgeConfig(
                        allow_stock_edge_weights=True,
                        model_dir=sc.model_dir,
                        cloud_url=url,
                        edge_layers=sc.edge_layers,
                        dtype=sc.dtype,
                        draft_model_dir=sc.draft_model_dir,
                    )
                    async with SplitClient(edge_cfg, edge=edge_model) as client:
                        edge_model = client.model
                        pings = await measure_pings(url, client.hello, sc.pings)
                        measured = _median(pings)
                        bar.set_postfix_str(f"rtt {rtt:g} ms (measured {measured:.1f})")
                        await MODES[sc.modes[0]](client, prompts[0].token_ids, 4)  # warm-up, not recorded
                        for mode in sc.modes:
                            for prompt in prompts:
                                result = await MODES[mode](client, prompt.token_ids, sc.max_new_tokens)
                                rec = split_record(
                                    result,
                                    run_id=f"r{repeat}_{mode}_rtt{rtt:g}_{prompt.prompt_id}",
                                    mode=mode,
                                    rtt_ms=rtt,
                                    measured_rtt_ms=measured,
                                    prompt=prompt,
                                    repeat=repeat,
                                )
                                records.append(rec)
                                bar.update(1)
    for rec in records:
        ref = reference.get(rec.prompt_id)
        if ref is not None and rec.mode != "hf_generate":
            rec.matches_hf_generate = rec.token_ids == ref
            if rec.is_split and not rec.matches_hf_generate:
                log.warning("%s: split tokens differ from hf_generate", rec.run_id)


def run_benchmark(
    scenario: Scenario, out_dir: Path, *, progress: bool = True, write_runs: bool = True
) -> dict[str, Any]:
    """Run ``scenario`` and write its report under ``out_dir``; returns the summary dict."""
    from transformers import AutoTokenizer

    check_paths(scenario)
    for mode in scenario.modes:
        if mode not in MODES:
            raise ConfigError(f"unknown mode {mode!r}; registered: {sorted(MODES)}")
    tokenizer = AutoTokenizer.from_pretrained(scenario.model_dir, local_files_only=True)
    p = scenario.prompts
    prompts = build_prompts(cast(TokenizerLike, tokenizer), p.corpus_dir, p.sets, p.per_set, p.prompt_tokens)
    b = scenario.baselines
    n_base = int(b.hf_generate) + int(b.prompt_lookup) + int(b.local_loop)
    total = scenario.repeats * len(prompts) * (n_base + len(scenario.rtt_ms) * len(scenario.modes))
    threads_before = torch.get_num_threads()
    torch.set_num_threads(scenario.torch_threads)
    try:
        environment = _environment()
        records: list[RunRecord] = []
        t0 = time.perf_counter()
        log.info("benchmark %s: %d runs, writing to %s", scenario.name, total, out_dir)
        quiet = ("splitspec.netem", "splitspec.edge", "splitspec.cloud", "splitspec.transport", "websockets")
        with (
            tqdm(total=total, desc=scenario.name, unit="run", file=sys.stderr, disable=not progress) as bar,
            _quiet(quiet),
        ):
            asyncio.run(_run(scenario, prompts, records, bar))
        environment["wall_s"] = time.perf_counter() - t0
    finally:
        torch.set_num_threads(threads_before)
    summary = summarize(scenario, prompts, records, environment, tokenizer=tokenizer)
    out_dir.mkdir(parents=True, exist_ok=True)
    if write_runs:
        runs_dir = out_dir / "runs"
        runs_dir.mkdir(exist_ok=True)
        for rec in records:
            (runs_dir / f"{rec.run_id}.json").write_text(json.dumps(asdict(rec), separators=(",", ":")) + "\n")
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out_dir / "summary.md").write_text(write_markdown(summary))
    write_plots(summary, out_dir)
    log.info("benchmark %s done in %.1f s", scenario.name, environment["wall_s"])
    return summary


# -- summary ---------------------------------------------------------------------------------------


def _paired_ratios(records: list[RunRecord], reference: dict[tuple[int, str], RunRecord]) -> list[float]:
    out = []
    for rec in records:
        ref = reference.get((rec.repeat, rec.prompt_id))
        if ref is not None and ref.e2e_tok_s > 0:
            out.append(rec.e2e_tok_s / ref.e2e_tok_s)
    return out


_Refs = dict[str, dict[tuple[int, str], RunRecord]]  # baseline -> (repeat, prompt id) -> its run


def _ratio(group: list[RunRecord], refs: _Refs, baseline: str) -> float | None:
    """Median paired e2e tok/s ratio of ``group`` to ``baseline`` (None without that baseline)."""
    ref = refs.get(baseline)
    if not ref:
        return None
    if group and group[0].mode == baseline:
        return 1.0
    return _median(_paired_ratios(group, ref))


def _group_split(group: list[RunRecord], refs: _Refs) -> dict[str, Any]:
    decode = [r.decode_tok_s for r in group if r.decode_tok_s is not None]
    matches = [r.matches_hf_generate for r in group if r.matches_hf_generate is not None]
    q25, q75 = _quartiles(decode)
    return {
        "n_runs": len(group),
        "measured_rtt_ms": _median(r.measured_rtt_ms for r in group if r.measured_rtt_ms is not None),
        "decode_tok_s": _median(decode),
        "decode_tok_s_iqr": [q25, q75],
        "e2e_tok_s": _median(r.e2e_tok_s for r in group),
        "ratio_vs_hf_generate": _ratio(group, refs, "hf_generate"),
        "ratio_vs_local_loop": _ratio(group, refs, "local_loop"),
        "accepted_per_step": _median(r.accepted_per_step for r in group if r.accepted_per_step is not None),
        "bytes_up_per_step": _median(r.bytes_per_step["up"] for r in group),
        "bytes_down_per_step": _median(r.bytes_per_step["down"] for r in group),
        "step_ms": {k: _median(r.step_ms[k] for r in group) for k in (*_COMPONENTS, "step_ms")},
        "prefill_ms": _median(r.prefill_ms for r in group if r.prefill_ms is not None),
        "new_tokens": _median(float(r.new_tokens) for r in group),
        "token_match": [sum(matches), len(matches)],
    }


def summarize(
    scenario: Scenario,
    prompts: list[Prompt],
    records: list[RunRecord],
    environment: dict[str, Any],
    *,
    tokenizer: Any = None,
) -> dict[str, Any]:
    """Medians, paired ratios and fits over the runs (pure; no I/O)."""
    refs: _Refs = {
        name: {(r.repeat, r.prompt_id): r for r in records if r.mode == name} for name in ("hf_generate", "local_loop")
    }
    baselines: dict[str, Any] = {}
    for mode in BASELINES:
        group = [r for r in records if r.mode == mode]
        if not group:
            continue
        matches = [r.matches_hf_generate for r in group if r.matches_hf_generate is not None]
        baselines[mode] = {
            "n_runs": len(group),
            "e2e_tok_s": _median(r.e2e_tok_s for r in group),
            "e2e_tok_s_iqr": list(_quartiles([r.e2e_tok_s for r in group])),
            "ratio_vs_hf_generate": _ratio(group, refs, "hf_generate"),
            "ratio_vs_local_loop": _ratio(group, refs, "local_loop"),
            "new_tokens": _median(float(r.new_tokens) for r in group),
            "token_match": None if mode == "hf_generate" else [sum(matches), len(matches)],
            "by_set": {s: _median(r.e2e_tok_s for r in group if r.prompt_set == s) for s in scenario.prompts.sets},
        }
    split: list[dict[str, Any]] = []
    by_set: list[dict[str, Any]] = []
    fits: dict[str, Any] = {}
    for mode in scenario.modes:
        for rtt in sorted(scenario.rtt_ms):
            group = [r for r in records if r.mode == mode and r.rtt_ms == rtt]
            if group:
                split.append({"mode": mode, "rtt_ms": rtt, **_group_split(group, refs)})
            for s in scenario.prompts.sets:
                sub = [r for r in group if r.prompt_set == s]
                if sub:
                    by_set.append(
                        {
                            "mode": mode,
                            "rtt_ms": rtt,
                            "prompt_set": s,
                            "decode_tok_s": _median(r.decode_tok_s for r in sub if r.decode_tok_s is not None),
                            "accepted_per_step": _median(
                                r.accepted_per_step for r in sub if r.accepted_per_step is not None
                            ),
                        }
                    )
        fits[mode] = _fit(mode, [g for g in split if g["mode"] == mode])
    return {
        "scenario": scenario.to_json(),
        "environment": environment,
        "prompts": [
            {
                "prompt_id": p.prompt_id,
                "prompt_set": p.prompt_set,
                "source": p.source,
                "cut_char": p.cut_char,
                "tokens": len(p.token_ids),
                "text_tail": _tail(tokenizer, p.token_ids),
            }
            for p in prompts
        ],
        "baselines": baselines,
        "split": split,
        "split_by_set": by_set,
        "fits": fits,
        "definitions": {
            "e2e_tok_s": "new tokens / wall time of the whole generation (prefill included)",
            "decode_tok_s": "(new tokens - 1) / (wall - prefill steps' time)",
            "accepted_per_step": "(new tokens - 1) / decode steps; 1 for sequential",
            "ratio_vs_hf_generate": "median over (repeat, prompt) of e2e tok/s / hf_generate e2e tok/s",
            "ratio_vs_local_loop": "the same against the bare KV-cached local greedy loop",
            "step_ms": "medians over runs of each run's median over decode steps",
            "network_ms": "step round trip minus the cloud's reported compute",
            "fit": "tok/s = 1000*a/(RTT+f) fitted to (measured RTT, median decode tok/s) per RTT",
        },
    }


def _tail(tokenizer: Any, ids: Sequence[int], n: int = 24) -> str | None:
    if tokenizer is None:
        return None
    return str(tokenizer.decode(list(ids[-n:])))


def _fit(mode: str, groups: list[dict[str, Any]]) -> dict[str, Any] | None:
    points = [(g["measured_rtt_ms"], g["decode_tok_s"]) for g in groups if g["decode_tok_s"] > 0]
    overhead = [g["step_ms"]["step_ms"] - g["measured_rtt_ms"] for g in groups]
    out: dict[str, Any] = {
        "overhead_from_steps_ms": _median(overhead),  # median over RTTs of (step − measured RTT)
    }
    if len({round(x, 6) for x, _ in points}) < 2:
        return out
    try:
        fit = fit_projection([x for x, _ in points], [y for _, y in points])
    except ValueError as exc:
        log.warning("mode %s: cannot fit 1000a/(RTT+f): %s", mode, exc)
        return out
    out.update(asdict(fit))
    return out


# -- report writers ------------------------------------------------------------------------------


def _fmt(value: float | None, digits: int = 1) -> str:
    if value is None or value != value:  # None or NaN
        return "-"
    return f"{value:.{digits}f}"


def _ratio_cell(value: float | None) -> str:
    return "-" if value is None else _fmt(value, 3) + "x"


def _table(header: list[str], rows: list[list[str]], text_columns: int = 1) -> Iterator[str]:
    yield "| " + " | ".join(header) + " |"
    yield "|" + "|".join(":---" if i < text_columns else "---:" for i in range(len(header))) + "|"
    for row in rows:
        yield "| " + " | ".join(row) + " |"


def write_markdown(summary: dict[str, Any]) -> str:
    """The ``summary.md`` report."""
    sc, env = summary["scenario"], summary["environment"]
    lines = [
        f"# Benchmark `{sc['name']}`",
        "",
        *([sc["description"], ""] if sc.get("description") else []),
        f"Model `{sc['model_dir']}`, edge layers {sc['edge_layers'][0]}+{sc['edge_layers'][1]}, {sc['dtype']}; "
        f"{len(summary['prompts'])} prompts ({', '.join(sc['prompts']['sets'])}; "
        f"{sc['prompts']['prompt_tokens']} tokens each), {sc['max_new_tokens']} new tokens, "
        f"{sc['repeats']} repeats. Emulated RTTs {sc['rtt_ms']} ms on loopback "
        f"(jitter {sc['jitter_ms']} ms, bandwidth {sc['bandwidth_mbit'] or 'unlimited'} Mbit/s).",
        f"Run {env['started_utc']}, {env['wall_s']:.0f} s wall; torch {env['torch']}, transformers "
        f"{env['transformers']}, {env['cpu_count']} CPUs ({env['torch_threads']} torch threads), "
        "shared machine: read the ratios, not the absolute times.",
        "",
        "## Throughput (medians over prompts and repeats)",
        "",
    ]
    header = [
        "mode",
        "RTT set ms",
        "RTT meas. ms",
        "decode tok/s",
        "e2e tok/s",
        "vs HF generate",
        "vs local loop",
        "accepted/step",
        "B up/step",
        "B down/step",
        "network ms",
        "edge ms",
        "cloud ms",
        "serialize ms",
        "step ms",
        "= HF tokens",
    ]
    rows: list[list[str]] = []
    for name, b in summary["baselines"].items():
        match = b["token_match"]
        rows.append(
            [
                f"{name} (local)",
                "-",
                "-",
                "-",
                _fmt(b["e2e_tok_s"]),
                _ratio_cell(b["ratio_vs_hf_generate"]),
                _ratio_cell(b["ratio_vs_local_loop"]),
                "-",
                "-",
                "-",
                "-",
                "-",
                "-",
                "-",
                "-",
                "ref" if match is None else f"{match[0]}/{match[1]}",
            ]
        )
    for g in summary["split"]:
        s = g["step_ms"]
        rows.append(
            [
                f"split {g['mode']}",
                _fmt(g["rtt_ms"], 0),
                _fmt(g["measured_rtt_ms"]),
                _fmt(g["decode_tok_s"]),
                _fmt(g["e2e_tok_s"]),
                _ratio_cell(g["ratio_vs_hf_generate"]),
                _ratio_cell(g["ratio_vs_local_loop"]),
                _fmt(g["accepted_per_step"], 2),
                _fmt(g["bytes_up_per_step"], 0),
                _fmt(g["bytes_down_per_step"], 0),
                _fmt(s["network_ms"], 2),
                _fmt(s["edge_ms"], 2),
                _fmt(s["cloud_ms"], 2),
                _fmt(s["serialize_ms"], 2),
                _fmt(s["step_ms"], 2),
                f"{g['token_match'][0]}/{g['token_match'][1]}" if g["token_match"][1] else "-",
            ]
        )
    lines += list(_table(header, rows))
    lines += ["", "## Fixed overhead: tok/s = 1000·a / (RTT + f)", ""]
    fit_rows = []
    for mode, fit in summary["fits"].items():
        if fit is None:
            continue
        fit_rows.append(
            [
                mode,
                _fmt(fit.get("overhead_ms"), 2),
                _fmt(fit.get("acceptance"), 3),
                _fmt(fit.get("r_squared"), 4),
                _fmt(fit.get("max_abs_error_tok_s"), 2),
                _fmt(fit.get("overhead_from_steps_ms"), 2),
            ]
        )
    lines += list(_table(["mode", "fitted f ms", "fitted a", "R²", "max err tok/s", "median step − RTT ms"], fit_rows))
    lines += [
        "",
        "The fit uses the measured RTT (control round trips through the emulator) and the median decode tok/s "
        "at each setting; 'median step − RTT' is the same overhead read directly off the step timings.",
        "",
        "## Decode tok/s by prompt set",
        "",
    ]
    rtts = sorted(sc["rtt_ms"])
    set_rows = []
    for mode in sc["modes"]:
        for s in sc["prompts"]["sets"]:
            cells = {g["rtt_ms"]: g for g in summary["split_by_set"] if g["mode"] == mode and g["prompt_set"] == s}
            set_rows.append(
                [f"{mode} / {s}"]
                + [
                    _fmt(cells[r]["decode_tok_s"]) + f" ({_fmt(cells[r]['accepted_per_step'], 2)})"
                    if r in cells
                    else "-"
                    for r in rtts
                ]
            )
    lines += list(_table(["mode / set"] + [f"RTT {r:g} ms" for r in rtts], set_rows))
    lines += ["", "Cells: median decode tok/s (accepted tokens per step).", "", "## Prompts", ""]
    prompt_rows = [
        [
            p["prompt_id"],
            p["source"],
            str(p["tokens"]),
            "`" + (p["text_tail"] or "").replace("\n", "⏎").replace("|", "¦").replace("`", "'") + "`",
        ]
        for p in summary["prompts"]
    ]
    lines += list(_table(["id", "document", "tokens", "last tokens"], prompt_rows, text_columns=4))
    lines += ["", "Definitions:", ""]
    lines += [f"- `{k}`: {v}" for k, v in summary["definitions"].items()]
    return "\n".join(lines) + "\n"


def write_plots(summary: dict[str, Any], out_dir: Path) -> list[Path]:
    """``tok_s_vs_rtt.png`` and ``step_breakdown.png`` (matplotlib, Agg canvas, no pyplot)."""
    import numpy as np
    from matplotlib.figure import Figure

    paths = []
    fig = Figure(figsize=(7.0, 4.5), dpi=110)
    ax = fig.add_subplot()
    groups = summary["split"]
    # one distinct colour per mode (baselines use black / green / red lines)
    colors = ["tab:blue", "tab:orange", "tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan", "tab:gray"]
    max_rtt = max([g["measured_rtt_ms"] for g in groups] + [1.0])
    xs = np.linspace(0.0, max_rtt * 1.05, 200)
    for i, mode in enumerate(summary["scenario"]["modes"]):
        pts = [g for g in groups if g["mode"] == mode]
        if not pts:
            continue
        color = colors[i % len(colors)]
        x = [g["measured_rtt_ms"] for g in pts]
        y = [g["decode_tok_s"] for g in pts]
        lo = [g["decode_tok_s"] - g["decode_tok_s_iqr"][0] for g in pts]
        hi = [g["decode_tok_s_iqr"][1] - g["decode_tok_s"] for g in pts]
        ax.errorbar(x, y, yerr=[lo, hi], fmt="o", color=color, capsize=3, label=f"split {mode} (median, IQR)")
        fit = summary["fits"].get(mode) or {}
        if "overhead_ms" in fit:
            f, a = fit["overhead_ms"], fit["acceptance"]
            ax.plot(xs, 1000.0 * a / (xs + f), "-", color=color, alpha=0.7, label=f"1000·{a:.2f}/(RTT + {f:.1f} ms)")
    styles = {"hf_generate": ("k", "--"), "hf_prompt_lookup": ("tab:green", ":"), "local_loop": ("tab:red", "-.")}
    for name, b in summary["baselines"].items():
        color, style = styles.get(name, ("gray", "-."))
        ax.axhline(b["e2e_tok_s"], color=color, linestyle=style, label=f"{name}, local: {b['e2e_tok_s']:.1f} tok/s e2e")
    ax.set_xlabel("measured RTT (ms)")
    ax.set_ylabel("tokens / s")
    ax.set_title(f"{summary['scenario']['name']}: decode throughput vs RTT")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out_dir / "tok_s_vs_rtt.png"
    fig.savefig(path)
    paths.append(path)

    many = len(groups) > 8  # many bars: one-line labels, turned upright, on a wider figure
    fig = Figure(figsize=(max(7.0, 0.45 * len(groups)), 5.0 if many else 4.5), dpi=110)
    ax = fig.add_subplot()
    sep = " " if many else "\n"
    labels = [f"{g['mode']}{sep}{g['rtt_ms']:g} ms" for g in groups]
    bottom = np.zeros(len(groups))
    rtt = np.array([g["measured_rtt_ms"] for g in groups])
    parts = {
        "RTT (measured)": ("tab:blue", rtt),
        "network − RTT": (
            "lightsteelblue",
            np.maximum(0.0, np.array([g["step_ms"]["network_ms"] for g in groups]) - rtt),
        ),
        "edge": ("tab:orange", np.array([g["step_ms"]["edge_ms"] for g in groups])),
        "cloud": ("tab:red", np.array([g["step_ms"]["cloud_ms"] for g in groups])),
        "serialize": ("tab:gray", np.array([g["step_ms"]["serialize_ms"] for g in groups])),
    }
    for label, (color, vals) in parts.items():
        ax.bar(labels, vals, bottom=bottom, color=color, label=label)
        bottom += vals
    if many:
        ax.tick_params(axis="x", labelrotation=90, labelsize=8)
    ax.set_ylabel("median per decode step (ms)")
    ax.set_title("per decode step: RTT and fixed overhead (medians)")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path = out_dir / "step_breakdown.png"
    fig.savefig(path)
    paths.append(path)
    return paths


@contextlib.contextmanager
def _quiet(names: Iterable[str], level: int = logging.WARNING) -> Iterator[None]:
    """Raise the level of chatty loggers for the duration (restored afterwards)."""
    loggers = [logging.getLogger(n) for n in names]
    old = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(max(level, lg.level))
    try:
        yield
    finally:
        for lg, lvl in zip(loggers, old, strict=True):
            lg.setLevel(lvl)
