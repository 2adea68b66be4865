"""``serve --generation-config``: the checkpoint's generation_config.json gives the sampling a request
leaves unset (vLLM's default, ``auto``), or OpenAI's neutral defaults (``vllm``); a value sent wins."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import openai
import pytest

from splitspec.cli import build_parser
from splitspec.decoding import published as pub
from splitspec.decoding.published import published_sampling
from splitspec.decoding.sampling import SamplingParams
from splitspec.exceptions import CheckpointError, ConfigError
from splitspec.serve.config import ServeConfig
from splitspec.serve.errors import ApiError
from splitspec.serve.prompt_budget import token_budget
from splitspec.serve.sampling_defaults import SamplingDefaults, sampling_defaults
from tests.serve.conftest import MODEL_NAME, Stack
from tests.serve.helpers import chat, complete

ASK = [{"role": "user", "content": "to be or not"}]


def published_with(tmp_path: Path, **generation: object) -> pub.PublishedSampling:
    (tmp_path / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, **generation}))
    return published_sampling(tmp_path)


def test_the_files_values_are_the_defaults_under_auto_and_a_sent_value_wins(tmp_path: Path) -> None:
    # Qwen2.5-Instruct's values; as vLLM, they apply without do_sample too
    published = published_with(tmp_path, temperature=0.7, top_p=0.8, top_k=20)
    defaults = sampling_defaults(published, "auto")
    assert defaults == SamplingDefaults(0.7, 0.8, 20)
    assert defaults.params(None, None, None, 3) == SamplingParams(temperature=0.7, top_p=0.8, seed=3, top_k=20)
    assert defaults.params(0.0, None, None, None).greedy  # a temperature sent wins, 0 included
    assert defaults.params(1.2, 1.0, -1, None) == SamplingParams(temperature=1.2, top_p=1.0, top_k=0)  # -1: all
    assert sampling_defaults(published, "vllm") == SamplingDefaults()  # the file is not read for defaults
    only_top_p = sampling_defaults(published_with(tmp_path, top_p=0.5), "auto")
    assert (only_top_p.temperature, only_top_p.top_p, only_top_p.top_k) == (1.0, 0.5, 0)  # the rest stay neutral
    assert sampling_defaults(published_with(tmp_path, top_k=-1), "auto").top_k == 0


def test_the_files_max_new_tokens_is_the_default_max_tokens_under_auto(tmp_path: Path) -> None:
    assert sampling_defaults(published_with(tmp_path, max_new_tokens=512), "auto") == SamplingDefaults(max_tokens=512)
    assert sampling_defaults(published_with(tmp_path, max_new_tokens=512), "vllm").max_tokens is None
    assert sampling_defaults(published_with(tmp_path, temperature=0.6), "auto").max_tokens is None
    # as vLLM: a value sent wins, even above the default; none sent: the default, up to what the context has left
    assert token_budget(10, 300, 64, 1000, "prompt") == 300
    assert token_budget(10, None, 64, 1000, "prompt") == 64
    assert token_budget(990, None, 64, 1000, "prompt") == 10
    assert token_budget(10, None, None, 1000, "prompt") == 990
    with pytest.raises(ApiError, match="maximum context length is 1000 tokens"):
        token_budget(1000, None, 64, 1000, "prompt")  # no room left: still refused


@pytest.mark.parametrize("bad", [0, -3, 1.5, "64", True])
def test_a_bad_max_new_tokens_names_the_file(tmp_path: Path, bad: object) -> None:
    with pytest.raises(CheckpointError, match=r"generation_config\.json: max_new_tokens must be a positive integer"):
        published_with(tmp_path, max_new_tokens=bad)


def test_without_sampling_values_the_defaults_are_openais(tmp_path: Path) -> None:
    assert sampling_defaults(published_with(tmp_path, do_sample=True), "auto") == SamplingDefaults()
    assert SamplingDefaults().params(None, None, None, None) == SamplingParams(temperature=1.0, top_p=1.0, top_k=0)


@pytest.mark.parametrize(
    "bad", [{"top_p": 0.0}, {"top_p": 1.5}, {"temperature": -1.0}, {"top_k": -5}, {"min_p": 1.5}, {"min_p": -0.5}]
)
def test_an_out_of_range_default_names_the_file(tmp_path: Path, bad: dict[str, object]) -> None:
    with pytest.raises(CheckpointError, match=r"generation_config\.json: (top_p|temperature|top_k|min_p)"):
        sampling_defaults(published_with(tmp_path, **bad), "auto")


def test_the_files_min_p_and_repetition_penalty_are_defaults_and_unapplied_settings_are_named_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """As vLLM's ``auto``: Qwen2.5-Instruct's repetition_penalty 1.05 and a min_p become the defaults, named in the
    INFO line; a setting splitspec does not apply is named in one WARNING."""
    pub._warned.clear()
    published = published_with(tmp_path, temperature=0.7, repetition_penalty=1.05, min_p=0.1, typical_p=0.9)
    with caplog.at_level(logging.INFO, logger="splitspec"):
        defaults = sampling_defaults(published, "auto")
    assert defaults == SamplingDefaults(temperature=0.7, min_p=0.1, repetition_penalty=1.05)
    assert defaults.params(None, None, None, None).min_p == 0.1
    assert defaults.params(None, None, None, None, 0.0).min_p == 0.0  # a value sent wins
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "typical_p=0.9" in warnings[0]
    assert "repetition_penalty=" not in warnings[0]
    assert "min_p=" not in warnings[0]
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert any("temperature 0.7, min_p 0.1, repetition_penalty 1.05" in line for line in infos)
    caplog.clear()
    pub._warned.clear()
    with caplog.at_level(logging.INFO, logger="splitspec"):
        # a penalty alone is a default too; vllm ignores the file
        assert sampling_defaults(published_with(tmp_path, repetition_penalty=1.1), "auto") == SamplingDefaults(
            repetition_penalty=1.1
        )
        assert sampling_defaults(published_with(tmp_path, repetition_penalty=1.2), "vllm") == SamplingDefaults()
        sampling_defaults(published_with(tmp_path, no_repeat_ngram_size=3), "auto")
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        f"{tmp_path / 'generation_config.json'} sets no_repeat_ngram_size=3, which splitspec does not apply here: "
        "output differs from the publisher's own generate call (splitspec takes temperature, top_p, top_k, min_p and, "
        "in its commands, repetition_penalty from the file)"
    ]


@pytest.mark.parametrize("bad", [0, -1.05, "1.1", True])
def test_a_bad_repetition_penalty_names_the_file(tmp_path: Path, bad: object) -> None:
    with pytest.raises(CheckpointError, match=r"generation_config\.json: repetition_penalty must be"):
        published_with(tmp_path, repetition_penalty=bad)


def test_the_flag_reaches_the_config_and_a_bad_mode_is_refused() -> None:
    args = build_parser().parse_args(["serve", "--model", "m", "--cloud", "ws://127.0.0.1:1"])
    assert args.generation_config == "auto"
    args = build_parser().parse_args(["serve", "--model", "m", "--cloud", "ws://x:1", "--generation-config", "vllm"])
    assert args.generation_config == "vllm"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--model", "m", "--cloud", "ws://x:1", "--generation-config", "greedy"])
    with pytest.raises(ConfigError, match="--generation-config"):
        ServeConfig(edge=None, served_model_name="m", generation_config="greedy")  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def top_k_one_model(chat_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The chat checkpoint publishing top_k 1 (sampling with it is the argmax, whatever the seed) and
    max_new_tokens 3."""
    directory = tmp_path_factory.mktemp("top-k-one")
    shutil.copytree(chat_model, directory, dirs_exist_ok=True)
    generation = {"bos_token_id": 0, "top_k": 1, "max_new_tokens": 3}
    (directory / "generation_config.json").write_text(json.dumps(generation))
    return directory


