#!/usr/bin/env bash
# The prepared GPU check of issue 14: one command, 8-10 minutes on one H200 (first run: 2026-12-04).
#
#   scripts/gpu_check.sh prepare   # HERE, with network: fetch the wheels the GPU image lacks into .wheelhouse/
#   scripts/gpu_check.sh           # THERE, on the GPU machine (the device tool: carry [".wheelhouse"])
#   scripts/gpu_check.sh rest      # THERE: only the benchmarks after device_targets (trunk_load, quant_load)
#
# Through the device tool run `timeout 560 bash scripts/gpu_check.sh` with the tool's timeout_s 600: a TERM from
# timeout still packs what was written and prints the summary (the EXIT trap below), which the tool's own kill at its
# limit would not.
# The machine stays warm 30 s after a call: if the first call did not reach trunk_load/quant_load, call at once
# `timeout 250 bash scripts/gpu_check.sh rest` (timeout_s 280) before the device goes back (a fresh start costs minutes).
#
# On the GPU machine it
#   1. checks that python3's torch sees CUDA; installs torch==2.13.0 (PyPI's default CUDA build)
#      only when torch is missing, and fails in one line when torch is there without CUDA;
#   2. installs from .wheelhouse/ (offline) the packages the image lacks or holds too old
#      (websockets, pytest-asyncio, prometheus-client, transformers in the range pyproject.toml pins), then runs
#      splitspec from src/ (no build step);
#   3. runs the device tests with --device cuda: greedy split == HF generate on the GPU in float32
#      and bfloat16, sequential and speculative, Llama and Qwen2; a trunk split over GPU + CPU;
#      seeded sampling on the GPU; CUDA-vs-CPU float32 token identity (tests/e2e/test_devices_e2e.py,
#      tests/test_devices.py);
#   3b. runs the --compile tests with the real compiler (inductor, CUDA graphs): greedy identity with
#      the trunk and the edge compiled, one graph each;
#   3c. runs the quantized-trunk checks on the GPU (tests/e2e/test_quantized_cuda.py): NF4 trunk and
#      edge (bitsandbytes' CUDA kernels) == transformers' NF4 model; a compressed-tensors FP8 trunk
#      kept in FP8 (scaled_mm, compute capability >= 8.9) == transformers' use_optimized_inference
#      model; a transformers fp8 checkpoint loaded dequantized == transformers' dequantized load; then
#      the trunk's load time and memory per quantization on the GPU host (benchmarks/quant_load.py);
#   4. runs the benchmarks on the GPU: benchmarks/device_targets.py (split vs whole at zero RTT on a
#      random Llama-3.2-1B-shaped checkpoint in bfloat16, framework overhead for a 4096-wide bf16
#      hidden state, trunk step vs bare transformers with growable KV, static KV and --compile),
#      the draft model's proposals after a cold start (benchmarks/draft_cold_start.py), the speculative
#      scenario quick run, and the trunk under 1 and 16 concurrent sessions, batched vs
#      per-session (benchmarks/trunk_load.py, issue 15's >= 4x at 16 sessions on an accelerator);
#   5. writes gpu_check.log, targets/device_targets.{json,md,png}, draft_cold_start{,_cudnn}/draft_cold_start.{json,md},
#      speculative/summary.{json,md} and its
#      two plots, quant_load/{quant_load.json,quant_load.md} and trunk_load/{trunk_load.json,trunk_load.md,
#      trunk_load.png,runs.jsonl.gz} under benchmarks/results/gpu/; with $OUT set (the device tool's folder,
#      which brings back 8 files at most) under a scratch folder instead, packed at the end into
#      $OUT/gpu_check.tgz beside a copy of $OUT/gpu_check.log.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
WHEELS=$ROOT/.wheelhouse
PY=${PYTHON:-python3}

