"""``splitspec serve`` on the edge engine: what every request shares is loaded and checked once."""

from __future__ import annotations

import shutil
from pathlib import Path

import openai
import pytest

from splitspec.models.checkpoint import Checkpoint
from splitspec.models.split import SplitPlan
from splitspec.privacy import weights
from splitspec.privacy.record import DivergenceRecord
from tests.serve.conftest import MODEL_NAME, Stack


def test_a_new_session_does_not_rehash_the_edge_weights(
    chat_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a divergence record (the recommended deployment), proving the edge weights are private
    hashes every edge tensor: once per server, not once per request."""
    diverged = tmp_path / "diverged"
    shutil.copytree(chat_model, diverged)
    plan = SplitPlan(Checkpoint(diverged).config.num_hidden_layers, 2, 2)
    DivergenceRecord(2, 2, weights.edge_fingerprint(diverged, plan), "0" * 64).write(diverged)
    hashes: list[Path] = []
    fingerprint = weights.edge_fingerprint

    def counted(ckpt_dir: str | Path, split: SplitPlan) -> str:
        hashes.append(Path(ckpt_dir))
        return fingerprint(ckpt_dir, split)

    monkeypatch.setattr("splitspec.edge.provenance.edge_fingerprint", counted)
    stack = Stack(diverged, edge_options={"allow_stock_edge_weights": False})
    try:
        assert hashes == [diverged]  # the runtime checked the weights while the server started
        client = openai.OpenAI(base_url=stack.base_url, api_key="none", max_retries=0)
        for prompt in ("to be or not to be", "that is the question", "class Split: pass"):
            reply = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=4, temperature=0)
            assert reply.usage is not None
            assert reply.usage.completion_tokens == 4
        assert not stack.state.runtime.provenance.stock
    finally:
        stack.close()
    assert hashes == [diverged]  # three sessions, no rehash
