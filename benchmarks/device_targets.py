"""Benchmark: the device targets of issue 14, side by side in one run on one device.

Three figures, each a median over interleaved repeats (>= 3), with the ratio the issue targets:

  1. split vs whole: greedy tok/s of the split model (edge + trunk server in this process, over
     loopback, zero added RTT, speculation off: one round trip per token) against transformers
     ``generate`` of the whole model on the same device (target >= 0.9 on a model with hidden size
     >= 2048); with ``--split-compile MODE`` also the split
     with the trunk's and the edge's decode steps compiled over static KV buffers (``auto``: CUDA graphs on
     CUDA), interleaved with the others: on the H200 (2026-12-04) the eager split ran at 0.51x, each side
     launch bound;
  2. framework overhead per step for a (1, 1, width) hidden state in the compute dtype: the host
     copies both ways on both sides, frame encode/decode and the loopback WebSocket round trip to
     an echo server, with no model compute (target <= 1 ms at width 4096 in bfloat16);
  3. trunk step vs bare transformers: one decode step of the trunk's layers (``LayerStack`` with
     our KV cache) against transformers' own model of the same layers and weights with its
     ``DynamicCache``, at batch 1 after a prefill (target <= 1.2x). The host-side launch time of
     our step (returning before the device finishes) is reported too: it is the per-step Python
     overhead that a fast accelerator exposes.

Shapes: ``--shape llama-3.2-1b`` (hidden 2048, 16 layers, GQA 32/8, vocab 128256, random weights)
for the GPU; ``--shape tiny`` (hidden 256, 8 layers) runs anywhere in seconds.

    python benchmarks/device_targets.py --device cuda --dtype bfloat16 --shape llama-3.2-1b --split-compile auto
    python benchmarks/device_targets.py --device cpu --dtype float32 --shape tiny --repeats 3

Writes device_targets.json, device_targets.md and device_targets.png into --out
(default benchmarks/results/device_targets/<device type>-<shape>-<dtype>).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, LlamaModel

from splitspec.cloud.config import CloudConfig
from splitspec.cloud.server import TrunkServer
from splitspec.decoding.sampling import SamplingParams
from splitspec.devices import HostStaging, resolve_device, synchronize
from splitspec.edge import EdgeConfig, SplitClient
from splitspec.models.checkpoint import Checkpoint
from splitspec.models.compile_modes import COMPILE_MODES
from splitspec.models.kv_cache import KVCache
from splitspec.models.loading import load_trunk
from splitspec.models.precision import dtype_from_name
from splitspec.models.split import SplitPlan
from splitspec.models.stack import LayerStack
from splitspec.models.static_kv import StaticKVCache
from splitspec.protocol.messages import Step, StepResult, decode_message, encode_message
from splitspec.run_info import run_environment
from splitspec.transport.client import Channel
from splitspec.transport.server import ConnectionLimits, FrameServer

log = logging.getLogger("bench.device_targets")

SHAPES: dict[str, dict[str, Any]] = {
    # Llama 3.2 1B dimensions (config.json of meta-llama/Llama-3.2-1B), random weights
    "llama-3.2-1b": dict(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=4096,
        rope_theta=500000.0,
        tie_word_embeddings=True,
    ),
    "tiny": dict(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=2048,
    ),
}
EDGE_LAYERS = (2, 2)


def build_checkpoint(directory: Path, shape: str, dtype: torch.dtype, device: torch.device) -> None:
    """A random checkpoint of ``shape``, initialised on ``device`` (fast for 1B parameters) and saved."""
    torch.manual_seed(0)
    config = LlamaConfig(**SHAPES[shape], eos_token_id=None, bos_token_id=0, pad_token_id=None)
    with device:
        model: Any = LlamaForCausalLM(config)
        model = model.to(dtype).eval()
    model.save_pretrained(directory)
    del model


def whole_model(directory: Path, dtype: torch.dtype, device: torch.device) -> Any:
    model: Any = LlamaForCausalLM.from_pretrained(directory, dtype=dtype)
    return model.to(device).eval()


def hf_generate(model: Any, prompt: list[int], n: int, device: torch.device) -> tuple[float, list[int]]:
    ids = torch.tensor([prompt], device=device)
    synchronize(device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    tokens = out[0, len(prompt) :].tolist()  # waits for the device
    return n / (time.perf_counter() - t0), tokens


SPECULATE = "off"  # one round trip per token, as the whole model's plain greedy ``generate``: no speculation gains


async def split_generate(client: SplitClient, prompt: list[int], n: int) -> tuple[float, list[int], dict[str, Any]]:
    result = await client.generate(prompt, n, SamplingParams(), stop_token_ids=(), speculate=SPECULATE)
    return len(result.token_ids) / result.wall_s, result.token_ids, result.summary()


def divergence(
    model: Any, prompt: list[int], whole: list[int], split: list[int], device: torch.device
) -> dict[str, Any]:
    """Where two greedy continuations first differ, and the whole model's logit gap there between its token and
    the split's: a gap within the dtype's rounding (bfloat16 on random weights, whose top logits are near ties)
    is a tie broken differently, not a wrong split."""
    i = next(j for j, (a, b) in enumerate(zip(whole, split, strict=False)) if a != b)
    ids = torch.tensor([prompt + whole[:i]], device=device)
    with torch.inference_mode():
        logits = model(ids).logits[0, -1].float()  # (V,)
    top2 = torch.topk(logits, 2).values
    return {
        "index": i,
        "whole_token": whole[i],
        "split_token": split[i],
        "gap_to_split_token": float(logits[whole[i]] - logits[split[i]]),
        "top2_gap": float(top2[0] - top2[1]),
        "top_logit": float(top2[0]),
    }


async def split_vs_whole(
    directory: Path,
    dtype_name: str,
    device: torch.device,
    prompt: list[int],
    n: int,
    repeats: int,
    compile_mode: str | None = None,
    compile_backend: str = "inductor",
) -> dict[str, Any]:
    """Whole model against the split, eager, and with ``compile_mode`` also the split with the trunk's and the
    edge's decode steps compiled over static KV buffers (CUDA graphs with ``auto`` on CUDA), interleaved."""
    dtype = dtype_from_name(dtype_name)
    whole = whole_model(directory, dtype, device)
    common: dict[str, Any] = {
        "model_dir": directory,
        "dtype": dtype_name,
        "device": str(device),
        "edge_layers": EDGE_LAYERS,
    }
    compiled: dict[str, Any] = {"compile": compile_mode, "compile_backend": compile_backend}
    compiled["max_cache_tokens"] = len(prompt) + n + 8  # static KV: the prompt, the answer and a margin
    whole_tps, split_tps, ratios, identical = [], [], [], []
    summaries: list[dict[str, Any]] = []
    compiled_tps: list[float] = []
    compiled_summaries: list[dict[str, Any]] = []
    compiled_error: str | None = None  # the compiled split's failure, reported rather than losing the other figures
    divergences: list[dict[str, Any]] = []
    async with contextlib.AsyncExitStack() as stack:
        server = await stack.enter_async_context(TrunkServer(CloudConfig(port=0, **common)))
        edge = EdgeConfig(allow_stock_edge_weights=True, cloud_url=server.url, **common)
        client = await stack.enter_async_context(SplitClient(edge))
        compiled_client: SplitClient | None = None
        # warm-up, every side, as long as a timed run: on the H200 a 4-token warm-up left the first repeat at
        # 14 (whole) and 6 (split) tok/s against 66-91 and 15-50 later (clocks and kernels still cold)
        hf_generate(whole, prompt, n, device)
        await split_generate(client, prompt, n)
        if compile_mode is not None:  # one session at a time, each decode step alone: no batching
            try:
                cloud = CloudConfig(port=0, batching=False, **common, **compiled)
                compiled_server = await stack.enter_async_context(TrunkServer(cloud))
                edge = EdgeConfig(allow_stock_edge_weights=True, cloud_url=compiled_server.url, **common, **compiled)
                compiled_client = await stack.enter_async_context(SplitClient(edge))
                await split_generate(compiled_client, prompt, n)  # warm-up, and the compiles
            except Exception as exc:  # a compiler's failure: keep every other figure of the run, and say why
                log.exception("the compiled split failed; the report carries the error")
                compiled_error, compiled_client = f"{type(exc).__name__}: {exc}", None
        for r in range(repeats):
            wt, wtoks = hf_generate(whole, prompt, n, device)
            st, stoks, summary = await split_generate(client, prompt, n)
            whole_tps.append(wt)
            split_tps.append(st)
            ratios.append(st / wt)
            summaries.append(summary)
            identical.append(stoks == wtoks)
            log.info("repeat %d: whole %.1f tok/s, split %.1f tok/s, identical %s", r, wt, st, stoks == wtoks)
            if stoks != wtoks:
                divergences.append(divergence(whole, prompt, wtoks, stoks, device))
                log.info("repeat %d: first divergence %s", r, divergences[-1])
            if compiled_client is not None:
                ct, ctoks, compiled_summary = await split_generate(compiled_client, prompt, n)
                compiled_summaries.append(compiled_summary)
                compiled_tps.append(ct)
                identical.append(ctoks == wtoks)
                log.info("repeat %d: split compiled %.1f tok/s, identical %s", r, ct, ctoks == wtoks)
                if ctoks != wtoks:
                    divergences.append(divergence(whole, prompt, wtoks, ctoks, device))
    del whole

    def med(key: str) -> float:
        return float(statistics.median(s["median_step_ms"][key] for s in summaries))

    return {
        "whole_tok_s": whole_tps,
        "split_tok_s": split_tps,
        "ratio": ratios,
        "ratio_median": statistics.median(ratios),
        "whole_tok_s_median": statistics.median(whole_tps),
        "split_tok_s_median": statistics.median(split_tps),
        "greedy_tokens_identical": identical,
        "divergences": divergences,
        "split_step_ms_median": {k: med(k) for k in ("network_ms", "edge_ms", "cloud_ms", "serialize_ms")},
        "speculate": sorted({s["speculate"] for s in summaries + compiled_summaries}),
        "split_tokens_per_decode_step": [s["tokens_per_decode_step"] for s in summaries],
        "compiled_split_tokens_per_decode_step": [s["tokens_per_decode_step"] for s in compiled_summaries],
        "compile_mode": compile_mode,
        "compiled_split_error": compiled_error,
        "compiled_split_tok_s": compiled_tps,
        "compiled_ratio_median": (
            statistics.median(c / w for c, w in zip(compiled_tps, whole_tps, strict=True)) if compiled_tps else None
        ),
    }


