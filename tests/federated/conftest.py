"""Federated tests run torch on one thread: their tensors are tiny, and on the shared 2-core
machines intra-op thread wake-ups (not compute) dominated their run time. ``models``: the tiny
workers and drafters most federated tests share (a module may define its own)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from splitspec.federated.lm import LoadedModel, load_model


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def models(make_checkpoint: Callable[..., Path]) -> dict[str, LoadedModel]:
    """Two different worker models and a drafter sharing the 96-token tokenizer, plus a 128-vocab odd one."""
    return {
        "a": load_model(make_checkpoint("llama", layers=2, logit_scale=6.0)),
        "b": load_model(make_checkpoint("llama", layers=3, logit_scale=6.0)),
        "draft": load_model(make_checkpoint("llama", layers=1, logit_scale=6.0)),
        "draft_like_a": load_model(make_checkpoint("llama", layers=2, logit_scale=6.0)),  # accepts some drafts
        "odd": load_model(make_checkpoint("llama", layers=1, vocab=128)),
        "other_tokenizer": load_model(make_checkpoint("qwen2", layers=1)),  # Qwen2Tokenizer adds a pad token
    }
