"""The trunk's /metrics (parsed with prometheus-client's own parser) and /health (#15 item 3)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from splitspec.cloud.config import CloudConfig
from splitspec.cloud.server import TrunkServer
from splitspec.edge import EdgeConfig, SplitClient
from splitspec.exceptions import UnknownSession
from splitspec.protocol.messages import CloseSession
from tests.e2e.test_bad_input import raw_channel
from tests.e2e.test_split_generate import PROMPT


async def _scrape(http: httpx.AsyncClient, server: TrunkServer) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    reply = await http.get(f"http://127.0.0.1:{server.port}/metrics")
    assert reply.status_code == 200
    assert reply.headers["content-type"].startswith("text/plain")
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(reply.text)
        for sample in family.samples
    }


async def test_metrics_move_as_a_generation_runs(
    make_checkpoint: Callable[..., Path], caplog: pytest.LogCaptureFixture
) -> None:
    model = make_checkpoint("llama")
    caplog.set_level(logging.INFO, logger="splitspec.cloud.sessions")
    async with TrunkServer(CloudConfig(model_dir=model, port=0, kv_budget_mb=64)) as server:
        edge = EdgeConfig(allow_stock_edge_weights=True, model_dir=model, cloud_url=server.url)
        async with httpx.AsyncClient() as http, SplitClient(edge) as client:
            before = await _scrape(http, server)
            session_id = client.session_id
            stream = client.stream(PROMPT, 8, speculate="off")
            [await anext(stream) for _ in range(3)]
            during = await _scrape(http, server)
            [token async for token in stream]
            after = await _scrape(http, server)
            health = await http.get(f"http://127.0.0.1:{server.port}/health")
            channel, _ = await raw_channel(server, client.hello)
            with pytest.raises(UnknownSession):
                await channel.request(CloseSession("nope"), 5)
            await channel.close()
            errors = await _scrape(http, server)
    steps = ("splitspec_trunk_steps_total", (("kind", "decode"),))
    prefill = ("splitspec_trunk_steps_total", (("kind", "prefill"),))
    assert before[("splitspec_trunk_sessions_open", ())] == 1
    assert before.get(steps, 0) == 0
    assert during[prefill] == 1
    assert during[steps] == 2  # the prompt, then one step per token but the last
    assert after[steps] == 7
    assert 0 < during[("splitspec_trunk_kv_bytes_used", ())] <= after[("splitspec_trunk_kv_bytes_used", ())]
    assert after[("splitspec_trunk_kv_bytes_budget", ())] == 64 * 2**20
    assert after[("splitspec_trunk_batch_size_count", ())] == 8
    assert after[("splitspec_trunk_batch_tokens_sum", ())] == len(PROMPT) + 7
    assert after[("splitspec_trunk_compute_milliseconds_count", ())] == 8
    up = ("splitspec_trunk_wire_bytes_total", (("direction", "in"), ("type", "step")))
    assert after[up] > during[up] > 64 * 4 * len(PROMPT)
    assert errors[("splitspec_trunk_errors_total", (("code", "unknown_session"),))] == 1
    assert health.status_code == 200
    assert json.loads(health.text)["sessions"] == 1
    closed = [r.getMessage() for r in caplog.records if " closed (" in r.getMessage()]
    assert len(closed) == 2  # one structured line per session, with its totals
    totals = {t["session"]: t for t in (json.loads(line.split(") ", 1)[1]) for line in closed)}
    assert (totals[session_id]["steps"], totals[session_id]["tokens"]) == (8, len(PROMPT) + 7)
    assert totals[session_id]["bytes_in"] > 0