class _EchoPeer:
    """The server's side of a step without a model: decode, copy to the device and back, encode."""

    ready = True  # no handshake: the echo measures steps only
    concurrent = False  # one frame at a time, as an edge session sends them

    def __init__(self, staging: HostStaging) -> None:
        self.staging = staging

    async def handle(self, data: bytes) -> tuple[bytes, bool]:
        step = decode_message(data)
        if not isinstance(step, Step):
            raise TypeError("expected a step")
        on_device = self.staging.to_device(step.hidden)
        back = self.staging.to_host(on_device)
        return encode_message(StepResult(session_id=step.session_id, seq=step.seq, hidden=back, cloud_ms=0.0)), False

    async def closed(self) -> None:
        return None


async def framework_overhead(width: int, dtype: torch.dtype, device: torch.device, trips: int) -> dict[str, Any]:
    """Per step, no compute: edge copy to host, encode, WebSocket loopback, server copies, decode, copy back."""
    staging = HostStaging(device)
    hidden = torch.randn(1, 1, width, device=device).to(dtype)  # (1, 1, H)
    positions, parents = torch.tensor([100], dtype=torch.int32), torch.tensor([-1], dtype=torch.int32)
    limits = ConnectionLimits(handshake_max_bytes=1 << 22)  # the first frame is a step already
    server = FrameServer(lambda remote: _EchoPeer(staging), "127.0.0.1", 0, 1 << 22, None, limits)
    await server.start()
    channel = await Channel.connect(f"ws://127.0.0.1:{server.port}", max_message_bytes=1 << 22, timeout_s=5)
    copies, codec, trips_ms = [], [], []
    try:
        for i in range(trips + 20):  # the first 20 warm up
            synchronize(device)
            t0 = time.perf_counter()
            host = staging.to_host(hidden)
            t1 = time.perf_counter()
            step = Step("s", i + 1, host, positions, parents)
            reply, exchange = await channel.request(step, 5)
            assert isinstance(reply, StepResult)
            t2 = time.perf_counter()
            back = staging.to_device(reply.hidden)
            synchronize(device)
            t3 = time.perf_counter()
            if i >= 20:
                copies.append(((t1 - t0) + (t3 - t2)) * 1e3)
                codec.append(exchange.encode_ms + exchange.decode_ms)
                trips_ms.append((t3 - t0) * 1e3)
        assert torch.equal(back, hidden)
    finally:
        await channel.close()
        await server.stop()
    return {
        "width": width,
        "dtype": str(dtype).removeprefix("torch."),
        "frame_bytes": len(encode_message(Step("s", 1, hidden.cpu(), positions, parents))),
        "edge_copies_ms_median": statistics.median(copies),
        "edge_codec_ms_median": statistics.median(codec),
        "step_overhead_ms_median": statistics.median(trips_ms),
        "step_overhead_ms_p90": sorted(trips_ms)[int(0.9 * len(trips_ms))],
        "trips": trips,
    }


