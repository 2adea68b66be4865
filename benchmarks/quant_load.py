"""Benchmark: load time, peak RSS and weight memory of a trunk per quantization (issue 25, items 1 and 2).

A random Llama of about 0.55B parameters (hidden 1536, 16 layers, vocab 32000, about 1.1 GB in
bfloat16) is saved with ``save_pretrained`` into a temporary directory; its trunk (layers 2..13,
edge 2+2) is then loaded by :func:`splitspec.models.loading.load_trunk`, what ``cloud serve``
calls, in a fresh process per quantization (none, nf4, int8), repeats (default 3) interleaved
with the order rotated each repeat. Each process reports:

* its RSS just before the load (bitsandbytes and transformers imported) and just after it, and after
  a 16-token prefill and five one-token steps with the heap's freed pages handed back
  (``malloc_trim``): the trunk's weight memory is that last RSS minus the one before (an
  unquantized trunk's tensors map the safetensors file and are only paged in when a step first
  reads them; the KV cache of 21 tokens is under 2 MiB). With ``--device cuda`` the weight memory
  is the GPU memory the load allocated, and the RSS figures say what the host held meanwhile;
* its peak RSS during the load (``VmHWM`` minus the RSS before), against the size of the trunk's
  own stored tensors and the whole checkpoint's: tensors are read one at a time, straight onto
  their device, so the peak stays near the trunk's own size, not the checkpoint's;
* the load time, and the median time of a one-token trunk step after a 16-token prefill.

Gates (the issue's): the trunk's weight memory is at most 0.35x of the bfloat16 trunk's for NF4
and 0.6x for int8.

    python benchmarks/quant_load.py                 # writes benchmarks/results/quant_load/
    python benchmarks/quant_load.py --repeats 1 --layers 8

Writes quant_load.json and quant_load.md into --out.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import logging
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from splitspec.run_info import run_environment

log = logging.getLogger("quant_load")
METHODS = ("none", "nf4", "int8")
GATES = {"nf4": 0.35, "int8": 0.6}  # trunk weight memory against the bfloat16 trunk's
_ITEM_BYTES = {"BF16": 2, "F16": 2, "F32": 4}  # safetensors dtype names of an unquantized checkpoint


def method_order(repeat: int) -> tuple[str, ...]:
    """The load order of ``repeat``: :data:`METHODS` rotated by the repeat, so that over every
    ``len(METHODS)`` repeats each method loads once in each position (first, middle, last)."""
    shift = repeat % len(METHODS)
    return METHODS[shift:] + METHODS[:shift]


def _rss_bytes() -> int:
    """This process's resident set size now (Linux /proc)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak() -> None:
    """Restart this process's peak RSS (VmHWM) from its RSS now (Linux: clear_refs 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _peak_bytes() -> int:
    """This process's peak RSS since :func:`_reset_peak` (VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise SystemExit("no VmHWM in /proc/self/status: this benchmark needs Linux")


