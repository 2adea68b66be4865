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
4. writes, under the output folder: ``runs.jsonl.gz`` (one JSON line per run, every step's
   stats, stamped with the commit and splitspec version),
   ``summary.json``, ``summary.md`` (markdown tables), ``tok_s_vs_rtt.png`` (medians with the
   fitted ``1000·a / (RTT + f)`` curve and the local baselines) and ``step_breakdown.png``
   (stacked per-step medians: network, edge, cloud, serialization).

Because baselines and split runs interleave within each repeat, their ratios are measured side by
side; the report gives medians and paired ratios, never a lone absolute time.

Definitions (per run):

* ``e2e tok/s`` = new tokens / wall time of the whole generation, prefill included.
* ``decode tok/s`` = tokens produced by decode steps / (wall time − prefill steps' time). The first
  token comes from the prefill's logits, so decode steps produce ``new_tokens − 1`` tokens.
* ``accepted/step`` = (new tokens − 1) / decode steps: exactly 1 for sequential decoding, the mean
  tokens committed per round trip for speculative modes.
* per-step breakdown: medians over decode steps of network (round trip minus the cloud's reported
  compute), edge compute, cloud compute and edge-side serialization, and bytes each way.

Decoding modes are looked up in :data:`splitspec.bench.modes.MODES` (name -> async runner); speculative modes register
there. Split greedy output is checked token for token against the ``hf_generate`` baseline (or, when that
one is off, the ``local_loop`` baseline; each record names its reference). Every baseline and split run stops
at the checkpoint's stop tokens (config.json's and generation_config.json's, as the edge does).

Each recorded split run starts from a fresh speculation controller: acceptance estimates learnt on one prompt
must not steer the next one's drafting (per-prompt results would depend on the prompts' order). The link's
step-time estimates, shared by every sequence on a link by design, are kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, cast

import torch
from tqdm import tqdm

from splitspec.bench.modes import BASELINES, MODES, reference_baseline
from splitspec.bench.probe import measure_pings
from splitspec.bench.prompts import Prompt, TokenizerLike, build_prompts
from splitspec.bench.records import RunRecord, baseline_record, split_record
from splitspec.bench.report import write_markdown, write_plots
from splitspec.bench.scenario import Scenario, check_paths
from splitspec.bench.summary import summarize
from splitspec.cloud.config import CloudConfig
from splitspec.cloud.server import TrunkServer
from splitspec.devices import resolve_device
from splitspec.edge import EdgeConfig, GenerationResult, SplitClient
from splitspec.exceptions import ConfigError
from splitspec.measure import median
from splitspec.models.checkpoint import Checkpoint, generation_stop_ids
from splitspec.models.loading import resolve_dtype
from splitspec.netem.emulator import WanEmulator
from splitspec.netem.schedule import NetemConfig
from splitspec.run_info import run_environment, write_jsonl_gz

__all__ = ["RUNS_FILE", "LocalBaselines", "run_benchmark"]

#: The per-run records of one benchmark, one JSON object per line, gzip-compressed.
RUNS_FILE = "runs.jsonl.gz"

log = logging.getLogger(__name__)

_CPU = torch.device("cpu")

_COMPONENTS = ("network_ms", "edge_ms", "cloud_ms", "serialize_ms")


# -- local baselines -------------------------------------------------------------------------------


class LocalBaselines:
    """The whole model in this process, generating with transformers (greedy).

    Generation stops at :func:`~splitspec.models.checkpoint.generation_stop_ids`: config.json's
    ``eos_token_id`` and generation_config.json's (an instruct checkpoint lists its end-of-turn
    tokens there), the same stops as the split runs'."""

    def __init__(
        self, model_dir: Path, dtype: torch.dtype, prompt_lookup_num_tokens: int, device: torch.device = _CPU
    ) -> None:
        from transformers import AutoModelForCausalLM

        self.device = device
        model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, local_files_only=True)
        self.model = model.to(device).eval()
        config = self.model.config
        self.stop_ids = generation_stop_ids(model_dir, config)
        eos = getattr(config, "eos_token_id", None)
        first = eos if isinstance(eos, int) else (eos[0] if eos else None)
        self.pad_token_id = int(first if first is not None else min(self.stop_ids, default=0))
        # passed to generate() always: it replaces generation_config.json's list, so it must be the union
        self.eos_token_id: list[int] | None = sorted(self.stop_ids) or None
        self.prompt_lookup_num_tokens = prompt_lookup_num_tokens

    def generate(self, mode: str, prompt_ids: Sequence[int], max_new_tokens: int) -> tuple[list[int], float]:
        """Generate with ``mode`` (a BASELINES name) -> (new token ids, wall seconds)."""
        input_ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=self.device)
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
        stops = self.stop_ids
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.model(input_ids=input_ids, use_cache=True)
            token = int(out.logits[0, -1].argmax())
            tokens = [token]
            while len(tokens) < max_new_tokens and token not in stops:
                ids = torch.tensor([[token]], device=self.device)  # (1, 1)
                out = self.model(input_ids=ids, past_key_values=out.past_key_values, use_cache=True)
                token = int(out.logits[0, -1].argmax())
                tokens.append(token)
        return tokens, time.perf_counter() - t0


