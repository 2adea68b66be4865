"""Federated tests run torch on one thread: their tensors are tiny, and on the shared 2-core
machines intra-op thread wake-ups (not compute) dominated their run time."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