def intermediate_size(hidden: int) -> int:
    """The MLP width for ``hidden``: 4096 at the default 1536 (8/3 of it), rounded up to a multiple of 64."""
    return -(-hidden * 8 // 3 // 64) * 64


def build_model(directory: Path, layers: int, hidden: int = 1536) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=hidden,
        intermediate_size=intermediate_size(hidden),
        num_hidden_layers=layers,
        num_attention_heads=hidden // 128,
        num_key_value_heads=hidden // 128,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)  # type: ignore[arg-type]  # transformers types .to() oddly
    model.save_pretrained(directory)


def _trim_heap() -> None:
    """Hand the heap pages freed by the steps' temporaries back (glibc), so RSS counts live memory."""
    name = ctypes.util.find_library("c")
    trim = getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    if trim is not None:
        trim(0)


def child(model: Path, method: str, device_name: str) -> dict[str, Any]:
    """One load in this (fresh) process: what the parent prints."""
    import bitsandbytes  # noqa: F401  (imported before "before": the libraries are not weight memory)
    import torch
    import transformers.integrations.bitsandbytes  # noqa: F401

    from splitspec.models.checkpoint import Checkpoint
    from splitspec.models.kv_cache import KVCache
    from splitspec.models.loading import load_trunk, trunk_tensor_names
    from splitspec.models.split import SplitPlan

    torch.set_num_threads(1)
    device = torch.device(device_name)
    on_gpu = device.type == "cuda"
    ckpt = Checkpoint(model)
    plan = SplitPlan(ckpt.config.num_hidden_layers, 2, 2)
    names = trunk_tensor_names(ckpt, plan)
    with ckpt.open_slices(names, torch.device("cpu")) as slices:
        trunk_bytes = sum(math.prod(s.get_shape()) * _ITEM_BYTES[s.get_dtype()] for s in slices.values())
    ckpt.read_names.clear()
    checkpoint_bytes = sum(p.stat().st_size for p in ckpt.tensor_files)
    gpu_before = torch.cuda.memory_allocated(device) if on_gpu else 0
    before = _rss_bytes()
    _reset_peak()
    start = time.perf_counter()
    trunk = load_trunk(ckpt, plan, devices=(device,), quantize=None if method == "none" else method)
    if on_gpu:
        torch.cuda.synchronize(device)
    load_s = time.perf_counter() - start
    after_load = _rss_bytes()
    peak = _peak_bytes()
    gpu_weight = torch.cuda.memory_allocated(device) - gpu_before if on_gpu else 0
    hidden = torch.randn(1, 16, ckpt.config.hidden_size, dtype=torch.bfloat16, device=device)
    cache = KVCache()
    trunk(hidden, torch.arange(16), torch.arange(16) - 1, cache)
    steps = []
    for i in range(5):
        t = time.perf_counter()
        trunk(hidden[:, :1], torch.tensor([16 + i]), torch.tensor([-1]), cache)
        if on_gpu:
            torch.cuda.synchronize(device)
        steps.append(time.perf_counter() - t)
    after_steps_untrimmed = _rss_bytes()
    _trim_heap()
    after_steps = _rss_bytes()
    return {
        "method": method,
        "load_s": load_s,
        "rss_before_mb": before / 2**20,
        "rss_after_load_over_before_mb": (after_load - before) / 2**20,
        "rss_after_steps_untrimmed_over_before_mb": (after_steps_untrimmed - before) / 2**20,
        # every weight read by now: an unquantized trunk's tensors map the file and are paged in on first use
        "weight_mb": (gpu_weight if on_gpu else after_steps - before) / 2**20,
        "peak_over_before_mb": (peak - before) / 2**20,
        "trunk_stored_mb": trunk_bytes / 2**20,
        "checkpoint_mb": checkpoint_bytes / 2**20,
        "step_ms_median": 1000 * statistics.median(steps),
    }


def run_child(model: Path, method: str, device: str) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, __file__, "--child", str(model), method, device],
        capture_output=True,
        text=True,
        check=False,
        timeout=1800,
    )
    if out.returncode != 0:
        raise SystemExit(f"the {method} load failed:\n{out.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--repeats", type=int, default=3, help="interleaved loads per method, order rotated each repeat (default 3)"
    )
    p.add_argument("--layers", type=int, default=16, help="decoder layers of the random Llama (default 16)")
    p.add_argument(
        "--hidden", type=int, default=1536, help="hidden size, a multiple of 128 (default 1536; smaller for a toy run)"
    )
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "quant_load")
    p.add_argument("--device", default="cpu", help="where the trunk loads: cpu (default) or cuda[:N]")
    p.add_argument("--child", nargs=3, metavar=("MODEL", "METHOD", "DEVICE"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(Path(args.child[0]), args.child[1], args.child[2])))
        return 0
    if args.layers < 5:
        p.error(f"--layers must be at least 5 (2 edge layers at each end and a trunk), got {args.layers}")
    if args.repeats < 1:
        p.error(f"--repeats must be at least 1, got {args.repeats}")
    if args.hidden < 128 or args.hidden % 128:
        p.error(f"--hidden must be a positive multiple of 128 (the head size), got {args.hidden}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    env = run_environment()
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in METHODS}
    with tempfile.TemporaryDirectory(prefix="quant-load-") as tmp:
        model = Path(tmp) / "llama"
        log.info("building a random %d-layer Llama in %s", args.layers, model)
        build_model(model, args.layers, args.hidden)
        for r in range(args.repeats):
            for method in method_order(r):
                runs[method].append(run_child(model, method, args.device))
                log.info("repeat %d %s: %s", r, method, runs[method][-1])
    med = {m: {k: statistics.median(x[k] for x in rs) for k in rs[0] if k != "method"} for m, rs in runs.items()}
    base = med["none"]["weight_mb"]
    ratios = {m: med[m]["weight_mb"] / base for m in METHODS}
    gates = {m: ratios[m] <= g for m, g in GATES.items()}
    results = {
        **env,
        "model": f"random Llama, hidden {args.hidden}, {args.layers} layers, intermediate "
        f"{intermediate_size(args.hidden)}, vocab 32000, bfloat16",
        "trunk": f"layers 2..{args.layers - 3} (edge 2+2)",
        "repeats": args.repeats,
        "order": [list(method_order(r)) for r in range(args.repeats)],
        "device": args.device,
        "weight_memory": "GPU memory allocated by the load" if args.device != "cpu" else "host RSS",
        "torch_threads": 1,
        "median": med,
        "weight_ratio_to_bfloat16": ratios,
        "gates": {m: {"limit": GATES[m], "passed": gates[m]} for m in GATES},
        "runs": runs,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "quant_load.json").write_text(json.dumps(results, indent=2))
    verdict = {m: f" (<= {g:.2f}: {'pass' if gates[m] else 'FAIL'})" for m, g in GATES.items()}
    rows = [
        f"| {m} | {med[m]['load_s']:.2f} | {med[m]['weight_mb']:.0f} | {ratios[m]:.3f}{verdict.get(m, '')} | "
        f"{med[m]['rss_after_load_over_before_mb']:.0f} | {med[m]['rss_after_steps_untrimmed_over_before_mb']:.0f} | "
        f"{med[m]['peak_over_before_mb']:.0f} | "
        f"{med[m]['step_ms_median']:.1f} |"
        for m in METHODS
    ]
    md = [
        "# Trunk load per quantization",
        "",
        f"Model: {results['model']} ({med['none']['checkpoint_mb']:.0f} MiB of safetensors); trunk "
        f"{results['trunk']}, {med['none']['trunk_stored_mb']:.0f} MiB stored. A fresh process per load, "
        f"{args.repeats} interleaved repeats (order rotated each repeat), medians; one torch thread; "
        f"device {args.device}. Commit {env['commit']}.",
        "",
        f"| quantization | load s | weight memory MiB ({results['weight_memory']}) | x bfloat16 | "
        "RSS after load - before, MiB | RSS after steps (untrimmed) - before, MiB | "
        "peak RSS during load - before, MiB | one-token step ms |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        "An unquantized trunk's tensors are views of the memory-mapped safetensors file: they are paged in "
        "when the first steps read them (hence its small RSS after load and peak). A quantizing load reads "
        "each tensor into a buffer of its own, quantizes it and frees it, one module at a time: its peak is "
        "what it keeps plus one layer's temporaries, under the trunk's own stored size and never the whole "
        "checkpoint's. The untrimmed RSS after steps shows what glibc keeps of the freed temporaries of "
        "bitsandbytes' CPU NF4 matmul (it dequantizes each weight per step without the Hub's fused kernel).",
        "",
        "Reproduce: `python benchmarks/quant_load.py`",
    ]
    (args.out / "quant_load.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0 if all(gates.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
