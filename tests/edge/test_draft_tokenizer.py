"""A draft model is judged by its tokenizer, not its vocab_size: one tokenizer with a differently padded embedding
drafts (its logits cut or padded to the model's width), another tokenizer is refused."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from splitspec.cloud.config import CloudConfig
from splitspec.cloud.server import TrunkServer
from splitspec.decoding.sampling import SamplingParams
from splitspec.edge import EdgeConfig, SplitClient
from splitspec.edge.runtime import EdgeRuntime
from splitspec.exceptions import ConfigError
from tests.conftest import VOCAB, local_greedy, save_tiny_tokenizer

PROMPT = [5, 9, 17, 3, 44, 2, 8, 5, 9, 17, 3, 61, 30, 12, 7, 5, 9]
PADDED = VOCAB + 32  # rows past the tokenizer's ids, as Qwen2.5-7B's 152064 past 0.5B's 151936


@pytest.fixture(scope="module")
def padded_twin(make_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The llama checkpoint itself with PADDED rows, whose padding rows would win every argmax if drafted."""
    directory = tmp_path_factory.mktemp("padded-twin")
    model = LlamaForCausalLM.from_pretrained(make_checkpoint("llama"))
    model.resize_token_embeddings(PADDED, mean_resizing=False)
    with torch.no_grad():
        model.lm_head.weight[VOCAB:] = model.lm_head.weight[:VOCAB].abs().max() * 100
    model.save_pretrained(directory)
    save_tiny_tokenizer(directory)  # the same tokenizer
    return directory


async def _generate(model: Path, draft: Path, params: SamplingParams) -> tuple[list[int], list[int]]:
    async with TrunkServer(CloudConfig(model_dir=model, port=0)) as server:
        config = EdgeConfig(allow_stock_edge_weights=True, model_dir=model, cloud_url=server.url, draft_model_dir=draft)
        async with SplitClient(config) as client:
            result = await client.generate(PROMPT, 24, params, speculate="draft")
    return result.token_ids, [s.accepted for s in result.spec_steps if s.drafter is not None]


async def test_a_draft_with_more_rows_drafts_only_the_models_ids(
    make_checkpoint: Callable[..., Path], padded_twin: Path
) -> None:
    model = make_checkpoint("llama")
    tokens, accepted = await _generate(model, padded_twin, SamplingParams())
    assert tokens == local_greedy(model, PROMPT, 24)
    # its padding columns are masked: it drafts the model's own greedy token at every step
    assert accepted
    assert min(accepted) >= 1
    sampled, _ = await _generate(model, padded_twin, SamplingParams(temperature=0.8, seed=3))
    assert len(sampled) == 24
    assert max(sampled) < VOCAB


async def test_a_draft_with_fewer_rows_drafts_for_a_padded_model(make_checkpoint: Callable[..., Path]) -> None:
    model = make_checkpoint("llama", vocab=PADDED)  # the tiny tokenizer's VOCAB ids, PADDED rows
    draft = make_checkpoint("llama", layers=2, seed=99)
    reference = local_greedy(model, PROMPT, 24)
    assert max(reference) >= VOCAB  # the model emits ids past the draft's rows: the draft reads them too
    tokens, _ = await _generate(model, draft, SamplingParams())
    assert tokens == reference
    sampled, _ = await _generate(model, draft, SamplingParams(temperature=0.8, seed=3))
    assert len(sampled) == 24


def test_a_draft_with_another_tokenizer_is_refused(make_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    model = make_checkpoint("llama")
    draft = tmp_path / "draft"
    shutil.copytree(make_checkpoint("llama", layers=2, seed=99), draft)  # vocab_size equal to the model's
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (draft / name).unlink()
    save_tiny_tokenizer(draft, vocab=VOCAB - 16)  # another tokenizer
    config = EdgeConfig(allow_stock_edge_weights=True, model_dir=model, cloud_url="ws://x", draft_model_dir=draft)
    with pytest.raises(ConfigError, match="another tokenizer than the model's"):
        EdgeRuntime(config)
