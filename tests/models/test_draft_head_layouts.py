"""Heads published in the EAGLE layout (what vLLM and SGLang read), written here in that layout and loaded.

The reference is computed from transformers' own LlamaDecoderLayer, fed the way EAGLE-1 feeds it:
``fc(cat([embed(x_{i+1}), norm(f_i)]))`` (the target's post-norm state), no input norm, then the
LM head (the target's, or the head's own reduced one behind its own norm, mapped back by d2t).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

from splitspec.decoding.eagle import _HeadExpander
from splitspec.decoding.tree_run import TreeRun
from splitspec.exceptions import ConfigError
from splitspec.models.checkpoint import Checkpoint
from splitspec.models.draft_head_io import load_draft_head
from splitspec.models.kv_cache import KVCache
from splitspec.models.loading import load_full
from splitspec.models.stack import FullModel
from tests.conftest import tiny_config

LAYERS = 4
DRAFT_VOCAB = 40


@pytest.fixture(scope="module")
def target(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("llama", layers=LAYERS)


@pytest.fixture(scope="module")
def full(target: Path) -> FullModel:
    return load_full(Checkpoint(target), torch.float32)


def _layer_config() -> LlamaConfig:
    config = tiny_config("llama", layers=1)
    assert isinstance(config, LlamaConfig)
    return config


def write_eagle_head(directory: Path, reduced_vocab: bool, seed: int = 0) -> dict[str, torch.Tensor]:
    """An EAGLE-1 head in the published layout (config.json + model.safetensors), random weights."""
    torch.manual_seed(seed)
    config = _layer_config()
    hidden = config.hidden_size
    layer = LlamaDecoderLayer(config, 0)
    state = {f"layers.0.{k}": v for k, v in layer.state_dict().items() if not k.startswith("input_layernorm.")}
    fc = nn.Linear(2 * hidden, hidden, bias=True)
    state |= {"fc.weight": fc.weight.detach(), "fc.bias": fc.bias.detach()}
    state["embed_tokens.weight"] = torch.randn(config.vocab_size, hidden)  # a copy of the target's: ignored
    if reduced_vocab:
        state["lm_head.weight"] = torch.randn(DRAFT_VOCAB, hidden)
        state["norm.weight"] = 1 + 0.1 * torch.randn(hidden)
        target_ids = torch.randperm(config.vocab_size)[:DRAFT_VOCAB].sort().values
        state["d2t"] = target_ids - torch.arange(DRAFT_VOCAB)
    directory.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(directory / "model.safetensors"))
    body = {**config.to_dict(), "architectures": ["LlamaForCausalLM"]}
    (directory / "config.json").write_text(json.dumps(body))
    return state


def eagle1_fc(
    full: FullModel, state: dict[str, torch.Tensor], tokens: torch.Tensor, feats: torch.Tensor
) -> torch.Tensor:
    """EAGLE-1's fc over cat([embed(tokens), feats]), no norm here: tokens (q,), feats (q, H) -> (1, q, H)."""
    with torch.no_grad():
        x = torch.cat([full.embed(tokens[None]), feats[None]], -1)  # (1, q, 2H)
        out: torch.Tensor = x @ state["fc.weight"].T + state["fc.bias"]  # (1, q, H)
    return out


def eagle1_layer(state: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """transformers' own layer, EAGLE-1's (no input norm), over a chain from position 0: x (1, q, H) -> (q, H)."""
    config = _layer_config()
    layer = LlamaDecoderLayer(config, 0)
    layer.load_state_dict(
        {k[len("layers.0.") :]: v for k, v in state.items() if k.startswith("layers.0.")}, strict=False
    )
    layer.input_layernorm = nn.Identity()  # type: ignore[assignment]  # EAGLE-1's first layer has no input norm
    q = x.shape[1]
    with torch.no_grad():
        pos = torch.arange(q)[None]
        rope = LlamaRotaryEmbedding(config)(x, pos)
        mask = torch.full((q, q), float("-inf")).triu(1)[None, None]
        out: torch.Tensor = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=rope)[0]  # (q, H)
    return out