def _time_steps(step: Callable[[], Any], device: torch.device, n: int) -> tuple[list[float], list[float]]:
    """(launch ms, synced ms) of ``n`` calls of ``step``."""
    launch, total = [], []
    for _ in range(n):
        synchronize(device)
        t0 = time.perf_counter()
        step()
        t1 = time.perf_counter()
        synchronize(device)
        t2 = time.perf_counter()
        launch.append((t1 - t0) * 1e3)
        total.append((t2 - t0) * 1e3)
    return launch, total


VARIANTS = ("growable", "static", "compiled")  # our trunk step: growable KV / static KV (fixed shape) / compiled


def trunk_and_transformers(
    directory: Path, dtype: torch.dtype, device: torch.device, context: int
) -> tuple[LayerStack, Any, LlamaConfig, torch.Tensor, torch.Tensor]:
    """The checkpoint's trunk layers, transformers' own model of the same layers (a LlamaModel of that many
    layers with the trunk's weights) and its config, a random ``context``-token prefix (1, C, H) and a step's
    token (1, 1, H), on ``device``."""
    ckpt = Checkpoint(directory)
    plan = SplitPlan(ckpt.config.num_hidden_layers, *EDGE_LAYERS)
    trunk = load_trunk(ckpt, plan, dtype, devices=(device,))
    hf_config = LlamaConfig(**{**ckpt.config.to_dict(), "num_hidden_layers": len(plan.trunk_layers)})
    hf_config._attn_implementation = "sdpa"
    with device:
        hf: Any = LlamaModel(hf_config)
        hf = hf.to(dtype).eval()
    state = {f"layers.{j}.{k}": v for j, layer in enumerate(trunk.layers) for k, v in layer.state_dict().items()}
    hf.load_state_dict(state, strict=False)  # embed_tokens and the final norm are unused/identity-like extras
    hidden_size = int(ckpt.config.hidden_size)
    gen = torch.Generator().manual_seed(0)
    prefix = (torch.randn(1, context, hidden_size, generator=gen) * 0.5).to(device, dtype)  # (1, C, H)
    token = (torch.randn(1, 1, hidden_size, generator=gen) * 0.5).to(device, dtype)  # (1, 1, H)
    return trunk, hf, hf_config, prefix, token


