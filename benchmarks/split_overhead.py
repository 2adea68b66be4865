"""Benchmark: split inference at zero added RTT vs the same model whole in one process.

Measures, side by side in one run (interleaved repeats, medians):
  * tok/s of greedy generation: HF ``generate`` on the whole model vs splitspec's edge + a trunk
    server in another process over loopback, speculation off (target ratio >= 0.85);
  * per-step framework overhead for a 4096-wide fp16 hidden state: frame encode + decode alone,
    and a full loopback round trip through the real WebSocket transport to a server that decodes
    the step and replies with a StepResult (no model compute) (target <= 1 ms).

    python benchmarks/split_overhead.py [--out benchmarks/results] [--repeats 5] [--new-tokens 64]

Writes split_overhead.json and split_overhead.md into --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from splitspec.decoding.sampling import SamplingParams
from splitspec.demo import free_port
from splitspec.edge import EdgeConfig, SplitClient
from splitspec.protocol.messages import Step, StepResult, decode_message, encode_message
from splitspec.run_info import run_environment
from splitspec.transport.client import Channel
from splitspec.transport.server import FrameServer

log = logging.getLogger("bench.split_overhead")


def build_model(directory: Path) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=8192,
        hidden_size=512,
        intermediate_size=1376,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=2048,
        eos_token_id=None,
    )
    model = LlamaForCausalLM(config)
    model.eval()
    model.save_pretrained(directory)
    return model


def local_run(model: LlamaForCausalLM, prompt: list[int], n: int) -> tuple[float, list[int]]:
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(  # type: ignore[misc]  # transformers types generate's self as a mixin protocol
            torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False
        )
    wall = time.perf_counter() - t0
    return n / wall, out[0, len(prompt) :].tolist()


class _EchoPeer:
    """Decodes a Step and answers with a StepResult carrying the same hidden state."""

    ready = True  # no handshake
    concurrent = False  # one frame at a time

    async def handle(self, data: bytes) -> tuple[bytes, bool]:
        step = decode_message(data)
        if not isinstance(step, Step):
            raise TypeError("expected a step")
        return encode_message(
            StepResult(session_id=step.session_id, seq=step.seq, hidden=step.hidden, cloud_ms=0.0)
        ), False

    async def closed(self) -> None:
        return None


async def framework_overhead(width: int, trips: int) -> dict[str, float]:
    hidden = torch.randn(1, 1, width).to(torch.float16)
    step = Step("s", 1, hidden, torch.tensor([100], dtype=torch.int32), torch.tensor([-1], dtype=torch.int32))
    codec = []
    for _ in range(trips):
        t0 = time.perf_counter()
        decode_message(encode_message(step))
        codec.append((time.perf_counter() - t0) * 1e3)
    server = FrameServer(lambda remote: _EchoPeer(), "127.0.0.1", 0, 1 << 20)
    await server.start()
    channel = await Channel.connect(f"ws://127.0.0.1:{server.port}", max_message_bytes=1 << 20, timeout_s=5)
    trip = []
    for _ in range(trips):
        t0 = time.perf_counter()
        await channel.request(step, 5)
        trip.append((time.perf_counter() - t0) * 1e3)
    await channel.close()
    await server.stop()
    return {
        "frame_bytes": len(encode_message(step)),
        "codec_ms_median": statistics.median(codec),
        "roundtrip_ms_median": statistics.median(trip),
        "roundtrip_ms_p90": sorted(trip)[int(0.9 * len(trip))],
    }


SPECULATE = "off"  # one round trip per token, as the whole model's plain greedy ``generate``: no speculation gains


async def split_runs(model_dir: Path, url: str, prompt: list[int], n: int) -> tuple[float, list[int], dict[str, Any]]:
    async with SplitClient(EdgeConfig(allow_stock_edge_weights=True, model_dir=model_dir, cloud_url=url)) as client:
        result = await client.generate(prompt, n, SamplingParams(), stop_token_ids=(), speculate=SPECULATE)
    return len(result.token_ids) / result.wall_s, result.token_ids, result.summary()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--trips", type=int, default=500)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(1)  # both processes on a shared 2-core machine: one thread each
    work = Path(tempfile.mkdtemp())
    model = build_model(work)
    prompt = torch.randint(0, 8192, (32,), generator=torch.Generator().manual_seed(1)).tolist()
    port = free_port()
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "splitspec.cli",
            "--log-level",
            "WARNING",
            "cloud",
            "serve",
            "--model",
            str(work),
            "--port",
            str(port),
            "--threads",
            "1",
        ],
    )
    try:
        for _ in range(600):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.1)
        url = f"ws://127.0.0.1:{port}"
        asyncio.run(split_runs(work, url, prompt, 4))  # warm-up
        local_run(model, prompt, 4)
        local_tps, split_tps, ratios, summaries = [], [], [], []
        for r in range(args.repeats):
            lt, ltoks = local_run(model, prompt, args.new_tokens)
            st, stoks, summary = asyncio.run(split_runs(work, url, prompt, args.new_tokens))
            if stoks != ltoks:
                raise SystemExit("split output differs from local greedy output")
            local_tps.append(lt)
            split_tps.append(st)
            ratios.append(st / lt)
            summaries.append(summary)
            log.info("repeat %d: local %.1f tok/s, split %.1f tok/s", r, lt, st)
    finally:
        server.terminate()
        server.wait(timeout=30)
    overhead = asyncio.run(framework_overhead(4096, args.trips))

    def med(key: str) -> float:
        return float(statistics.median(s["median_step_ms"][key] for s in summaries))

    results = {
        **run_environment(),
        "model": "random Llama, hidden 512, 8 layers, vocab 8192, float32, edge 2+2",
        "prompt_tokens": len(prompt),
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "local_tok_s_median": statistics.median(local_tps),
        "split_tok_s_median": statistics.median(split_tps),
        "ratio_median": statistics.median(ratios),
        "split_step_ms_median": {k: med(k) for k in ("network_ms", "edge_ms", "cloud_ms", "serialize_ms")},
        "split_bytes_per_step": summaries[0]["median_bytes"],
        "split_speculate": sorted({s["speculate"] for s in summaries}),
        "split_tokens_per_decode_step_median": statistics.median(s["tokens_per_decode_step"] for s in summaries),
        "framework_overhead_4096_fp16": overhead,
        "torch_threads_per_process": 1,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "split_overhead.json").write_text(json.dumps(results, indent=2))
    o = overhead
    md = [
        "# Split inference overhead at zero added RTT",
        "",
        f"Model: {results['model']}; prompt {len(prompt)} tokens, {args.new_tokens} new tokens, greedy; "
        f"{args.repeats} interleaved repeats, medians; one torch thread per process; split with speculation "
        f"{SPECULATE} ({results['split_tokens_per_decode_step_median']:.2f} tokens per decode step).",
        "",
        "| figure | value |",
        "|---|---|",
        f"| local HF generate, tok/s | {results['local_tok_s_median']:.1f} |",
        f"| split (edge + trunk server process, loopback), tok/s | {results['split_tok_s_median']:.1f} |",
        f"| split / local ratio (target >= 0.85) | {results['ratio_median']:.2f} |",
        *[f"| split step {k} (median) | {v:.3f} ms |" for k, v in results["split_step_ms_median"].items()],
        f"| step frame 4096-wide fp16, bytes | {o['frame_bytes']} |",
        f"| encode + decode only | {o['codec_ms_median']:.3f} ms |",
        f"| loopback round trip incl. framing + event loops (target <= 1 ms) | {o['roundtrip_ms_median']:.3f} ms"
        f" (p90 {o['roundtrip_ms_p90']:.3f}) |",
        "",
        "Reproduce: `python benchmarks/split_overhead.py`",
    ]
    (args.out / "split_overhead.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
