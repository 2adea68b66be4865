"""``--quantize`` as a user types it: ``splitspec cloud serve --quantize nf4`` and ``generate --quantize nf4``.

Real processes on loopback. The split's greedy tokens equal transformers' NF4 model of the same
checkpoint (computing in its published float32), and an edge that does not quantize is refused by
the trunk fingerprint in one line, exit status 2, naming both methods.
"""

from __future__ import annotations

import json
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

from splitspec.demo import free_port
from tests.commands import run_commands
from tests.quantized import hf_greedy
from tests.test_cli import CLI, wait_for_port

pytestmark = pytest.mark.slow  # subprocesses of the real command


def test_cloud_serve_and_generate_with_quantize_nf4(make_checkpoint: Callable[..., Path]) -> None:
    model = make_checkpoint("llama")  # hidden 64, published in float32
    prompt = "to be or not to be"
    nf4 = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(model, quantization_config=nf4, dtype=torch.float32).eval()
    expected = hf_greedy(hf, AutoTokenizer.from_pretrained(model).encode(prompt), 8)
    port = free_port()
    server = subprocess.Popen(
        [*CLI, "cloud", "serve", "--model", str(model), "--port", str(port), "--quantize", "nf4"],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for_port(port, server)
        edge = ["generate", "--model", str(model), "--cloud", f"ws://127.0.0.1:{port}", "--prompt", prompt]
        edge += ["--max-new-tokens", "8", "--allow-stock-edge-weights", "--speculate", "off", "--json"]
        quantized, plain = run_commands([[*edge, "--quantize", "nf4"], edge], timeout=300)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=30)
    assert quantized.returncode == 0, quantized.stderr
    assert json.loads(quantized.stdout)["token_ids"] == expected
    assert plain.returncode == 2, plain.stderr
    errors = [line for line in plain.stderr.splitlines() if "TrunkMismatch" in line]
    assert len(errors) == 1, plain.stderr
    assert "the quantization differs (the edge's copy of the checkpoint" in errors[0]
    assert "none; cloud: nf4)" in errors[0]
    log = server.stderr.read() if server.stderr else ""
    assert ":nf4(float32):" in log  # the trunk fingerprint it logs at start names the method