# -- the run -----------------------------------------------------------------------------------------


def _rtt_order(rtts: Sequence[float], repeat: int) -> list[float]:
    ordered = sorted(rtts)
    return ordered if repeat % 2 == 0 else ordered[::-1]


def fresh_controller(client: SplitClient) -> None:
    """Make ``client``'s next generation learn its speculation estimates from nothing.

    The engine would otherwise keep the sequence's controller (a chat's turns share it) and seed a new
    one from its engine-wide estimates: either way what one prompt taught would steer the next. Both are
    dropped; the engine's step times (the link's and the trunk's, not the prompt's) stay."""
    client.engine.forget_acceptance()
    client.sequence.controller = None


async def run_split(client: SplitClient, mode: str, prompt_ids: Sequence[int], max_new_tokens: int) -> GenerationResult:
    """One recorded split run of ``mode``, from a fresh speculation controller (see :func:`fresh_controller`)."""
    fresh_controller(client)
    return await MODES[mode](client, prompt_ids, max_new_tokens)


def check_tokens(records: Sequence[RunRecord], reference_mode: str | None) -> None:
    """Mark every run token-identical or not to ``reference_mode``'s run of the same prompt (first repeat)."""
    if reference_mode is None:
        return
    reference: dict[str, list[int]] = {}
    for rec in records:
        if rec.mode == reference_mode:
            reference.setdefault(rec.prompt_id, rec.token_ids)
    for rec in records:
        ref = reference.get(rec.prompt_id)
        if ref is not None and rec.mode != reference_mode:
            rec.matches_hf_generate = rec.token_ids == ref
            rec.token_reference = reference_mode
            if rec.is_split and not rec.matches_hf_generate:
                log.warning("%s: split tokens differ from %s", rec.run_id, reference_mode)


async def _run(scenario: Scenario, prompts: list[Prompt], records: list[RunRecord], bar: tqdm[Any]) -> None:
    """Baselines and split runs, interleaved by repeat; appends to ``records``."""
    sc = scenario
    enabled = {
        "hf_generate": sc.baselines.hf_generate,
        "hf_prompt_lookup": sc.baselines.prompt_lookup,
        "local_loop": sc.baselines.local_loop,
    }
    baselines = [m for m in BASELINES if enabled[m]]
    device = resolve_device(sc.device)
    dtype, _ = resolve_dtype(Checkpoint(sc.model_dir), sc.dtype, device, "local baseline")
    local = LocalBaselines(sc.model_dir, dtype, sc.baselines.prompt_lookup_num_tokens, device) if baselines else None
    if local is not None:
        for mode in baselines:  # warm-up, not recorded
            local.generate(mode, prompts[0].token_ids, min(8, sc.max_new_tokens))

    cloud = CloudConfig(model_dir=sc.model_dir, edge_layers=sc.edge_layers, port=0, dtype=sc.dtype, device=sc.device)
    edge_model = None
    async with TrunkServer(cloud) as server:
        for repeat in range(sc.repeats):
            if local is not None:
                for prompt in prompts:
                    for mode in baselines:
                        tokens, wall = local.generate(mode, prompt.token_ids, sc.max_new_tokens)
                        records.append(baseline_record(mode, tokens, wall, prompt, repeat))
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
                        wire_codec=sc.wire_codec,
                        device=sc.device,
                        draft_model_dir=sc.draft_model_dir,
                    )
                    async with SplitClient(edge_cfg, edge=edge_model) as client:
                        edge_model = client.model
                        pings = await measure_pings(url, client.hello, sc.pings)
                        measured = median(pings)
                        bar.set_postfix_str(f"rtt {rtt:g} ms (measured {measured:.1f})")
                        await MODES[sc.modes[0]](client, prompts[0].token_ids, 4)  # warm-up, not recorded
                        for mode in sc.modes:
                            for prompt in prompts:
                                result = await run_split(client, mode, prompt.token_ids, sc.max_new_tokens)
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
    check_tokens(records, reference_baseline(baselines))


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
        environment = run_environment()
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
        stamp = {"commit": environment["commit"], "splitspec": environment["splitspec"]}
        write_jsonl_gz(out_dir / RUNS_FILE, (asdict(rec) for rec in records), **stamp)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out_dir / "summary.md").write_text(write_markdown(summary))
    write_plots(summary, out_dir)
    log.info("benchmark %s done in %.1f s", scenario.name, environment["wall_s"])
    return summary


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