def reference(
    full: FullModel, state: dict[str, torch.Tensor], tokens: torch.Tensor, feats: torch.Tensor
) -> torch.Tensor:
    """EAGLE-1's forward from transformers' own layer: logits (q, V) for a chain from position 0."""
    config = _layer_config()
    q = tokens.shape[0]
    with torch.no_grad():
        out = eagle1_layer(state, eagle1_fc(full, state, tokens, full.norm(feats)))  # (q, H)
        if "lm_head.weight" not in state:
            shared: torch.Tensor = full.lm_head(out)
            return shared.float()
        norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        norm.weight.copy_(state["norm.weight"])
        small = norm(out) @ state["lm_head.weight"].T
        logits = torch.full((q, full.vocab_size), float("-inf"))
        logits[:, torch.arange(DRAFT_VOCAB) + state["d2t"]] = small
        return logits


@pytest.mark.parametrize("reduced_vocab", [False, True])
def test_an_eagle_layout_head_loads_and_runs_as_published(
    target: Path, full: FullModel, tmp_path: Path, reduced_vocab: bool
) -> None:
    state = write_eagle_head(tmp_path / "eagle", reduced_vocab)
    head = load_draft_head(tmp_path / "eagle", Checkpoint(target), target_check=False)
    assert not head.config.input_norm
    assert head.config.normed_features
    assert head.config.target_fingerprint is None
    torch.manual_seed(5)
    tokens = torch.tensor([3, 8, 1, 7, 2])
    feats = 3 * torch.randn(5, 64)  # pre-norm features, as the edge hands them over
    with torch.inference_mode():
        hidden = head(
            full, tokens, feats, torch.arange(5, dtype=torch.int32), torch.arange(-1, 4, dtype=torch.int32), KVCache()
        )
        logits = head.logits(full, hidden)
    want = reference(full, state, tokens, feats)
    assert torch.equal(torch.isinf(logits), torch.isinf(want))
    torch.testing.assert_close(logits[~torch.isinf(want)], want[~torch.isinf(want)], rtol=1e-4, atol=1e-4)
    if reduced_vocab:
        assert int(torch.isfinite(logits[0]).sum()) == DRAFT_VOCAB


def test_an_eagle1_head_reads_its_own_predictions_without_the_targets_norm(target: Path, tmp_path: Path) -> None:
    """The tree's second level reads the root's predicted state ĥ as EAGLE-1 trained it: fc(cat(embed(y), ĥ)),
    with no final norm over ĥ (only the target's own features pass it), under a final norm that is not all ones."""
    state = write_eagle_head(tmp_path / "eagle", reduced_vocab=False)
    full = load_full(Checkpoint(target), torch.float32)
    weight = full.norm.weight
    assert isinstance(weight, torch.Tensor)
    with torch.inference_mode():
        weight.copy_(1 + 0.5 * torch.randn(64, generator=torch.Generator().manual_seed(3)))
    head = load_draft_head(tmp_path / "eagle", Checkpoint(target), target_check=False)
    torch.manual_seed(5)
    tokens, feats = torch.tensor([3, 8, 1, 7, 2]), 3 * torch.randn(5, 64)  # the committed pairs: x_{i+1}, f_i
    child = 11  # a draft root y, expanded at the second level with its parent's prediction ĥ
    cache = KVCache()
    with torch.inference_mode():  # level 1: the committed pairs (as the drafter's catch-up), then the root's child
        out = head(
            full, tokens, feats, torch.arange(5, dtype=torch.int32), torch.arange(-1, 4, dtype=torch.int32), cache
        )
        root = out[-1]  # (H,): ĥ, the state predicted after the last pair
        expand = _HeadExpander(head, full, cache, TreeRun(5), root, head.logits(full, root[None]))
        level2 = expand([child], [-1], [0])[0]  # (V,): the child's logits
    x = torch.cat(
        [eagle1_fc(full, state, tokens, full.norm(feats)), eagle1_fc(full, state, torch.tensor([child]), root[None])],
        1,
    )  # (1, 6, H): the pairs' inputs, then the child's, whose ĥ passes no norm
    with torch.no_grad():
        want = full.lm_head(eagle1_layer(state, x)[-1]).float()  # (V,)
    torch.testing.assert_close(level2, want, rtol=1e-4, atol=1e-4)


