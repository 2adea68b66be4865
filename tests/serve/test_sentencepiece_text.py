"""A SentencePiece-style (Metaspace) tokenizer through a real server: a completion's text keeps its first space.

Such a decoder drops the leading space of a string's first word, so a completion decoded on its own
("be be") reads wrong after its prompt ("to be orbe be"). The server decodes it after the prompt's
last ids (as vLLM does): the echoed prompt plus the completion is the whole decoding.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from tests.conftest import TOKENIZER_TEXT
from tests.serve.conftest import MODEL_NAME, Stack


@pytest.fixture(scope="module")
def metaspace_model(make_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("metaspace-llama")
    shutil.copytree(make_checkpoint("llama"), directory, dirs_exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=96, special_tokens=["<s>", "</s>", "<unk>"])
    tok.train_from_iterator([TOKENIZER_TEXT] * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def metaspace_stack(metaspace_model: Path) -> Iterator[Stack]:
    s = Stack(metaspace_model)
    yield s
    s.close()


def test_a_completion_keeps_its_first_space(metaspace_stack: Stack, metaspace_model: Path) -> None:
    tok: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(metaspace_model)
    prompt = "to be or"
    be = tok.convert_tokens_to_ids("▁be")
    assert isinstance(be, int)
    assert tok.decode([be]) == "be"  # alone, the space is dropped
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 4, "temperature": 0, "logit_bias": {str(be): 100}}
    url = f"{metaspace_stack.base_url}/completions"
    plain = httpx.post(url, json=body, timeout=60).json()["choices"][0]["text"]
    echoed = httpx.post(url, json={**body, "echo": True}, timeout=60).json()["choices"][0]["text"]
    whole = tok.decode(tok.encode(prompt) + [be] * 4, skip_special_tokens=True)
    assert plain == " be be be be"
    assert echoed == whole == prompt + plain
