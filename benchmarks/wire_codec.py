"""Wire codec benchmark (#25 item 3): what raw, bf16 and int8 cost in bytes, time and output quality.

Link figures: a random Llama of hidden size 1024 (6 layers, split 2,2, float32 on both sides) behind
the WAN emulator (``--rtt-ms``, default 80 ms RTT; ``--mbit``, default 20 Mbit/s per direction), trunk
server and edge in this process:
bytes per token each way, the time to first token of a 2,000-token prompt (its prefill round trip
and the first token), and sequential decode tok/s (32 tokens after a 16-token prompt; decode steps'
time only). Codecs are interleaved within each repeat; medians over repeats.

Quality figures (no server; bench.wire_quality): on the shipped models over held-out text,
teacher-forced top-1 agreement with raw, KL(raw || codec) p99 and max, and greedy agreement on 16
prompts (32 tokens); and a random Llama whose head emits injected massive activations, where int8
with outliers is set beside plain per-token int8 (one scale per token, no outliers).

    python benchmarks/wire_codec.py [--quick] [--repeats 3] [--out benchmarks/results/wire_codec]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, cast

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from splitspec.bench.prompts import TokenizerLike
from splitspec.bench.scenario import ASSETS_DIR, DEFAULT_CORPUS_DIR
from splitspec.bench.wire_quality import (
    Wire,
    codec_wire,
    greedy_agreement,
    heldout_windows,
    per_token_int8,
    teacher_forced,
)
from splitspec.cloud.config import CloudConfig
from splitspec.cloud.server import TrunkServer
from splitspec.edge import EdgeConfig, SplitClient
from splitspec.models.checkpoint import Checkpoint
from splitspec.models.loading import load_full
from splitspec.netem.emulator import WanEmulator
from splitspec.netem.schedule import NetemConfig
from splitspec.protocol.codec import WIRE_CODECS, wire_bytes_per_token
from splitspec.run_info import run_environment

CODECS = WIRE_CODECS
SHIPPED_CUTS = {"base": (2, 6), "worker": (1, 3), "draft": (1, 1)}


def random_llama(directory: Path, hidden: int = 1024, logit_scale: float = 1.0) -> Path:
    """``logit_scale`` multiplies the LM head, so the next-token law is far from uniform."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256, hidden_size=hidden, intermediate_size=2816, num_hidden_layers=6,
        num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=4096,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
    model.save_pretrained(directory)
    return directory


async def link_run(model: Path, codec: str, prompt: list[int], rtt_ms: float, mbit: float) -> dict[str, Any]:
    """TTFT of ``prompt`` and decode tok/s over one emulated link, through ``codec``."""
    cloud = CloudConfig(model_dir=model, port=0, dtype="float32", max_query_tokens=4096)
    async with TrunkServer(cloud) as server:
        netem = NetemConfig(upstream_port=server.port, rtt_ms=rtt_ms, bandwidth_bps=mbit * 1e6)
        async with WanEmulator(netem) as emu:
            edge = EdgeConfig(
                model_dir=model,
                cloud_url=f"ws://{emu.host}:{emu.port}",
                dtype="float32",
                wire_codec=codec,
                allow_stock_edge_weights=True,
                max_message_bytes=64 * 1024 * 1024,
            )
            async with SplitClient(edge) as client:
                t0 = time.perf_counter()
                first = await client.generate(prompt, 1, speculate="off", stop_token_ids=())
                ttft = time.perf_counter() - t0
                client.reset()
                decode = await client.generate(prompt[:16], 33, speculate="off", stop_token_ids=())
    prefill = [s for s in first.steps if s.kind == "prefill"]
    steps = decode.decode_steps
    decode_s = sum(s.network_ms + s.edge_ms + s.cloud_ms + s.serialize_ms for s in steps) / 1e3
    return {
        "codec": codec,
        "prompt_tokens": len(prompt),
        "ttft_s": ttft,
        "prefill_chunks": len(prefill),
        # the TTFT's parts: the link (round trips minus the trunk's compute), edge and trunk compute, serialization
        "prefill_network_s": sum(s.network_ms for s in prefill) / 1e3,
        "prefill_edge_s": sum(s.edge_ms for s in prefill) / 1e3,
        "prefill_cloud_s": sum(s.cloud_ms for s in prefill) / 1e3,
        "prefill_serialize_ms": sum(s.serialize_ms for s in prefill),
        "prefill_bytes_up": sum(s.bytes_up for s in prefill),
        "prefill_bytes_down": sum(s.bytes_down for s in prefill),
        "decode_tok_s": len(steps) / decode_s,
        "decode_step_bytes_up": statistics.median(s.bytes_up for s in steps),
        "decode_step_bytes_down": statistics.median(s.bytes_down for s in steps),
    }


def massive_activations(hidden: torch.Tensor) -> torch.Tensor:
    """As tests/e2e/test_wire_codec.py: two channels 300x the stream's scale, four more 1000x on token 0."""
    out = hidden.clone()
    scale = hidden.float().pow(2).mean().sqrt()
    out[..., 7] += 300 * scale
    out[..., 40] -= 300 * scale
    out[:, 0, [3, 19, 50, 61]] += 1000 * scale
    return out


