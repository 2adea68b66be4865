"""A reduced draft vocabulary: the most frequent tokens, the head's logits over them, its checkpoint, lossless drafting,
and ``train-drafter --draft-vocab``."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from splitspec.cli import main
from splitspec.decoding.controller import FixedPolicy
from splitspec.decoding.eagle import EagleDrafter
from splitspec.decoding.local import LocalSequence
from splitspec.decoding.loop import SpecStep
from splitspec.decoding.sampling import SamplingParams
from splitspec.decoding.speculative import speculative_decode
from splitspec.exceptions import ConfigError
from splitspec.models.checkpoint import Checkpoint
from splitspec.models.draft_head import DraftHead, default_config
from splitspec.models.draft_head_io import load_draft_head, save_draft_head
from splitspec.models.draft_vocab import frequent_tokens, token_counts, with_draft_vocab, without_draft_vocab
from splitspec.models.loading import load_full
from splitspec.models.stack import FullModel
from splitspec.models.train_draft_head import read_corpus
from tests.conftest import TOKENIZER_TEXT, local_greedy
from tests.families import save_family_checkpoint

PROMPT = [5, 9, 17, 3, 44, 2, 8, 5, 9, 17, 3, 61, 30, 12, 7]


@pytest.fixture(scope="module")
def target(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("llama", layers=4, logit_scale=4.0)


@pytest.fixture(scope="module")
def full(target: Path) -> FullModel:
    return load_full(Checkpoint(target), torch.float32)


def _head(target: Path) -> DraftHead:
    torch.manual_seed(0)
    return DraftHead(default_config(Checkpoint(target)), torch.device("cpu"), torch.float32).eval()


def test_the_most_frequent_tokens_ties_to_the_lower_id() -> None:
    counts = token_counts([torch.tensor([3, 3, 1, 5, 5, 0]), torch.tensor([5, 1])], 8)
    assert counts.tolist() == [1, 2, 0, 2, 0, 3, 0, 0]
    assert frequent_tokens(counts, 1).tolist() == [5]
    assert frequent_tokens(counts, 3).tolist() == [1, 3, 5]  # 1 and 3 tie at 2: both in, ascending
    assert frequent_tokens(counts, 4).tolist() == [0, 1, 3, 5]
    assert frequent_tokens(counts, 5).tolist() == [0, 1, 2, 3, 5]  # then unseen tokens by id
    for size in (0, 8):
        with pytest.raises(ConfigError, match="1 to 7 tokens"):
            frequent_tokens(counts, size)
    with pytest.raises(ConfigError, match="outside"):
        token_counts([torch.tensor([8])], 8)


def test_the_reduced_heads_logits_are_the_full_heads_over_its_tokens(
    target: Path, full: FullModel, tmp_path: Path
) -> None:
    head = _head(target)
    ids = torch.tensor([2, 5, 9, 17, 30, 44, 61, 90])
    reduced = with_draft_vocab(head, full, ids)
    assert reduced.config.draft_vocab == 8
    assert reduced.d2t is not None
    assert (torch.arange(8) + reduced.d2t).tolist() == ids.tolist()
    hidden = torch.randn(5, full.hidden_size)  # (q, H)
    want = head.logits(full, hidden)  # (q, V)
    got = reduced.logits(full, hidden)
    torch.testing.assert_close(got[:, ids], want[:, ids], rtol=1e-5, atol=1e-5)
    outside = torch.ones(full.vocab_size, dtype=torch.bool)
    outside[ids] = False
    assert bool(torch.isinf(got[:, outside]).all())
    assert bool((got[:, outside] < 0).all())
    # it saves and loads as any head (its own LM head and d2t in the checkpoint), and drops back to the full head
    save_draft_head(reduced, tmp_path / "reduced")
    loaded = load_draft_head(tmp_path / "reduced", Checkpoint(target))
    assert loaded.config == reduced.config
    torch.testing.assert_close(loaded.logits(full, hidden), got)
    torch.testing.assert_close(without_draft_vocab(loaded).logits(full, hidden), want)
    with pytest.raises(ConfigError, match="already"):
        with_draft_vocab(reduced, full, ids)
    for bad in (torch.tensor([5, 2]), torch.tensor([3, 3]), torch.tensor([-1, 4]), torch.tensor([4, full.vocab_size])):
        with pytest.raises(ConfigError, match="draft vocabulary ids"):
            with_draft_vocab(head, full, bad)


@pytest.mark.parametrize("family", ["granite", "gemma2"])  # logits scaling; final soft-capping
def test_the_reduced_heads_logits_take_the_familys_logit_transforms(tmp_path: Path, family: str) -> None:
    ckpt = Checkpoint(save_family_checkpoint(tmp_path, family, layers=2, seed=4, dtype=torch.float32))
    ends = load_full(ckpt, torch.float32)
    torch.manual_seed(0)
    head = DraftHead(default_config(ckpt), torch.device("cpu"), torch.float32).eval()
    ids = torch.tensor([1, 7, 20, 33, 64, 90])
    reduced = with_draft_vocab(head, ends, ids)
    hidden = 4 * torch.randn(5, ends.hidden_size)  # (q, H): large enough that Gemma's cap bites
    with torch.inference_mode():
        want = head.logits(ends, hidden)  # (q, V): through the target's own logits
        got = reduced.logits(ends, hidden)
    torch.testing.assert_close(got[:, ids], want[:, ids], rtol=1e-5, atol=1e-5)


def test_a_checkpoint_whose_d2t_leaves_the_vocabulary_is_refused(target: Path, full: FullModel, tmp_path: Path) -> None:
    save_draft_head(with_draft_vocab(_head(target), full, torch.tensor([1, 4, 6])), tmp_path / "bad")
    state = load_file(str(tmp_path / "bad" / "model.safetensors"))
    state["d2t"] = torch.tensor([0, 0, 10_000])
    save_file(state, str(tmp_path / "bad" / "model.safetensors"))
    with pytest.raises(ConfigError, match="d2t maps draft ids outside"):
        load_draft_head(tmp_path / "bad", Checkpoint(target))


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.8)])
async def test_drafting_over_a_reduced_vocabulary_stays_lossless(
    target: Path, full: FullModel, params: SamplingParams
) -> None:
    """Greedy: the output is plain greedy decoding; both: every drafted token is one of the vocabulary's."""
    ids = frequent_tokens(token_counts([torch.tensor(local_greedy(target, PROMPT, 40))], full.vocab_size), 6)
    reduced = with_draft_vocab(_head(target), full, ids)
    verifier = LocalSequence(full)
    verifier.keep_features(reduced.config.feature_layers)
    generator = None if params.greedy else torch.Generator().manual_seed(7)
    drafter = EagleDrafter(reduced, lambda: full, verifier, params, generator, top_k=3, depth=4)
    trace: list[SpecStep] = []
    drafted: Counter[int] = Counter()
    propose = drafter.propose

    def recording(context: list[int], budget: int) -> object:
        draft = propose(context, budget)
        drafted.update(draft.tokens)
        return draft

    drafter.propose = recording  # type: ignore[method-assign,assignment]
    out = speculative_decode(
        verifier, PROMPT, 40, params, torch.Generator().manual_seed(1), {"eagle": drafter}, FixedPolicy("eagle", 6),
        trace=trace,
    )  # fmt: skip
    tokens = [t async for t in out]
    assert sum(drafted.values()) > 0, "the head never drafted"
    assert set(drafted) <= set(ids.tolist())
    if params.greedy:
        assert tokens == local_greedy(target, PROMPT, 40)
    else:
        assert len(tokens) == 40


