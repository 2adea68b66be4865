"""Sampling as the checkpoint publishes it (generation_config.json), overridden by what the user gives."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from transformers import GenerationConfig

from splitspec.cli import build_parser
from splitspec.decoding import published as pub
from splitspec.decoding.published import published_sampling, sampling_settings
from splitspec.decoding.sampling import SamplingParams
from splitspec.edge_cli import sampling_params
from splitspec.exceptions import CheckpointError


def checkpoint_with(tmp_path: Path, **generation: object) -> Path:
    (tmp_path / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, **generation}))
    return tmp_path


def test_published_sampling_applies_unless_overridden(tmp_path: Path) -> None:
    model = checkpoint_with(tmp_path, do_sample=True, temperature=0.6, top_p=0.9, top_k=20)
    published = published_sampling(model)
    assert sampling_settings(published) == SamplingParams(temperature=0.6, top_p=0.9, top_k=20)
    assert sampling_settings(published, temperature=1.2, top_k=0, seed=5) == SamplingParams(1.2, 0.9, 5, 0)
    assert sampling_settings(published, temperature=0).greedy  # an explicit 0 is greedy


def test_unset_values_take_transformers_defaults(tmp_path: Path) -> None:
    hf = GenerationConfig._get_default_generation_params()
    assert (
        hf["temperature"],
        hf["top_k"],
        hf["top_p"],
    ) == (pub.HF_DEFAULT_TEMPERATURE, pub.HF_DEFAULT_TOP_K, pub.HF_DEFAULT_TOP_P)
    params = sampling_settings(published_sampling(checkpoint_with(tmp_path, do_sample=True)))
    assert params == SamplingParams(temperature=1.0, top_p=1.0, top_k=50)


def test_greedy_when_the_publisher_does_not_sample_and_it_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = checkpoint_with(tmp_path, do_sample=False, temperature=0.6, top_p=0.9)
    with caplog.at_level(logging.INFO, logger="splitspec.decoding.published"):
        params = sampling_settings(published_sampling(model))
    assert params.greedy
    assert "decoding greedily" in caplog.text
    assert "does not set do_sample" in caplog.text
    assert "temperature 0.6" in caplog.text
    assert "--temperature" in caplog.text
    # asking for sampling keeps the publisher's other settings
    assert sampling_settings(published_sampling(model), temperature=0.8) == SamplingParams(0.8, 0.9, None, 50)
    empty = tmp_path / "none"
    empty.mkdir()
    assert sampling_settings(published_sampling(empty)).greedy  # no generation_config.json at all


@pytest.mark.parametrize("bad", [{"temperature": "hot"}, {"top_k": 2.5}, {"top_p": True}])
def test_a_broken_generation_config_is_named(tmp_path: Path, bad: dict[str, object]) -> None:
    with pytest.raises(CheckpointError, match=r"generation_config\.json"):
        published_sampling(checkpoint_with(tmp_path, do_sample=True, **bad))


def test_the_cli_resolves_like_the_python_api(tmp_path: Path) -> None:
    model = checkpoint_with(tmp_path, do_sample=True, temperature=0.7, top_k=8)
    base = ["generate", "--model", str(model), "--cloud", "ws://x", "--prompt", "p"]
    assert sampling_params(build_parser().parse_args(base)) == SamplingParams(temperature=0.7, top_p=1.0, top_k=8)
    args = build_parser().parse_args([*base, "--top-k", "3", "--top-p", "0.5", "--seed", "9"])
    assert sampling_params(args) == sampling_settings(published_sampling(model), None, 0.5, 3, 9)
    assert sampling_params(build_parser().parse_args([*base, "--temperature", "0"])).greedy


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_published_settings_that_are_not_applied_are_named_in_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Qwen2.5-Instruct's generation_config.json: repetition_penalty 1.05, which ``generate`` does not apply (``serve``
    does); its min_p is applied."""
    model = checkpoint_with(
        tmp_path, do_sample=True, temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05, min_p=0.05,
        no_repeat_ngram_size=3, typical_p=0.9,
    )  # fmt: skip
    with caplog.at_level(logging.INFO, logger="splitspec.decoding.published"):
        params = sampling_settings(published_sampling(model))
        sampling_settings(published_sampling(model))  # the CLI and the runtime both read it: warned once
    assert params == SamplingParams(temperature=0.7, top_p=0.8, top_k=20, min_p=0.05)
    assert sampling_settings(published_sampling(model), min_p=0.0).min_p == 0.0  # a value given wins
    (warning,) = _warnings(caplog)
    for setting in ("repetition_penalty=1.05", "no_repeat_ngram_size=3", "typical_p=0.9"):
        assert setting in warning
    assert "min_p=" not in warning
    assert "does not apply" in warning
    assert str(model / "generation_config.json") in warning


def test_greedy_decoding_names_only_what_generate_applies_without_sampling(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = checkpoint_with(tmp_path, do_sample=False, repetition_penalty=1.1, min_p=0.05)
    with caplog.at_level(logging.WARNING, logger="splitspec.decoding.published"):
        assert sampling_settings(published_sampling(model)).greedy
    (warning,) = _warnings(caplog)
    assert "repetition_penalty=1.1" in warning
    assert "min_p=" not in warning  # applied, and only when sampling


def test_settings_left_off_are_not_warned_about(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    hf = GenerationConfig._get_default_generation_params()
    for key, off in {**pub.UNAPPLIED, **pub.UNAPPLIED_WHEN_SAMPLING}.items():
        assert hf.get(key, off) in (off, None), key  # the values that leave a setting off are transformers' defaults
    neutral = {key: off for key, off in {**pub.UNAPPLIED, **pub.UNAPPLIED_WHEN_SAMPLING}.items() if off is not None}
    model = checkpoint_with(tmp_path, do_sample=True, suppress_tokens=[], repetition_penalty=1.0, min_p=0.0, **neutral)
    with caplog.at_level(logging.WARNING, logger="splitspec.decoding.published"):
        sampling_settings(published_sampling(model))
    assert _warnings(caplog) == []
