"""LocalSequence as workers use it: rollback then append matches a fresh full forward (HF's)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from splitspec.decoding.local import LocalSequence
from splitspec.models.checkpoint import Checkpoint
from splitspec.models.loading import load_full
from tests.conftest import local_model


@pytest.mark.parametrize("family", ["llama", "mistral"])  # mistral: sliding window 8, rolled back past it
def test_truncate_then_append_matches_full_forward(family: str, make_checkpoint: Callable[..., Path]) -> None:
    directory = make_checkpoint(family, layers=2)
    model = local_model(directory)
    torch.manual_seed(0)
    seq = torch.randint(0, 96, (30,)).tolist()
    with torch.no_grad():
        full = model(input_ids=torch.tensor([seq])).logits[0].float()
    lm = LocalSequence(load_full(Checkpoint(directory), torch.float32))
    lm.append(seq[:20], 1)
    lm.truncate(14)
    assert lm.tokens == seq[:14]
    assert torch.allclose(lm.append(seq[14:], 16), full[14:], atol=1e-4)
    other = [*seq[:12], 5, 6, 7]
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([other])).logits[0, -3:].float()
    assert torch.allclose(lm.logits_for(other, 3), ref, atol=1e-4)
    lm.truncate(0)
    assert lm.tokens == []
