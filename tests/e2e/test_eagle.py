"""EAGLE drafting over the split: a draft head trained for the model drafts from the edge's own features.

Through a real trunk server on loopback: greedy output with the head equals one-token greedy output
(two families, float32) and the head's drafts are accepted; a stripped edge (only its own layers)
trains a head through the split that matches one trained on the whole model; under sampling, the
head's trees (several roots, drawn without replacement) keep the model's law (chi-square).
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from splitspec.cli import main as cli_main
from splitspec.cloud.config import CloudConfig
from splitspec.cloud.server import TrunkServer
from splitspec.decoding.controller import FixedPolicy
from splitspec.decoding.eagle import EagleDrafter
from splitspec.decoding.local import LocalSequence
from splitspec.decoding.loop import SpecStep
from splitspec.decoding.sampling import SamplingParams, probabilities
from splitspec.decoding.speculative import speculative_decode
from splitspec.decoding.trees import Draft
from splitspec.edge import EdgeConfig, SplitClient
from splitspec.edge.split_features import SplitFeatures
from splitspec.exceptions import ConfigError
from splitspec.models.checkpoint import Checkpoint, load_tokenizer
from splitspec.models.draft_head import DraftHead, default_config
from splitspec.models.draft_head_eval import greedy_chains
from splitspec.models.draft_head_io import load_draft_head
from splitspec.models.draft_vocab import with_draft_vocab
from splitspec.models.loading import load_full
from splitspec.models.train_draft_head import LocalFeatures, TrainConfig, local_source, train
from tests.conftest import TOKENIZER_TEXT, joint_law_pvalue, local_greedy
from tests.decoding.test_speculative import PromptOnceSequence
from tests.e2e.test_trunk_fingerprint import edge_only_copy

LAYERS = 6


def _corpus(directory: Path) -> Path:
    path = directory / "train.txt"
    path.write_text((TOKENIZER_TEXT + "\n") * 40)
    return path


async def _train(target: Path, out: Path, steps: int = 60, feature_layers: tuple[int, ...] | None = None) -> Path:
    config = TrainConfig(
        model=target, corpus=(_corpus(out.parent),), out=out, steps=steps, seq_len=32, batch=4, progress=False,
        device="cpu", feature_layers=feature_layers,
    )  # fmt: skip
    await train(config, local_source(config))
    return out


def _prompt(target: Path) -> list[int]:
    ids: list[int] = load_tokenizer(target)(TOKENIZER_TEXT, add_special_tokens=False).input_ids
    return ids[:12]


@pytest.mark.parametrize(
    ("family", "feature_layers"),
    [
        ("llama", None),  # the tail's output (the default: the last layer)
        ("qwen2", None),
        ("llama", (3,)),  # the middle of the model: the trunk returns the state after layer 3 with every step
    ],
)
async def test_greedy_split_output_with_the_head_equals_one_token_greedy(
    make_checkpoint: Callable[..., Path], tmp_path: Path, family: str, feature_layers: tuple[int, ...] | None
) -> None:
    target = make_checkpoint(family, layers=LAYERS, logit_scale=4.0)
    head = await _train(target, tmp_path / "head", feature_layers=feature_layers)
    prompt = _prompt(target)
    async with TrunkServer(CloudConfig(model_dir=target, port=0)) as server:
        config = EdgeConfig(
            allow_stock_edge_weights=True, model_dir=target, cloud_url=server.url, draft_head_dir=head, dtype="float32"
        )
        async with SplitClient(config) as client:
            result = await client.generate(prompt, 40, SamplingParams(), speculate="eagle")
            auto = await client.generate(prompt, 40, SamplingParams(), speculate="auto")
            # the head drafts from the split edge's features what it drafts from the whole model's
            committed = list(client.sequence.tokens)
            runtime = client.runtime
            assert runtime.draft_head is not None
            split_draft = EagleDrafter(runtime.draft_head, runtime.ends, client.sequence, SamplingParams())
            drafted_here = split_draft.propose([*committed, prompt[0]], 12)
    full = load_full(Checkpoint(target), torch.float32)
    local = LocalSequence(full)
    local.keep_features(runtime.draft_head.config.feature_layers)
    local.run(committed)
    local_draft = EagleDrafter(load_draft_head(head, Checkpoint(target)), lambda: full, local, SamplingParams())
    drafted_locally = local_draft.propose([*committed, prompt[0]], 12)
    assert len(drafted_here) == 12
    assert (drafted_here.tokens, drafted_here.parents) == (drafted_locally.tokens, drafted_locally.parents)
    assert result.token_ids == local_greedy(target, prompt, 40)
    assert auto.token_ids == result.token_ids
    drafted = [s for s in result.spec_steps if s.drafter == "eagle"]
    assert drafted, "the head never drafted"
    asked = [s.feature_bytes_down for s in result.steps]
    assert all(asked) if feature_layers else not any(asked)  # the trunk's state is asked for only when read
    if feature_layers is None:  # a tiny random model's next token comes from its last layers, not its middle
        # per drafted step, not in all: how many steps the controller drafts on follows the machine's timings
        # (19 of 20 here, fewer on a loaded CI runner); an untrained head's tokens are ~never accepted
        rate = sum(s.accepted for s in drafted) / len(drafted)
        assert rate >= 0.5, f"the trained head's drafts were hardly ever accepted ({rate:.2f} tokens per drafted step)"
        assert len(result.steps) < 40, "speculation saved no round trip"


async def test_a_head_for_another_model_is_refused(make_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    head = await _train(make_checkpoint("llama", layers=LAYERS, logit_scale=4.0), tmp_path / "head", steps=2)
    other = make_checkpoint("llama", layers=LAYERS, seed=77)
    config = EdgeConfig(
        allow_stock_edge_weights=True, model_dir=other, cloud_url="ws://127.0.0.1:1", draft_head_dir=head
    )
    with pytest.raises(ConfigError, match="was trained for") as caught:
        SplitClient(config)
    assert "\n" not in str(caught.value)


async def test_a_stripped_edge_trains_a_head_through_the_split(
    make_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    """``train-drafter --cloud``: an edge holding only its own layers trains on features read through a trunk
    server (each row's features and logits those of the whole model); the head is pinned to the whole model,
    and it drafts better than an untrained one."""
    target = make_checkpoint("llama", layers=LAYERS, logit_scale=4.0)
    edge = edge_only_copy(target, tmp_path)
    assert not any(k.startswith("model.layers.3.") for k in load_file(edge / "model.safetensors"))
    corpus = _corpus(tmp_path)
    async with TrunkServer(CloudConfig(model_dir=target, port=0)) as server:
        args = ["train-drafter", "--model", str(edge), "--corpus", str(corpus), "--out", str(tmp_path / "split-head"),
                "--steps", "40", "--seq-len", "32", "--batch", "4", "--no-progress", "--device", "cpu",
                "--cloud", server.url, "--edge-layers", "2,2", "--allow-stock-edge-weights",
                "--trunk-fingerprint", str(server.trunk_fingerprint)]  # fmt: skip
        assert await asyncio.to_thread(cli_main, args) == 0
        # what it trained on is what the whole model computes: every row's feature and logits
        config = EdgeConfig(model_dir=edge, cloud_url=server.url, allow_stock_edge_weights=True, dtype="float32",
                            trunk_fingerprint=str(server.trunk_fingerprint))  # fmt: skip
        window = _prompt(target)
        full = load_full(Checkpoint(target), torch.float32)
        source = LocalFeatures(full, (LAYERS,))
        async with SplitClient(config) as client:
            through = await SplitFeatures(client, (LAYERS,)).features(window)
            middle = await SplitFeatures(client, (3,)).features(window)  # a state inside the trunk, asked for
        here = await source.features(window)
        middle_here = await LocalFeatures(full, (3,)).features(window)
    for a, b in [*zip(through, here, strict=True), *zip(middle, middle_here, strict=True)]:
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    prompt = _prompt(target)
    prompts = [prompt[:6], prompt[4:12]]
    split = greedy_chains(load_draft_head(tmp_path / "split-head", Checkpoint(target)), source, prompts, 24, 4)
    torch.manual_seed(5)
    untrained = DraftHead(default_config(Checkpoint(target)), torch.device("cpu"), torch.float32).eval()
    bad = greedy_chains(untrained, source, prompts, 24, 4)
    assert split.mean_accepted_length > bad.mean_accepted_length + 0.25, (split, bad)


async def test_a_head_trains_through_a_bfloat16_trunk(make_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    """``train-drafter --cloud --dtype bfloat16`` against the usual GPU trunk (``cloud serve --dtype bfloat16``):
    it was pinned to float32 with the raw codec, and the handshake refused it. The head trains in float32 on the
    features converted; a float32 edge crosses with --wire-codec bf16, and a pinned float32 one with raw is refused."""
    target = make_checkpoint("llama", layers=LAYERS, logit_scale=4.0)
    corpus = _corpus(tmp_path)
    async with TrunkServer(CloudConfig(model_dir=target, port=0, dtype="bfloat16")) as server:

        def run(out: str, *extra: str) -> int:
            return cli_main(
                ["-q", "train-drafter", "--model", str(target), "--corpus", str(corpus), "--out", str(tmp_path / out),
                 "--steps", "1", "--seq-len", "16", "--batch", "2", "--no-progress", "--device", "cpu",
                 "--cloud", server.url, "--allow-stock-edge-weights", *extra]
            )  # fmt: skip

        assert await asyncio.to_thread(run, "bf16", "--dtype", "bfloat16") == 0
        assert await asyncio.to_thread(run, "codec", "--dtype", "float32", "--wire-codec", "bf16") == 0
        assert await asyncio.to_thread(run, "refused", "--dtype", "float32") == 2
    for out in ("bf16", "codec"):
        assert json.loads((tmp_path / out / "trainer_state.json").read_text())["step"] == 1
        weights = load_file(str(tmp_path / out / "model.safetensors"))
        assert all(w.dtype == torch.float32 and bool(w.isfinite().all()) for w in weights.values()), out
        moments = load_file(str(tmp_path / out / "optimizer.safetensors"))
        assert {m.dtype for k, m in moments.items() if not k.endswith("/step")} == {torch.float32}
        load_draft_head(tmp_path / out, Checkpoint(target))


class Recording:
    """An EAGLE drafter that remembers its drafts."""

    name = "eagle"

    def __init__(self, inner: EagleDrafter) -> None:
        self.inner = inner
        self.drafts: list[Draft] = []

    def propose(self, context: Sequence[int], budget: int) -> Draft:
        draft = self.inner.propose(context, budget)
        self.drafts.append(draft)
        return draft


@pytest.mark.parametrize("draft_vocab", [None, (0, 2, 3, 5, 8, 9, 11, 12, 13, 15)])
async def test_the_heads_sampled_trees_keep_the_model_law(
    make_checkpoint: Callable[..., Path], draft_vocab: tuple[int, ...] | None
) -> None:
    """Joint law of the first two tokens when the second comes from a verified tree of the head's draws (over the
    whole vocabulary, and over a reduced one of 10 of its 16 tokens)."""
    directory = make_checkpoint("llama", vocab=16, layers=4, logit_scale=5.0)
    model = load_full(Checkpoint(directory), torch.float32)
    torch.manual_seed(3)
    head = DraftHead(default_config(Checkpoint(directory)), torch.device("cpu"), torch.float32).eval()
    if draft_vocab is not None:
        head = with_draft_vocab(head, model, torch.tensor(draft_vocab))
    params = SamplingParams(temperature=0.9, top_p=0.95)
    prompt = [0, 13, 2, 8, 0, 0, 15, 12, 11, 15]
    with torch.no_grad():
        p1 = probabilities(LocalSequence(model).run(prompt)[-1], params.temperature, params.top_p)
        p2 = torch.stack(
            [
                probabilities(LocalSequence(model).run([*prompt, t])[-1], params.temperature, params.top_p)
                for t in range(16)
            ]
        )
    joint = p1[:, None] * p2  # (16, 16)
    n = 1000
    counts: Counter[tuple[int, int]] = Counter()
    branched = 0
    # each run draws what it would on a fresh LocalSequence(model) keeping the head's features
    verifier = PromptOnceSequence(model, prompt, head.config.feature_layers)
    for seed in range(n):
        inner = EagleDrafter(head, lambda: model, verifier, params, torch.Generator().manual_seed(10_000 + seed), 3, 3)
        drafter = Recording(inner)
        trace: list[SpecStep] = []
        out = speculative_decode(
            verifier, prompt, 6, params, torch.Generator().manual_seed(seed), {"eagle": drafter},
            FixedPolicy("eagle", 4), trace=trace,
        )  # fmt: skip
        tokens = []
        async for token in out:
            tokens.append(token)
            if len(tokens) == 2:
                break
        counts[(tokens[0], tokens[1])] += 1
        branched += bool(drafter.drafts) and drafter.drafts[0].parents.count(-1) > 1
    assert branched > n // 2, "the second token must mostly come from a verified tree with several roots"
    assert all(joint[c] > 0 for c in counts), "sampled a token pair outside the law's support"
    assert joint_law_pvalue(counts, joint, n) > 1e-3
