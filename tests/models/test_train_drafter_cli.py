"""``splitspec train-drafter`` end to end on a tiny model: it trains, saves, measures, and resumes exactly."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from splitspec.cli import main
from splitspec.models import train_draft_head
from splitspec.models.checkpoint import Checkpoint
from splitspec.models.draft_head_io import load_draft_head
from tests.conftest import TOKENIZER_TEXT


@pytest.fixture(scope="module")
def setup(make_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    corpus = tmp_path_factory.mktemp("corpus") / "text.txt"
    corpus.write_text((TOKENIZER_TEXT + "\n") * 20)
    return make_checkpoint("llama", layers=3), corpus


def _args(model: Path, corpus: Path, out: Path, steps: int, *extra: str) -> list[str]:
    return [
        "-q", "train-drafter", "--model", str(model), "--corpus", str(corpus), "--out", str(out),
        "--steps", str(steps), "--seq-len", "16", "--batch", "2", "--warmup", "10", "--save-every", "2",
        "--no-progress", "--threads", "1", "--device", "cpu", *extra,
    ]  # fmt: skip


def _weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "model.safetensors"))


def test_train_drafter_trains_saves_and_measures(setup: tuple[Path, Path], tmp_path: Path) -> None:
    model, corpus = setup
    out = tmp_path / "head"
    eval_args = (
        "--eval-corpus",
        str(corpus),
        "--eval-prompts",
        "2",
        "--eval-prompt-tokens",
        "8",
        "--eval-new-tokens",
        "6",
    )
    assert main(_args(model, corpus, out, 3, *eval_args)) == 0
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["step"] == 3
    assert state["eval"]["mean_accepted_length"] >= 1.0
    assert state["eval"]["verifications"] >= 1
    assert state["eval"]["held_out"] is False  # evaluated on its own training file, and the record says so
    other = tmp_path / "other.txt"
    other.write_text((TOKENIZER_TEXT + "\n") * 20)
    eval_other = ("--eval-corpus", str(other), *eval_args[2:])
    assert main(_args(model, corpus, tmp_path / "held-out", 1, *eval_other)) == 0
    assert json.loads((tmp_path / "held-out" / "trainer_state.json").read_text())["eval"]["held_out"] is True
    head = load_draft_head(out, Checkpoint(model))  # loads for its own target
    assert head.config.feature_layers == (3,)
    assert head.config.target_name == model.name
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 1
    assert config["splitspec_draft_head"]["notes"]["steps"] == 3


def test_resume_continues_from_the_saved_step_exactly(setup: tuple[Path, Path], tmp_path: Path) -> None:
    model, corpus = setup
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert main(_args(model, corpus, straight, 4)) == 0
    assert main(_args(model, corpus, resumed, 2)) == 0
    halfway = _weights(resumed)
    assert json.loads((resumed / "trainer_state.json").read_text())["step"] == 2
    assert main([*_args(model, corpus, resumed, 4), "--resume"]) == 0
    assert json.loads((resumed / "trainer_state.json").read_text())["step"] == 4
    done, want = _weights(resumed), _weights(straight)
    assert any(not torch.equal(done[n], halfway[n]) for n in done)  # it trained on
    for name in want:  # and it is the run that never stopped, bit for bit
        assert torch.equal(done[name], want[name]), name


def test_a_save_cut_short_leaves_the_last_whole_save(
    setup: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Killed while writing the step-4 save's optimizer state: the step-2 save stays whole and resumes exactly."""
    model, corpus = setup
    straight, cut = tmp_path / "straight", tmp_path / "cut"
    assert main(_args(model, corpus, straight, 6)) == 0
    saves = {"optimizer": 0}

    def dies_on_the_second(tensors: dict[str, torch.Tensor], filename: str, **kwargs: object) -> None:
        if filename.endswith(train_draft_head.OPTIMIZER_FILE):
            saves["optimizer"] += 1
            if saves["optimizer"] == 2:
                raise KeyboardInterrupt  # as a kill would: mid-save, after the head's weights were written
        save_file(tensors, filename, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(train_draft_head, "save_file", dies_on_the_second)
    assert main(_args(model, corpus, cut, 6)) == 130  # interrupted
    monkeypatch.setattr(train_draft_head, "save_file", save_file)
    assert json.loads((cut / "trainer_state.json").read_text())["step"] == 2
    assert main([*_args(model, corpus, cut, 6), "--resume"]) == 0
    done, want = _weights(cut), _weights(straight)
    for name in want:
        assert torch.equal(done[name], want[name]), name


def test_resume_refuses_what_would_not_continue_the_run(setup: tuple[Path, Path], tmp_path: Path) -> None:
    model, corpus = setup
    out = tmp_path / "head"
    assert main(_args(model, corpus, out, 2)) == 0
    assert main([*_args(model, corpus, out, 2), "--resume"]) == 2  # already at step 2
    assert main([*_args(model, corpus, out, 4, "--seed", "7"), "--resume"]) == 2  # other batches
    assert main([*_args(model, corpus, out, 4, "--lr", "0.5"), "--resume"]) == 2  # another schedule
    # files of two steps (a save cut short between its moves) are refused, not resumed from
    state = json.loads((out / "trainer_state.json").read_text())
    (out / "trainer_state.json").write_text(json.dumps(state | {"step": 1}))
    assert main([*_args(model, corpus, out, 4), "--resume"]) == 2
    (out / "trainer_state.json").write_text(json.dumps(state))
    assert main([*_args(model, corpus, out, 4), "--resume"]) == 0


def test_bad_uses_fail_in_one_line(
    setup: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    model, corpus = setup
    assert main([*_args(model, corpus, tmp_path / "empty", 2), "--resume"]) == 2
    assert main(_args(model, corpus, tmp_path / "x", 2, "--feature-layers", "0,9")) == 2
    assert main(_args(model, corpus, tmp_path / "y", 0)) == 2
    # the split's own flags without --cloud were silently ignored (a user believed the trunk was pinned)
    caplog.clear()
    assert main(_args(model, corpus, tmp_path / "z", 2, "--trunk-fingerprint", "ab", "--edge-layers", "1,1")) == 2
    assert "--edge-layers, --trunk-fingerprint apply only with --cloud" in caplog.text


def test_resume_compares_the_corpus_by_resolved_path_and_content(
    setup: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The same file named relative on resume is the same corpus; an edited file under the same name is not."""
    model, _ = setup
    corpus = tmp_path / "text.txt"
    corpus.write_text((TOKENIZER_TEXT + "\n") * 20)
    out = tmp_path / "head"
    assert main(_args(model, corpus, out, 2)) == 0
    monkeypatch.chdir(tmp_path)
    assert main([*_args(model, Path("text.txt"), out, 4), "--resume"]) == 0  # refused as another corpus before
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["step"] == 4
    assert [f["path"] for f in state["corpus_files"]] == [str(corpus.resolve())]
    assert state["corpus_files"][0]["bytes"] == corpus.stat().st_size
    corpus.write_text((TOKENIZER_TEXT + "\n") * 19 + "other text of the same kind\n")  # edited in place
    caplog.clear()
    assert main([*_args(model, corpus, out, 6), "--resume"]) == 2  # accepted before: it named the same path
    assert "changed since the run being resumed" in caplog.text
    other = tmp_path / "other.txt"
    other.write_text(corpus.read_text())
    assert main([*_args(model, other, out, 6), "--resume"]) == 2  # another file
    # a save from before the fingerprints: its paths, resolved, are compared (relative to the current directory)
    state = json.loads((out / "trainer_state.json").read_text())
    del state["corpus_files"]
    state["args"]["corpus"] = ["text.txt"]
    (out / "trainer_state.json").write_text(json.dumps(state))
    assert main([*_args(model, other, out, 6), "--resume"]) == 2
    assert main([*_args(model, corpus, out, 6), "--resume"]) == 0
    assert json.loads((out / "trainer_state.json").read_text())["corpus_files"][0]["path"] == str(corpus.resolve())


def test_evaluation_settings_without_an_evaluation_corpus_are_refused(
    setup: tuple[Path, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """--eval-prompts and the like were accepted and ignored without --eval-corpus."""
    model, corpus = setup
    caplog.clear()
    assert main(_args(model, corpus, tmp_path / "a", 1, "--eval-prompts", "2")) == 2
    assert "--eval-prompts applies only with --eval-corpus" in caplog.text
    caplog.clear()
    assert main(_args(model, corpus, tmp_path / "b", 1, "--eval-depth", "2", "--eval-new-tokens", "6")) == 2
    assert "--eval-new-tokens, --eval-depth apply only with --eval-corpus" in caplog.text
    assert not (tmp_path / "a").exists()  # refused before training
    assert not (tmp_path / "b").exists()
    assert main(_args(model, corpus, tmp_path / "c", 1, "--eval-prompts", "16")) == 0  # the default is no setting
    # and the split's compute dtype and wire codec mean nothing without --cloud
    caplog.clear()
    assert main(_args(model, corpus, tmp_path / "d", 1, "--dtype", "bfloat16", "--wire-codec", "bf16")) == 2
    assert "--dtype, --wire-codec apply only with --cloud" in caplog.text