def test_the_layer_may_be_named_midlayer(target: Path, full: FullModel, tmp_path: Path) -> None:
    state = write_eagle_head(tmp_path / "eagle", reduced_vocab=False)
    _rewrite(tmp_path / "eagle", _rename_midlayer)
    head = load_draft_head(tmp_path / "eagle", Checkpoint(target), target_check=False)
    tokens, feats = torch.tensor([4, 9, 2]), torch.randn(3, 64)
    with torch.inference_mode():
        hidden = head(
            full, tokens, feats, torch.arange(3, dtype=torch.int32), torch.arange(-1, 2, dtype=torch.int32), KVCache()
        )
        logits = head.logits(full, hidden)
    torch.testing.assert_close(logits, reference(full, state, tokens, feats), rtol=1e-4, atol=1e-4)


def test_a_published_head_needs_the_target_check_off(target: Path, tmp_path: Path) -> None:
    write_eagle_head(tmp_path / "eagle", reduced_vocab=False)
    with pytest.raises(ConfigError, match="--draft-head-target-check off"):
        load_draft_head(tmp_path / "eagle", Checkpoint(target))
    with pytest.raises(ConfigError, match="checkpoint is needed"):
        load_draft_head(tmp_path / "eagle", "0" * 64, target_check=False)


def _rewrite(directory: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    from safetensors.torch import load_file

    state = load_file(str(directory / "model.safetensors"))
    edit(state)
    save_file(state, str(directory / "model.safetensors"))


def _rename_midlayer(state: dict[str, torch.Tensor]) -> None:
    for name in [n for n in state if n.startswith("layers.0.")]:
        state["midlayer." + name[len("layers.0.") :]] = state.pop(name)


def _eagle3(state: dict[str, torch.Tensor]) -> None:
    _rename_midlayer(state)
    state["midlayer.hidden_norm.weight"] = torch.ones(64)
    state["fc.weight"] = torch.randn(64, 3 * 64)


def _duplicate_d2t(state: dict[str, torch.Tensor]) -> None:
    state["d2t"] = -torch.arange(DRAFT_VOCAB)  # every draft id onto target id 0


def _wide_fc(state: dict[str, torch.Tensor]) -> None:
    state["fc.weight"] = torch.randn(64, 4 * 64)


@pytest.mark.parametrize(
    ("edit", "message"),
    [(_eagle3, "EAGLE-3"), (_duplicate_d2t, "d2t"), (_wide_fc, "fc.weight")],
)
def test_what_does_not_fit_is_refused_clearly(
    target: Path, tmp_path: Path, edit: Callable[[dict[str, torch.Tensor]], None], message: str
) -> None:
    write_eagle_head(tmp_path / "eagle", reduced_vocab=True)
    _rewrite(tmp_path / "eagle", edit)
    with pytest.raises(ConfigError, match=message):
        load_draft_head(tmp_path / "eagle", Checkpoint(target), target_check=False)


def test_pickled_weights_are_never_loaded(target: Path, tmp_path: Path) -> None:
    head = tmp_path / "bin"
    head.mkdir()
    (head / "config.json").write_text(json.dumps(_layer_config().to_dict()))
    (head / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(ConfigError, match="never loaded"):
        load_draft_head(head, Checkpoint(target), target_check=False)