def test_train_drafter_saves_a_reduced_head_and_resumes_on_the_full_one(target: Path, tmp_path: Path) -> None:
    corpus = tmp_path / "text.txt"
    corpus.write_text((TOKENIZER_TEXT + "\n") * 20)

    def args(out: Path, steps: int, *extra: str) -> list[str]:
        return [
            "-q", "train-drafter", "--model", str(target), "--corpus", str(corpus), "--out", str(out),
            "--steps", str(steps), "--seq-len", "16", "--batch", "2", "--warmup", "10", "--save-every", "2",
            "--no-progress", "--threads", "1", "--device", "cpu", "--draft-vocab", "12", *extra,
        ]  # fmt: skip

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert main(args(straight, 4)) == 0
    head = load_draft_head(straight, Checkpoint(target))
    assert head.config.draft_vocab == 12
    assert head.d2t is not None
    streams = read_corpus([corpus], target, 16)
    want = frequent_tokens(token_counts(streams, int(Checkpoint(target).config.vocab_size)), 12)
    assert (torch.arange(12) + head.d2t).tolist() == want.tolist()
    notes = json.loads((straight / "config.json").read_text())["splitspec_draft_head"]["notes"]
    assert "12 target tokens" in notes["draft_vocab"]
    # stopped at 2 and resumed to 4: the run that never stopped, bit for bit (training went on over the full head)
    assert main(args(resumed, 2)) == 0
    assert main([*args(resumed, 4), "--resume"]) == 0
    done, whole = load_file(str(resumed / "model.safetensors")), load_file(str(straight / "model.safetensors"))
    assert set(done) == set(whole)
    for name in whole:
        assert torch.equal(done[name], whole[name]), name
    assert main(args(tmp_path / "none", 2, "--draft-vocab", "0")) == 2


def test_train_drafter_resumed_at_its_last_step_only_reduces_the_vocabulary(target: Path, tmp_path: Path) -> None:
    """--resume with the saved --steps and --draft-vocab: the finished head saved again over 12 tokens, untrained
    further (it was refused as a run already at its last step); without --draft-vocab that stays refused."""
    corpus = tmp_path / "text.txt"
    corpus.write_text((TOKENIZER_TEXT + "\n") * 20)

    def args(out: Path, steps: int, *extra: str) -> list[str]:
        return [
            "-q", "train-drafter", "--model", str(target), "--corpus", str(corpus), "--out", str(out),
            "--steps", str(steps), "--seq-len", "16", "--batch", "2", "--warmup", "10", "--save-every", "2",
            "--no-progress", "--threads", "1", "--device", "cpu", *extra,
        ]  # fmt: skip

    out, reduced = tmp_path / "head", tmp_path / "reduced"
    assert main(args(out, 2)) == 0
    full = load_file(str(out / "model.safetensors"))
    assert main([*args(out, 2), "--resume"]) == 2  # nothing to do
    assert main([*args(out, 2, "--draft-vocab", "12"), "--resume"]) == 0
    assert json.loads((out / "trainer_state.json").read_text())["step"] == 2
    head = load_draft_head(out, Checkpoint(target))
    assert head.config.draft_vocab == 12
    assert head.lm_head is not None
    assert head.lm_head.weight.shape[0] == 12
    now = load_file(str(out / "model.safetensors"))
    for name in full:  # the layer and its projection as trained: no step was taken
        if name in now:
            assert torch.equal(now[name], full[name]), name
    # the same head as one trained with --draft-vocab from the start
    assert main(args(reduced, 2, "--draft-vocab", "12")) == 0
    want = load_file(str(reduced / "model.safetensors"))
    assert set(now) == set(want)
    for name in want:
        assert torch.equal(now[name], want[name]), name
    assert main([*args(out, 1, "--draft-vocab", "12"), "--resume"]) == 2  # past the saved step: refused