def quality(quick: bool, massive_dir: Path) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    wires: dict[str, Wire] = {"bf16": codec_wire("bf16"), "int8": codec_wire("int8")}
    for name, cuts in SHIPPED_CUTS.items():
        directory = ASSETS_DIR / "models" / name
        tokenizer = cast(TokenizerLike, AutoTokenizer.from_pretrained(directory, local_files_only=True))
        model = load_full(Checkpoint(directory), torch.float32)
        windows = heldout_windows(tokenizer, DEFAULT_CORPUS_DIR, 256, 8 if quick else 64)
        prompts = heldout_windows(tokenizer, DEFAULT_CORPUS_DIR, 64, 4 if quick else 16)
        for codec, wire in wires.items():
            figures = teacher_forced(model, windows, cuts, wire)
            greedy = greedy_agreement(model, prompts, 32, cuts, wire)
            rows.append(
                {"model": name, "codec": codec, **asdict(figures), "greedy_same": greedy, "prompts": len(prompts)}
            )
            logging.info("%s", rows[-1])
    model = load_full(Checkpoint(massive_dir), torch.float32)
    gen = torch.Generator().manual_seed(0)
    windows = [torch.randint(3, 256, (128,), generator=gen).tolist() for _ in range(4 if quick else 16)]
    prompts = [w[:32] for w in windows[:16]]
    for codec, wire in {
        "int8": codec_wire("int8"),
        "per-token int8": per_token_int8,
        "bf16": codec_wire("bf16"),
    }.items():
        figures = teacher_forced(model, windows, (2, 4), wire, inject=massive_activations)
        greedy = greedy_agreement(model, prompts, 32, (2, 4), wire, inject=massive_activations)
        row = {"model": "random Llama-256 + massive activations", "codec": codec, **asdict(figures)}
        rows.append({**row, "greedy_same": greedy, "prompts": len(prompts)})
        logging.info("%s", rows[-1])
    return rows


def markdown(
    link: list[dict[str, Any]],
    rows: list[dict[str, Any]],
    env: dict[str, Any],
    command: str,
    rtt_ms: float,
    mbit: float,
) -> str:
    """The summary; ``rtt_ms`` and ``mbit`` are the emulated link's round trip (ms) and rate per direction (Mbit/s)."""
    lines = [
        "# Wire codecs: bytes, time to first token, decode speed, output quality",
        "",
        f"`{command}` at commit {env.get('commit')}, torch {env.get('torch')}, {env.get('cpu_count')} CPUs.",
        "",
        f"## Link: random Llama H=1024, split 2,2, float32, WAN emulator {rtt_ms:g} ms RTT, {mbit:g} Mbit/s each way",
        "",
        "| codec | bytes/token (H=1024) | bytes/token (H=4096) | TTFT, s | of which link, s | edge / trunk "
        "compute, s | serialization, ms | prefill MB up / down | decode tok/s | decode step bytes up / down |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for codec in CODECS:
        runs = [r for r in link if r["codec"] == codec]
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0] if k not in ("codec", "prompt_tokens")}
        lines.append(
            f"| {codec} | {wire_bytes_per_token(codec, 1024, torch.float32)} | "
            f"{wire_bytes_per_token(codec, 4096, torch.bfloat16)} (bf16 compute) | {med['ttft_s']:.2f} | "
            f"{med['prefill_network_s']:.2f} | {med['prefill_edge_s']:.2f} / {med['prefill_cloud_s']:.2f} | "
            f"{med['prefill_serialize_ms']:.0f} | "
            f"{med['prefill_bytes_up'] / 1e6:.2f} / {med['prefill_bytes_down'] / 1e6:.2f} | "
            f"{med['decode_tok_s']:.2f} | "
            f"{med['decode_step_bytes_up']:.0f} / {med['decode_step_bytes_down']:.0f} |"
        )
    lines += [
        "",
        f"Medians of {len(link) // len(CODECS)} repeats, codecs interleaved; a {link[0]['prompt_tokens']}-token "
        "prompt. The link part is the codec's effect; compute on this shared 2-core machine varies 2x between runs "
        "with other processes' load, so compare the link column across codecs.",
        "",
        "## Output quality against the raw wire (teacher-forced over held-out text; greedy, 32 tokens)",
        "",
        "| model | codec | tokens | top-1 agreement | KL p99, nats | KL max, nats | greedy identical |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['codec']} | {r['tokens']} | {100 * r['top1_agreement']:.2f} % | {r['kl_p99']:.2e} "
            f"| {r['kl_max']:.2e} | {r['greedy_same']} / {r['prompts']} |"
        )
    return "\n".join(lines) + "\n"


async def main_async(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model = random_llama(Path(tmp) / "llama-1024")
        massive = random_llama(Path(tmp) / "llama-256", hidden=256, logit_scale=8.0)
        prompt = torch.randint(3, 256, (args.prompt_tokens,), generator=torch.Generator().manual_seed(0)).tolist()
        link: list[dict[str, Any]] = []
        for repeat in range(args.repeats):
            for codec in CODECS if repeat % 2 == 0 else tuple(reversed(CODECS)):
                link.append(await link_run(model, codec, prompt, args.rtt_ms, args.mbit))
                logging.info("repeat %d: %s", repeat, link[-1])
        rows = quality(args.quick, massive)
    env = run_environment()
    command = " ".join(["python", *sys.argv])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(
        json.dumps(
            {"env": env, "command": command, "rtt_ms": args.rtt_ms, "mbit": args.mbit, "link": link, "quality": rows},
            indent=2,
        )
    )
    (args.out / "summary.md").write_text(markdown(link, rows, env, command, args.rtt_ms, args.mbit))
    print((args.out / "summary.md").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 repeat, 200-token prompt, fewer quality windows")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--rtt-ms", type=float, default=80.0)
    parser.add_argument("--mbit", type=float, default=20.0, help="link rate per direction, Mbit/s")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1: a shared CPU)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "wire_codec")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.prompt_tokens = 1, 200
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
