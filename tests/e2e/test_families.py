"""Every family splitspec runs, split over loopback: greedy output equals transformers' own generate.

For each family (tiny random checkpoints published in bfloat16, saved with save_pretrained), at
the checkpoint's own dtype and at float32: one trunk server, one edge client with a draft model of
the same family, and three checks against ``generate(do_sample=False)`` of the HF model loaded the
way its publisher meant (``from_pretrained`` at the published dtype, or float32):

* ``--speculate off`` output equals it token for token;
* ``--speculate draft`` output equals it (dynamic draft trees, several branches verified at once);
* one explicit draft-tree step: every node's logits predict what HF predicts after that node's
  own path (siblings invisible to each other, sliding windows applied).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, TemperatureLogitsWarper, TopPLogitsWarper

from splitspec.cloud.config import CloudConfig
from splitspec.cloud.server import TrunkServer
from splitspec.decoding.sampling import SamplingParams
from splitspec.edge import EdgeConfig, SplitClient
from tests.conftest import law_fit_pvalue
from tests.families import FAMILIES, LAYERS, save_family_checkpoint

PROMPT = [5, 9, 17, 3, 44, 2, 8, 61, 30, 12, 7]  # longer than every sliding window (6)
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def family_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, Path]]:
    """(target, draft) checkpoints of a family, built once per module, published in bfloat16."""
    built: dict[str, tuple[Path, Path]] = {}

    def get(name: str) -> tuple[Path, Path]:
        if name not in built:
            root = tmp_path_factory.mktemp(name)
            target = save_family_checkpoint(root / "target", name, LAYERS, seed=11, dtype=torch.bfloat16)
            draft = save_family_checkpoint(root / "draft", name, 2, seed=12, dtype=torch.bfloat16)
            built[name] = (target, draft)
        return built[name]

    return get


def hf_greedy(model: torch.nn.Module, prompt: list[int], new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(  # type: ignore[operator]
            torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0
        )
    return list(out[0, len(prompt) :].tolist())


def hf_next(model: torch.nn.Module, sequence: list[int]) -> int:
    with torch.no_grad():
        return int(model(torch.tensor([sequence])).logits[0, -1].argmax())


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"], ids=["own-dtype", "float32"])  # pinned: any CPU
@pytest.mark.parametrize("family", sorted(FAMILIES))
async def test_family_split_greedy_equals_hf_generate(
    family_checkpoints: Callable[[str], tuple[Path, Path]], family: str, dtype: str
) -> None:
    target, draft = family_checkpoints(family)
    hf = AutoModelForCausalLM.from_pretrained(
        target, **({} if dtype == "bfloat16" else {"dtype": torch.float32})
    ).eval()
    assert hf.dtype == (torch.bfloat16 if dtype == "bfloat16" else torch.float32)
    expected = hf_greedy(hf, PROMPT, NEW_TOKENS)
    assert len(set(expected)) > 2, "degenerate reference output: the test would prove little"
    edge = EdgeConfig(
        model_dir=target,
        cloud_url="",
        edge_layers=(1, 1),
        dtype=dtype,
        draft_model_dir=draft,
        allow_stock_edge_weights=True,
    )
    async with TrunkServer(CloudConfig(model_dir=target, edge_layers=(1, 1), port=0, dtype=dtype)) as server:
        async with SplitClient(dataclasses.replace(edge, cloud_url=server.url)) as client:
            assert client.dtype == hf.dtype
            off = await client.generate(PROMPT, NEW_TOKENS, speculate="off")
            drafted = await client.generate(PROMPT, NEW_TOKENS, speculate="draft")
            # one explicit tree step after the prompt: two roots (the greedy token and another),
            # the greedy root with two children, the greedy chain continued one level deeper
            client.reset()
            await client.forward(PROMPT)
            other = (expected[0] + 1) % 96
            tree = [expected[0], other, expected[1], other, expected[2]]
            parents = [-1, -1, 0, 0, 2]
            logits = await client.forward(tree, parents)
    assert off.token_ids == expected
    assert drafted.token_ids == expected
    assert sum(s.draft_tokens for s in drafted.spec_steps) > 0, "the draft model never drafted"
    paths = [[tree[0]], [other], [tree[0], tree[2]], [tree[0], other], [tree[0], tree[2], tree[4]]]
    assert logits.argmax(-1).tolist() == [hf_next(hf, PROMPT + path) for path in paths]


async def test_gemma2_split_sampling_keeps_the_soft_capped_law(tmp_path: Path) -> None:
    """Chi-square: split samples follow HF's Gemma 2 law (final soft-capping, temperature, top-p)."""
    model = save_family_checkpoint(tmp_path, "gemma2", LAYERS, seed=5, dtype=torch.float32, vocab=16)
    prompt, temperature, top_p, n = [3, 1, 4, 1, 5, 9, 2, 6], 0.8, 0.9, 600
    hf = AutoModelForCausalLM.from_pretrained(model).eval()
    assert hf.config.final_logit_softcapping is not None
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[:, -1]  # soft-capped by Gemma2ForCausalLM
    law = TopPLogitsWarper(top_p)(None, TemperatureLogitsWarper(temperature)(None, logits)).softmax(-1)[0]
    assert 3 <= int((law > 0).sum()) < 16, "the law must be one that top-p actually trims"
    counts: Counter[int] = Counter()
    edge = EdgeConfig(model_dir=model, cloud_url="", edge_layers=(1, 1), allow_stock_edge_weights=True)
    async with TrunkServer(CloudConfig(model_dir=model, edge_layers=(1, 1), port=0)) as server:
        async with SplitClient(dataclasses.replace(edge, cloud_url=server.url)) as client:
            for seed in range(n):
                params = SamplingParams(temperature=temperature, top_p=top_p, seed=seed)
                counts[(await client.generate(prompt, 1, params, stop_token_ids=())).token_ids[0]] += 1
    assert all(law[t] > 0 for t in counts), "sampled a token outside the law's support"
    assert law_fit_pvalue(counts, law, n) > 1e-3