def trunk_step(stack: LayerStack, cache: KVCache, prefix: torch.Tensor, token: torch.Tensor) -> Callable[[], Any]:
    """Our decode step of ``token`` (1, 1, H) on ``stack`` after ``prefix`` (1, C, H) in ``cache``, which every
    call leaves at C entries (so every timed step sees the same context); positions stay on the host."""
    context = prefix.shape[1]
    stack(prefix, torch.arange(context, dtype=torch.int32), torch.arange(-1, context - 1, dtype=torch.int32), cache)
    pos = torch.tensor([context], dtype=torch.int32)
    parent = torch.tensor([-1], dtype=torch.int32)

    def step() -> Any:
        out = stack(token, pos, parent, cache)
        cache.truncate(context)  # every timed step sees the same context
        return out

    return step


def transformers_step(hf: Any, hf_config: Any, prefix: torch.Tensor, token: torch.Tensor) -> Callable[[], Any]:
    """transformers' decode step of ``token`` (1, 1, H) after ``prefix`` (1, T, H) with its DynamicCache, which
    every call leaves at T entries (so every timed step sees the same context)."""
    context = prefix.shape[1]
    hf_cache = DynamicCache(config=hf_config)
    with torch.inference_mode():
        hf(inputs_embeds=prefix, past_key_values=hf_cache, use_cache=True)
    hf_pos = torch.tensor([[context]], device=prefix.device)

    def bare() -> Any:
        with torch.inference_mode():
            out = hf(inputs_embeds=token, position_ids=hf_pos, past_key_values=hf_cache, use_cache=True)
        hf_cache.crop(-1)  # transformers 5: crop(-n) drops the last n tokens
        return out

    return bare