if [[ "${1:-}" == "prepare" ]]; then
    # wheels for the GPU image's Python (3.12, x86-64); pure-Python ones fit any
    mkdir -p "$WHEELS"
    "$PY" -m pip download --no-deps -d "$WHEELS" --only-binary=:all: \
        --python-version 3.12 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
        --implementation cp \
        "websockets>=14,<18" "pytest-asyncio>=0.24" "transformers==5.23.0" "prometheus-client>=0.20" \
        "accelerate==1.15.0" "compressed-tensors==0.20.0" "loguru>=0.7" \
        "pydantic==2.14.4" "pydantic-core==2.50.5" "annotated-types>=0.6" "typing-inspection>=0.4.4" \
        "typing-extensions>=4.16"
    # bitsandbytes' wheel is tagged manylinux_2_24 and holds a 20-MB library per CUDA version (130 MB)
    "$PY" -m pip download --no-deps -d "$WHEELS" --only-binary=:all: --python-version 3.12 \
        --platform manylinux_2_24_x86_64 --implementation cp "bitsandbytes==0.50.2"
    # the tool carries at most 64 MiB, the tree included: keep bitsandbytes' CPU and CUDA 13.0 libraries (the
    # GPU image's torch is cu130) and the transformers model packages the device checks and their imports use
    "$PY" - "$WHEELS"/bitsandbytes-*.whl "$WHEELS"/transformers-*.whl <<'EOF'
import os, sys, zipfile
LIBS = {"libbitsandbytes_cpu.so", "libbitsandbytes_cuda130.so"}
MODELS = {"auto", "encoder_decoder", "llama", "qwen2", "qwen3", "qwen3_moe", "mistral", "mixtral", "gemma",
          "gemma2", "gemma3", "phi", "phi3", "granite", "olmo2", "smollm3", "cohere", "gpt2"}
def dropped(name: str) -> bool:
    parts = name.split(",")[0].split("/")
    if parts[-1].startswith("libbitsandbytes_"):
        return parts[-1] not in LIBS
    return parts[:2] == ["transformers", "models"] and len(parts) > 3 and parts[2] not in MODELS
for wheel in sys.argv[1:]:
    with zipfile.ZipFile(wheel) as zin, zipfile.ZipFile(wheel + ".tmp", "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            if dropped(info.filename):
                continue
            data = zin.read(info.filename)
            if info.filename.endswith(".dist-info/RECORD"):
                data = "".join(l + "\n" for l in data.decode().splitlines() if not dropped(l)).encode()
            zout.writestr(info, data)
    os.replace(wheel + ".tmp", wheel)
EOF
    ls -l "$WHEELS"
    exit 0
fi

RESULTS=$ROOT/benchmarks/results/gpu
# at the end, even when stopped: the reports that answer the open questions, in the log's last lines (the device
# tool returns the last 12,000 characters of the output whatever else comes back)
summary() {
    local report
    set +e  # a report missing or without the rows asked for must not stop the exit trap before it packs the results
    echo "== summary"
    for report in draft_cold_start/draft_cold_start.md draft_cold_start_cudnn/draft_cold_start.md \
        targets/device_targets.md; do
        [[ -f "$RESULTS/$report" ]] && { echo "-- $report"; grep '^|' "$RESULTS/$report"; }
    done
    if [[ -f "$RESULTS/speculative/summary.md" ]]; then
        echo "-- speculative: mode, RTT ms, decode tok/s, accepted/step (draft and auto rows)"
        grep -E '^\| split (draft|auto) ' "$RESULTS/speculative/summary.md" | cut -d'|' -f2,3,5,9
    fi
    return 0
}
# GNU timeout sends its TERM to the whole process group: bash (twice) and tee. tee ignores it (below), and so do the
# exit traps once they run, so the summary reaches the output and the log and the results are packed all the same
settle_log() {
    # the summary reaches the log through tee: wait until tee has written it (5 s at most) before packing the log
    local mark="== packing the results" i
    echo "$mark"
    for i in {1..50}; do
        grep -qxF -- "$mark" "${LOG:-}" 2>/dev/null && break
        sleep 0.1
    done
    return 0
}
if [[ -n "${OUT:-}" ]]; then
    RESULTS=$(mktemp -d)
    # tee is stopped at the end: a benchmark under its own `timeout` (its own process group, which timeout's TERM
    # does not reach) must not keep the output open through it after this shell exits
    # shellcheck disable=SC2064  # expand now: the paths are fixed
    trap "trap '' TERM; summary; settle_log; tar czf '$OUT/gpu_check.tgz' -C '$RESULTS' . && cp '$RESULTS/gpu_check.log' '$OUT/'; kill -KILL \"\${TEE:-}\" 2>/dev/null" EXIT
else
    trap "trap '' TERM; summary" EXIT
fi
mkdir -p "$RESULTS"
LOG=$RESULTS/gpu_check.log
exec > >(trap "" TERM; exec tee "$LOG") 2>&1
TEE=$!
export PYTHONUNBUFFERED=1
echo "== gpu_check $(date -u +%FT%TZ) commit $(git rev-parse HEAD 2>/dev/null || echo unknown)"

# 1. torch with CUDA
if ! "$PY" -c 'import torch' 2>/dev/null; then
    echo "torch is missing: installing torch==2.13.0 (PyPI's default CUDA build)"
    "$PY" -m pip install -q "torch==2.13.0"
fi
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_check: torch $("$PY" -c 'import torch; print(torch.__version__)') does not see a CUDA device" >&2
    exit 2
fi
"$PY" -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda, torch.cuda.get_device_name(0))'

