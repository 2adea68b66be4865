"""IncrementalLM: cache rollback (transformers 5.x crop semantics) matches a fresh full forward."""

from __future__ import annotations

import pytest
import torch

from splitspec.federated.lm import IncrementalLM
from tests.conftest import _MODEL_CLASSES, tiny_config


@pytest.mark.parametrize("family", ["llama", "mistral"])  # mistral: sliding window 8, cannot crop past it
def test_truncate_then_append_matches_full_forward(family: str) -> None:
    torch.manual_seed(0)
    model = _MODEL_CLASSES[family](tiny_config(family, 2)).eval()
    seq = torch.randint(0, 96, (30,)).tolist()
    with torch.no_grad():
        full = model(input_ids=torch.tensor([seq])).logits[0].float()
    lm = IncrementalLM(model)
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
