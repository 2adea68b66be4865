"""A draft never holds more tokens than one step of the verifier may carry: a trunk that takes 8 query tokens a
step (``max_query_tokens``) gets trees of at most 7 drafted tokens, and split greedy output is local greedy
output. A bigger tree cannot be split in chunks, and the request failed."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from splitspec.cloud.config import CloudConfig
from splitspec.cloud.server import TrunkServer
from splitspec.decoding.controller import SpeculationController
from splitspec.edge import EdgeConfig, SplitClient
from tests.conftest import local_greedy

# two phrases after the same "5 9", repeated: n-grams and prompt lookup both branch there (trees of 9-11 tokens)
PROMPT = [*[5, 9, 17, 3, 44, 2, 8, 5, 9, 30, 12, 7, 61, 4] * 3, 5, 9]
CAP = 8  # query tokens one step may carry


@pytest.mark.parametrize("mode", ["ngram", "prompt-lookup"])
async def test_drafts_fit_a_trunks_step_limit(make_checkpoint: Callable[..., Path], mode: str) -> None:
    model = make_checkpoint("llama")
    async with TrunkServer(CloudConfig(model_dir=model, port=0, max_query_tokens=CAP)) as server:
        config = EdgeConfig(allow_stock_edge_weights=True, model_dir=model, cloud_url=server.url)
        # one budget, past the limit: every step drafts as much as it may (the default budgets go to 16 as well,
        # but which one a step asks for follows the machine's timings)
        async with SplitClient(config, controller=SpeculationController([mode], budgets=(16,))) as client:
            assert client.max_step_tokens() == CAP
            result = await client.generate(PROMPT, 24, speculate=mode)
            held, client.sequence.connection = client.sequence.connection, None  # as a failed recovery leaves it
            assert client.max_step_tokens() == CAP  # the last session's limit, not None (unbounded trees)
            client.sequence.connection = held
    assert result.token_ids == local_greedy(model, PROMPT, 24)
    assert any(step.draft_tokens for step in result.spec_steps), "nothing was drafted"
    assert all(1 + step.draft_tokens <= CAP for step in result.spec_steps)