def trunk_vs_transformers(
    directory: Path,
    dtype: torch.dtype,
    device: torch.device,
    context: int,
    steps: int,
    repeats: int,
    cache_tokens: int,
    compile_mode: str,
    compile_backend: str = "inductor",
) -> dict[str, Any]:
    """One decode step of the trunk's layers, transformers' model of those layers against ours in
    three variants, interleaved: growable KVCache (eager), static KV buffers through the fixed-shape
    step (eager), and that step compiled (``compile_mode``, by ``compile_backend``)."""
    trunk, hf, hf_config, prefix, token = trunk_and_transformers(directory, dtype, device, context)
    n_layers = len(trunk.layers)
    fns: dict[str, Callable[[], Any]] = {"growable": trunk_step(trunk, KVCache(), prefix, token)}
    static = LayerStack(trunk._skeleton, trunk.layer_indices).eval()  # the same modules
    static.enable_fixed_decode()
    fns["static"] = trunk_step(static, StaticKVCache(cache_tokens), prefix, token)
    compiled = LayerStack(trunk._skeleton, trunk.layer_indices).eval()
    compile_s = compiled.enable_fixed_decode(compile_mode, compile_backend).warm_up(cache_tokens)
    fns["compiled"] = trunk_step(compiled, StaticKVCache(cache_tokens), prefix, token)
    outs = {name: fn() for name, fn in fns.items()}
    max_diff = {name: float((out.float() - outs["growable"].float()).abs().max()) for name, out in outs.items()}

    fns["transformers"] = transformers_step(hf, hf_config, prefix, token)
    step_ms: dict[str, list[float]] = {name: [] for name in fns}
    launch_ms: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():  # warm-up
        _time_steps(fn, device, 5)
    for _ in range(repeats):
        for name, fn in fns.items():  # interleaved: every variant once per repeat
            launch, total = _time_steps(fn, device, steps)
            step_ms[name].append(statistics.median(total))
            launch_ms[name].append(statistics.median(launch))
    ratios = {v: [a / b for a, b in zip(step_ms[v], step_ms["transformers"], strict=True)] for v in VARIANTS}
    return {
        "trunk_layers": n_layers,
        "context_tokens": context,
        "static_cache_tokens": cache_tokens,
        "compile_mode": compiled.fixed_decode.mode if compiled.fixed_decode else None,
        "compile_backend": compile_backend,
        "compile_s": compile_s,
        "max_abs_diff_vs_growable": max_diff,
        "step_ms": step_ms,
        "launch_ms": launch_ms,
        "ratio_vs_transformers": ratios,
        "step_ms_median": {k: statistics.median(v) for k, v in step_ms.items()},
        "launch_ms_median": {k: statistics.median(v) for k, v in launch_ms.items()},
        "ratio_median": {k: statistics.median(v) for k, v in ratios.items()},
    }


_VARIANT_TEXT = {
    "growable": "growable KV, eager",
    "static": "static KV, fixed-shape step, eager",
    "compiled": "static KV, fixed-shape step compiled",
}


