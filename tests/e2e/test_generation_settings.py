"""One length policy for the CLI and the Python API, and a failed generation that keeps every token it made."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from splitspec.cli import _generate_json
from splitspec.cloud.config import CloudConfig
from splitspec.cloud.server import TrunkServer
from splitspec.decoding.sampling import SamplingParams
from splitspec.edge import EdgeConfig, SplitClient
from splitspec.exceptions import ConfigError, TransportError
from splitspec.protocol.messages import Step, StepResult
from tests.conftest import local_greedy

PROMPT = [5, 9, 17, 3, 44, 2, 8, 61, 30, 12, 7]


async def test_the_python_api_refuses_an_overlong_request_before_sending(make_checkpoint: Callable[..., Path]) -> None:
    model = make_checkpoint("llama", max_positions=32)
    edge = EdgeConfig(model_dir=model, cloud_url="ws://127.0.0.1:9", allow_stock_edge_weights=True, max_recoveries=0)
    client = SplitClient(edge)
    # never connected: the length is refused before anything would be sent
    with pytest.raises(ConfigError, match=r"prompt \(11 tokens\) \+ max new tokens \(22\) = 33 exceeds the model's 32"):
        await client.generate(PROMPT, 22)
    with pytest.raises(TransportError, match="not connected"):  # 11 + 21 fits: it gets as far as the link
        await client.generate(PROMPT, 21)


async def test_a_failed_generation_reports_every_token_it_produced(
    make_checkpoint: Callable[..., Path], capsys: pytest.CaptureFixture[str]
) -> None:
    model = make_checkpoint("llama")
    async with TrunkServer(CloudConfig(model_dir=model, port=0)) as server:
        run_step = server.run_step
        steps = 0

        async def fails_after_four_steps(step: Step, owner: int) -> StepResult:
            nonlocal steps
            steps += 1
            if steps > 4:
                raise RuntimeError("injected trunk failure")
            return await run_step(step, owner)

        server.run_step = fails_after_four_steps  # type: ignore[method-assign]
        edge = EdgeConfig(model_dir=model, cloud_url=server.url, allow_stock_edge_weights=True, max_recoveries=0)
        args = argparse.Namespace(max_new_tokens=10, speculate="off")
        async with SplitClient(edge) as client:
            tokenizer = AutoTokenizer.from_pretrained(model)
            status = await _generate_json(client, tokenizer, PROMPT, args, SamplingParams(), None)
    out = json.loads(capsys.readouterr().out)
    assert status == 2
    assert "ServerError" in out["error"]
    # prefill + 3 decode steps made 4 tokens; the 4th was never sent back to the cloud, and is reported too
    assert out["token_ids"] == local_greedy(model, PROMPT, 4)