# 2. the packages the image lacks, offline from the wheelhouse when there is one
need=()
"$PY" -c 'import websockets' 2>/dev/null || need+=("websockets>=14,<18")
"$PY" -c 'import pytest_asyncio' 2>/dev/null || need+=("pytest-asyncio>=0.24")
"$PY" -c 'import prometheus_client' 2>/dev/null || need+=("prometheus-client>=0.20")  # the trunk's /metrics
# --quantize and the published quantized checkpoints (3c): bitsandbytes, accelerate, compressed-tensors
"$PY" -c 'import bitsandbytes' 2>/dev/null || need+=("bitsandbytes==0.50.2")
"$PY" -c 'import accelerate' 2>/dev/null || need+=("accelerate==1.15.0")
"$PY" -c 'import compressed_tensors' 2>/dev/null || need+=("compressed-tensors==0.20.0")
# compressed-tensors' config models (pydantic 2.14 wants typing-extensions >= 4.16)
"$PY" -c 'import pydantic' 2>/dev/null || need+=("pydantic==2.14.4" "pydantic-core==2.50.5" "annotated-types>=0.6" \
    "typing-inspection>=0.4.4" "typing-extensions>=4.16")
"$PY" -c 'import loguru' 2>/dev/null || need+=("loguru>=0.7")  # compressed-tensors' logger
"$PY" - <<'EOF' || need+=("transformers==5.23.0")
import sys
from importlib.metadata import version
major, minor = (int(x) for x in version("transformers").split(".")[:2])
sys.exit(0 if (major, minor) >= (5, 20) and (major, minor) < (5, 24) else 1)
EOF
if ((${#need[@]})); then
    echo "installing: ${need[*]}"
    if [[ -d "$WHEELS" ]]; then
        "$PY" -m pip install -q --no-index --no-deps --find-links "$WHEELS" "${need[@]}"
    else
        "$PY" -m pip install -q "${need[@]}"
    fi
fi
export PYTHONPATH=$ROOT/src:$ROOT${PYTHONPATH:+:$PYTHONPATH}
"$PY" -c 'import splitspec, transformers, websockets; print("splitspec from", splitspec.__file__, "transformers", transformers.__version__)'

status=0
if [[ "${1:-}" != "rest" ]]; then
# 3. token identity on the GPU (each test is skipped with its reason when CUDA is absent)
"$PY" -m pytest -q -p no:cacheprovider --device cuda -o timeout=240 \
    tests/test_devices.py tests/e2e/test_devices_e2e.py || status=$?
echo "== device tests exit status $status"
# --compile for real: inductor with CUDA graphs (reduce-overhead) on the trunk, the edge's head and tail;
# greedy identity sequential and speculative, one graph each
"$PY" -m pytest -q -p no:cacheprovider --device cuda --compile-backend inductor -o timeout=300 \
    tests/e2e/test_compile_e2e.py || status=$?
echo "== compile tests exit status $status"
# 3c. quantized trunks on the GPU: NF4, compressed-tensors FP8 kept in FP8, transformers' fp8 dequantized
"$PY" -m pytest -q -p no:cacheprovider --device cuda -o timeout=240 tests/e2e/test_quantized_cuda.py || status=$?
echo "== quantized trunk tests exit status $status"

# 4. benchmarks on the GPU, most wanted first, each bounded (about 10 minutes at most in all; on the H200 on
# 2026-12-04 steps 1-3 took 75-130 s, draft_cold_start 20 s, the speculative quick run 116 s, device_targets 100 s)
# the draft model after a cold start: proposals per 16-token answer on fresh engines (about 7 on a CPU; 0-1 on the
# H200 before the warm-up at load, 6-7 after it but 110-160 ms each at first), with cuDNN out of sdpa (bb3cf23) and,
# to compare in the same session, put back (--cudnn-sdpa): the compute columns show the steps' cost either way.
# Since b71e135 the controller measures a cost or a step width measured once again after 4 one-token steps and
# believes the lower of two (estimates.Seconds): the estimated draft cost per token should fall to the proposals'
# own within an answer, and T(9) no longer read T(1) (549 ms beside T(3) 164 on 2026-12-04)
timeout 90 "$PY" benchmarks/draft_cold_start.py --device cuda --out "$RESULTS/draft_cold_start" || status=$?
timeout 90 "$PY" benchmarks/draft_cold_start.py --device cuda --cudnn-sdpa --out "$RESULTS/draft_cold_start_cudnn" \
    || status=$?
# greedy split decoding over emulated RTTs; accepted/step on a CPU (2026-12-04): draft 2.50, mix 1.67-1.88, auto
# 1.88-2.14 (n-gram and prompt lookup 1.00-1.07); with the warm-up at load alone (9f311b7, models/warm_up.py) every
# mode accepted 1.00 token per step on the H200
timeout 150 "$PY" -m splitspec.cli --log-level WARNING bench speculative --quick --device cuda --no-progress \
    --no-runs --out "$RESULTS/speculative" || status=$?
# trunk step: transformers vs ours with growable KV, static KV (fixed-shape, eager) and compiled
# (--compile auto = reduce-overhead, CUDA graphs), static KV of 1024 entries at context 512
# and the split with the trunk's and the edge's decode steps compiled (CUDA graphs): eager, the split ran at 0.51x
# the whole model on the H200, each side launch bound (split/whole target >= 0.9)
timeout 210 "$PY" benchmarks/device_targets.py --device cuda --dtype bfloat16 --shape llama-3.2-1b \
    --repeats 3 --new-tokens 64 --compile auto --cache-tokens 1024 --split-compile auto --out "$RESULTS/targets" \
    || status=$?
fi
# `gpu_check.sh rest` starts here: what a 560-s run may not reach, for a second call while the machine is warm
# continuous batching on the GPU: batched vs per-session steps/s at 1 and 16 sessions, and the prefill mix: on the
# H200 the run at 1, 16 and 32 sessions outlasted 3.5 minutes; at 1 and 16 one repeat took 69 s (3.86x at 16)
timeout 150 "$PY" benchmarks/trunk_load.py --device cuda --repeats 3 --seconds 0.3 --sessions 1 16 \
    --models random-llama-1024 --prefill 1024 --out "$RESULTS/trunk_load" || status=$?
# the trunk's load time, weight memory and peak host RSS per quantization (host-side figures: last)
timeout 90 "$PY" benchmarks/quant_load.py --repeats 1 --out "$RESULTS/quant_load" || status=$?
echo "== gpu_check done, exit status $status; results in $RESULTS"
exit $status