def write_report(results: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "device_targets.json").write_text(json.dumps(results, indent=2))
    sv, fo, tr = results["split_vs_whole"], results["framework_overhead"], results["trunk_vs_transformers"]
    md = [
        f"# Device targets: {results['device_name']}, {results['shape']} ({results['dtype']})",
        "",
        f"Commit `{results['commit']}`, torch {results['torch']}; {results['repeats']} interleaved repeats, medians.",
        "",
        "| figure | value | target |",
        "|---|---|---|",
        f"| whole model, HF generate, tok/s | {sv['whole_tok_s_median']:.1f} | |",
        f"| split at zero added RTT, tok/s | {sv['split_tok_s_median']:.1f} | |",
        *(
            [
                f"| split speculation, tokens per decode step (median) | {', '.join(sv['speculate'])}, "
                f"{statistics.median(sv['split_tokens_per_decode_step']):.2f} | off, 1.00 |"
            ]
            if sv.get("speculate")
            else []
        ),
        f"| split / whole ratio | {sv['ratio_median']:.3f} | >= 0.9 (hidden >= 2048) |",
        *(
            [
                f"| split compiled ({sv['compile_mode']}: trunk, head and tail over static KV), tok/s"
                f" | {statistics.median(sv['compiled_split_tok_s']):.1f} | |",
                f"| split compiled / whole ratio | {sv['compiled_ratio_median']:.3f} | >= 0.9 (hidden >= 2048) |",
            ]
            if sv.get("compiled_split_tok_s")
            else []
        ),
        *([f"| split compiled: failed ({sv['compiled_split_error']}) | | |"] if sv.get("compiled_split_error") else []),
        f"| greedy tokens identical in every repeat (every split) | {all(sv['greedy_tokens_identical'])} | True |",
        *(
            f"| repeat's first divergence: token {d['index']}, whole's logit gap to the split's token "
            f"{d['gap_to_split_token']:.4f} (top-2 gap {d['top2_gap']:.4f}, top logit {d['top_logit']:.3f}) | | |"
            for d in sv.get("divergences", [])
        ),
        *[f"| split step {k}, median | {v:.3f} ms | |" for k, v in sv["split_step_ms_median"].items()],
        f"| framework overhead per step, {fo['width']}-wide {fo['dtype']} | {fo['step_overhead_ms_median']:.3f} ms"
        f" (p90 {fo['step_overhead_ms_p90']:.3f}) | <= 1 ms |",
        f"| of which the edge's host copies | {fo['edge_copies_ms_median']:.3f} ms | |",
        f"| of which the edge's encode + decode | {fo['edge_codec_ms_median']:.3f} ms | |",
        f"| transformers, same {tr['trunk_layers']} layers, decode step at context {tr['context_tokens']}"
        f" | {tr['step_ms_median']['transformers']:.3f} ms | |",
        *[
            f"| ours, {v} ({_VARIANT_TEXT[v]}): step / host launch / ratio to transformers"
            f" | {tr['step_ms_median'][v]:.3f} ms / {tr['launch_ms_median'][v]:.3f} ms / {tr['ratio_median'][v]:.3f}"
            f" | <= 1.2 |"
            for v in VARIANTS
        ],
        f"| compile time (mode {tr['compile_mode']}, backend {tr['compile_backend']}), static KV of"
        f" {tr['static_cache_tokens']} entries"
        f" | {tr['compile_s']:.1f} s | |",
        "",
        f"Reproduce: `python benchmarks/device_targets.py {results['argv']}`",
    ]
    (out / "device_targets.md").write_text("\n".join(md) + "\n")
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    axes[0].bar(["whole (HF)", "split"], [sv["whole_tok_s_median"], sv["split_tok_s_median"]], color=["C0", "C1"])
    axes[0].set_ylabel("tok/s (median)")
    axes[0].set_title(f"zero RTT, ratio {sv['ratio_median']:.2f}")
    axes[1].bar(
        ["host copies", "encode+decode", "whole step"],
        [fo["edge_copies_ms_median"], fo["edge_codec_ms_median"], fo["step_overhead_ms_median"]],
        color=["C2", "C3", "C4"],
    )
    axes[1].axhline(1.0, color="k", ls="--", lw=1, label="1 ms target")
    axes[1].set_ylabel("ms per step (median)")
    axes[1].set_title(f"framework overhead, {fo['width']}-wide {fo['dtype']}")
    axes[1].legend()
    names = ["transformers", *VARIANTS]
    axes[2].bar(names, [tr["step_ms_median"][n] for n in names], color=["C0", "C1", "C2", "C3"], label="step")
    axes[2].bar(names, [tr["launch_ms_median"][n] for n in names], color="k", alpha=0.35, width=0.4, label="launch")
    axes[2].set_ylabel("ms per decode step (median)")
    axes[2].set_title(f"trunk step, compiled / transformers {tr['ratio_median']['compiled']:.2f}")
    axes[2].legend()
    fig.suptitle(f"{results['device_name']} · {results['shape']} · {results['dtype']}")
    fig.tight_layout()
    fig.savefig(out / "device_targets.png", dpi=110)
    plt.close(fig)
    print("\n".join(md))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N or mps")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--shape", default="llama-3.2-1b", choices=sorted(SHAPES))
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats (>= 3)")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens per generation")
    parser.add_argument("--trips", type=int, default=300, help="timed steps of the overhead figure")
    parser.add_argument("--width", type=int, default=4096, help="hidden width of the overhead figure")
    parser.add_argument("--context", type=int, default=512, help="prefix before the timed trunk steps")
    parser.add_argument("--steps", type=int, default=50, help="timed trunk steps per repeat")
    parser.add_argument(
        "--cache-tokens", type=int, default=1024, help="static KV buffer size of the static/compiled trunk steps"
    )
    parser.add_argument(
        "--compile", default="auto", choices=COMPILE_MODES, help="torch.compile mode of the compiled trunk step"
    )
    parser.add_argument(
        "--trunk-compile-backend",
        default="inductor",
        help="torch.compile backend of the compiled trunk step (default inductor; eager: capture only, for tests)",
    )
    parser.add_argument(
        "--split-compile",
        choices=COMPILE_MODES,
        help="also time the split with the trunk's and the edge's decode steps compiled in this mode (default: not)",
    )
    parser.add_argument(
        "--compile-backend", default="inductor", help="torch.compile backend of --split-compile (eager: capture only)"
    )
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--out", type=Path, help="output folder")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("splitspec").setLevel(logging.WARNING)
    if args.repeats < 3:
        raise SystemExit("--repeats must be at least 3 (medians of interleaved repeats)")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    dtype = dtype_from_name(args.dtype)
    out = args.out or Path("benchmarks/results/device_targets") / f"{device.type}-{args.shape}-{args.dtype}"
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        log.info("building a random %s checkpoint (%s) on %s", args.shape, args.dtype, device)
        build_checkpoint(directory, args.shape, dtype, device)
        vocab = int(SHAPES[args.shape]["vocab_size"])
        prompt = torch.randint(0, vocab, (32,), generator=torch.Generator().manual_seed(1)).tolist()
        split = asyncio.run(
            split_vs_whole(
                directory,
                args.dtype,
                device,
                prompt,
                args.new_tokens,
                args.repeats,
                args.split_compile,
                args.compile_backend,
            )
        )
        overhead = asyncio.run(framework_overhead(args.width, dtype, device, args.trips))
        trunk = trunk_vs_transformers(
            directory,
            dtype,
            device,
            args.context,
            args.steps,
            args.repeats,
            args.cache_tokens,
            args.compile,
            args.trunk_compile_backend,
        )
    results = {
        **run_environment(),
        "argv": shlex.join(sys.argv[1:] if argv is None else argv),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
        "torch": torch.__version__,
        "shape": args.shape,
        "model": SHAPES[args.shape],
        "dtype": args.dtype,
        "edge_layers": list(EDGE_LAYERS),
        "repeats": args.repeats,
        "new_tokens": args.new_tokens,
        "split_vs_whole": split,
        "framework_overhead": overhead,
        "trunk_vs_transformers": trunk,
    }
    write_report(results, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