@pytest.mark.parametrize("mode", ["auto", "vllm"])
def test_a_request_without_sampling_fields_gets_the_checkpoints_defaults(top_k_one_model: Path, mode: str) -> None:
    """Through a real trunk: under ``auto`` a seeded request that sends no top_k samples with the file's top_k 1,
    so it equals the greedy reply; under ``vllm``, or when the request sends top_k 0, it samples at T = 1."""
    stack = Stack(top_k_one_model, generation_config=mode)
    try:
        client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0)
        greedy = chat(client, model=MODEL_NAME, messages=ASK, max_tokens=12, temperature=0, seed=5)
        unset = chat(client, model=MODEL_NAME, messages=ASK, max_tokens=12, seed=5)
        all_tokens = chat(client, model=MODEL_NAME, messages=ASK, max_tokens=12, seed=5, extra_body={"top_k": 0})
        greedy_text = complete(client, model=MODEL_NAME, prompt="the question", max_tokens=12, temperature=0)
        unset_text = complete(client, model=MODEL_NAME, prompt="the question", max_tokens=12, seed=5)
        no_limit = chat(client, model=MODEL_NAME, messages=ASK, temperature=0)
        no_limit_text = complete(client, model=MODEL_NAME, prompt="the question", temperature=0, max_tokens=None)
    finally:
        stack.close()
    assert (greedy.usage.completion_tokens, greedy.choices[0].finish_reason) == (12, "length")  # no end in 12
    assert (greedy_text.usage.completion_tokens, greedy_text.choices[0].finish_reason) == (12, "length")
    for a, b in [(greedy.choices[0].message.content, no_limit.choices[0].message.content),
                 (greedy_text.choices[0].text, no_limit_text.choices[0].text)]:  # fmt: skip
        assert a.startswith(b) or b.startswith(a)  # the same greedy reply, cut at its own length
    limits = (no_limit.usage.completion_tokens, no_limit_text.usage.completion_tokens)
    if mode == "auto":  # the file's max_new_tokens
        assert limits == (3, 3)
        assert no_limit.choices[0].finish_reason == no_limit_text.choices[0].finish_reason == "length"
    else:  # what the context has left
        assert min(limits) > 12
    assert all_tokens.choices[0].message.content != greedy.choices[0].message.content  # T = 1, every token
    if mode == "auto":
        assert unset.choices[0].message.content == greedy.choices[0].message.content
        assert unset_text.choices[0].text == greedy_text.choices[0].text
    else:
        assert unset.choices[0].message.content == all_tokens.choices[0].message.content  # the same seeded law
        assert unset_text.choices[0].text != greedy_text.choices[0].text
