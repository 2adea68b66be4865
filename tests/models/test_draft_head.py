"""The EAGLE-style draft head: shapes, masks, the pair convention, its checkpoint and the target pin."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from splitspec.exceptions import ConfigError
from splitspec.models.checkpoint import Checkpoint, load_tokenizer
from splitspec.models.draft_head import DraftHead, default_config, target_fingerprint
from splitspec.models.draft_head_eval import greedy_chains
from splitspec.models.draft_head_io import load_draft_head, save_draft_head
from splitspec.models.kv_cache import KVCache
from splitspec.models.loading import load_full
from splitspec.models.stack import FullModel
from splitspec.models.train_draft_head import LocalFeatures, TrainConfig, train_local
from tests.conftest import TOKENIZER_TEXT, local_greedy

LAYERS = 4


def _ints(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


@pytest.fixture(scope="module")
def target(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("llama", layers=LAYERS, logit_scale=4.0)


@pytest.fixture(scope="module")
def full(target: Path) -> FullModel:
    return load_full(Checkpoint(target), torch.float32)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "train.txt"
    path.write_text((TOKENIZER_TEXT + "\n") * 40)
    return path


def _new_head(target: Path, seed: int = 0) -> DraftHead:
    torch.manual_seed(seed)
    return DraftHead(default_config(Checkpoint(target)), torch.device("cpu"), torch.float32).eval()


@pytest.fixture(scope="module")
def trained(target: Path, corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[DraftHead, Path]:
    out = tmp_path_factory.mktemp("head")
    config = TrainConfig(
        model=target, corpus=(corpus,), out=out, steps=60, seq_len=32, batch=4, progress=False, device="cpu"
    )
    head, _ = train_local(config)
    return head, out


def test_forward_shapes_and_cache(target: Path, full: FullModel) -> None:
    head = _new_head(target)
    cache = KVCache()
    feats = torch.randn(3, head.config.feature_width)  # (q, F*H)
    with torch.inference_mode():
        hidden = head(full, torch.tensor([5, 6, 7]), feats, _ints([0, 1, 2]), _ints([-1, 0, 1]), cache)
        logits = head.logits(full, hidden)
    assert hidden.shape == (3, 64)
    assert logits.shape == (3, full.vocab_size)
    assert logits.dtype == torch.float32
    assert len(cache) == 3
    assert head.config.feature_layers == (LAYERS,)


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_a_tree_step_equals_its_branches_run_alone(make_checkpoint: Callable[..., Path], family: str) -> None:
    """A sibling in a tree step sees its parent, not its sibling: the masks come from the shared machinery;
    the layer is each family's own (Qwen2's q/k/v biases, Mistral's sliding window of 8)."""
    target = make_checkpoint(family, layers=LAYERS)
    full = load_full(Checkpoint(target), torch.float32)
    head = _new_head(target)
    assert type(head.layer).__name__ == f"{'Qwen2' if family == 'qwen2' else family.capitalize()}DecoderLayer"
    feats = torch.randn(4, head.config.feature_width)
    prefix, tree_cache = KVCache(), KVCache()
    with torch.inference_mode():
        head(full, torch.tensor([3, 4]), feats[:2], _ints([0, 1]), _ints([-1, 0]), tree_cache)
        head(full, torch.tensor([3, 4]), feats[:2], _ints([0, 1]), _ints([-1, 0]), prefix)
        # tree: query 0 (pos 2), then two children of it (both pos 3)
        tree = head(full, torch.tensor([9, 10, 11]), feats[[2, 3, 3]], _ints([2, 3, 3]), _ints([-1, 0, 0]), tree_cache)
        alone = head(full, torch.tensor([9, 11]), feats[[2, 3]], _ints([2, 3]), _ints([-1, 0]), prefix)
    torch.testing.assert_close(tree[[0, 2]], alone, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(tree[1], tree[2])


def test_training_beats_an_untrained_head_and_chains_match_greedy(
    target: Path, full: FullModel, trained: tuple[DraftHead, Path]
) -> None:
    """The pair convention end to end: the trained head's chains are accepted far more often, and the output of
    greedy chains verified by the target is the target's own greedy output."""
    head, _ = trained
    source = LocalFeatures(full, (LAYERS,))
    tokens = load_tokenizer(target)(TOKENIZER_TEXT)["input_ids"]
    prompts = [tokens[:6], tokens[10:18]]
    good = greedy_chains(head, source, prompts, 24, 4)
    bad = greedy_chains(_new_head(target, seed=1), source, prompts, 24, 4)
    assert good.mean_accepted_length > bad.mean_accepted_length + 0.5, (good, bad)
    for prompt, out in zip(prompts, good.tokens, strict=True):
        assert list(out) == local_greedy(target, list(prompt), 24)
    assert bad.tokens == good.tokens


def test_save_load_round_trip_is_bit_exact(target: Path, full: FullModel, tmp_path: Path) -> None:
    head = _new_head(target, seed=3)
    save_draft_head(head, tmp_path / "h")
    back = load_draft_head(tmp_path / "h", Checkpoint(target))
    for (name, a), (_, b) in zip(head.state_dict().items(), back.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert back.config == head.config
    feats = torch.randn(2, head.config.feature_width)
    with torch.inference_mode():
        args = (torch.tensor([1, 2]), feats, _ints([0, 1]), _ints([-1, 0]))
        assert torch.equal(head(full, *args, KVCache()), back(full, *args, KVCache()))
    # the fingerprint string identifies the target as well as its checkpoint does
    load_draft_head(tmp_path / "h", target_fingerprint(Checkpoint(target)))


def test_a_head_for_another_model_is_refused_in_one_line(
    target: Path, make_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    other = make_checkpoint("llama", layers=LAYERS, logit_scale=4.0, seed=99)
    save_draft_head(_new_head(target), tmp_path / "h")
    with pytest.raises(ConfigError) as info:
        load_draft_head(tmp_path / "h", Checkpoint(other))
    message = str(info.value)
    assert "\n" not in message
    assert target.name in message
    assert other.name in message
    assert target_fingerprint(Checkpoint(target))[:12] in message
    assert target_fingerprint(Checkpoint(other))[:12] in message
    load_draft_head(tmp_path / "h", Checkpoint(other), target_check=False)  # an explicit override still loads


def test_a_head_whose_shapes_do_not_fit_is_refused_with_the_target_check_off(
    target: Path, make_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    """--draft-head-target-check off loads a head for another model "when its shapes fit": a head for hidden 64
    over a hidden-32 target is refused at load, not at its first draft."""
    narrow = make_checkpoint("llama", layers=LAYERS, hidden=32)
    save_draft_head(_new_head(target), tmp_path / "h")
    with pytest.raises(ConfigError, match=r"is for hidden size 64, but .*'s is 32: it cannot draft for this target"):
        load_draft_head(tmp_path / "h", Checkpoint(narrow), target_check=False)


def test_the_fingerprint_is_the_same_from_a_stripped_edge_checkpoint(target: Path, tmp_path: Path) -> None:
    whole = Checkpoint(target)
    keep = [n for n in whole.tensor_names if not n.startswith(("model.layers.1.", "model.layers.2."))]
    stripped = tmp_path / "edge"
    stripped.mkdir()
    save_file(whole.read(keep), str(stripped / "model.safetensors"))
    (stripped / "config.json").write_text((target / "config.json").read_text())
    assert target_fingerprint(Checkpoint(stripped)) == target_fingerprint(whole)
    # and it is the weights', not only the config's: a changed last layer changes it
    tensors = whole.read(keep)
    tensors[f"model.layers.{LAYERS - 1}.mlp.down_proj.weight"] += 1e-3
    save_file(tensors, str(stripped / "model.safetensors"))
    assert target_fingerprint(Checkpoint(stripped)) != target_fingerprint(whole)
