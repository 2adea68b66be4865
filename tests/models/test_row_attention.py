"""Row attention's pieces: grouped-query sdpa without repeat_kv's copy, and the registered implementation."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn
from transformers import LlamaConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from splitspec.models.row_attention import (
    ROWS_KWARG,
    attention_configs,
    grouped_sdpa,
    keep_sdpa_off_cudnn,
    use_row_attention,
)


class _Attention(nn.Module):
    is_causal = True
    layer_idx = 0

    def __init__(self, groups: int = 2) -> None:
        super().__init__()
        self.num_key_value_groups = groups  # query heads per key/value head


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize(
    ("q", "keys", "masked"), [(2, 9, True), (5, 40, True), (1, 9, False), (1, 9, True), (3, 9, False)]
)
def test_grouped_sdpa_equals_transformers_sdpa(q: int, keys: int, masked: bool, groups: int) -> None:
    """Several query tokens (grouped by torch), one (packed), and an unmasked causal step (transformers')."""
    torch.manual_seed(0)
    kv = 4 // groups
    query, key, value = torch.randn(2, 4, q, 8), torch.randn(2, kv, keys, 8), torch.randn(2, kv, keys, 8)
    mask = None
    if masked:  # a tree: every query sees the prefix, and only some of the step's keys
        mask = torch.zeros(2, 1, q, keys)
        mask[..., keys - q :] = torch.where(torch.rand(q, q) < 0.5, torch.finfo(torch.float32).min, 0.0)
        mask[..., keys - q :].diagonal(dim1=-2, dim2=-1).zero_()
    want, _ = sdpa_attention_forward(_Attention(groups), query, key, value, mask, scaling=0.3)
    got, weights = grouped_sdpa(_Attention(groups), query, key, value, mask, scaling=0.3, dropout=0.0)
    assert weights is None
    assert got.shape == (2, q, 4, 8)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_soft_capping_is_still_refused_as_transformers_does() -> None:
    query, key = torch.randn(1, 4, 2, 8), torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="softcap"):
        grouped_sdpa(_Attention(), query, key, key, torch.zeros(1, 1, 2, 4), softcap=30.0)


@pytest.fixture
def cudnn_sdp_restored() -> Iterator[None]:
    """torch's cuDNN-sdpa flag is process-wide: put it back as it was."""
    before = torch.backends.cuda.cudnn_sdp_enabled()
    yield
    torch.backends.cuda.enable_cudnn_sdp(before)


@pytest.mark.usefixtures("cudnn_sdp_restored")
def test_a_cuda_device_takes_cudnn_out_of_sdpa_and_a_cpu_does_not(caplog: pytest.LogCaptureFixture) -> None:
    """torch's flag is settable without CUDA: a CPU stack leaves it, a CUDA one (even beside a CPU) clears it."""
    torch.backends.cuda.enable_cudnn_sdp(True)
    assert keep_sdpa_off_cudnn([torch.device("cpu")]) is False
    assert torch.backends.cuda.cudnn_sdp_enabled()
    with caplog.at_level("INFO", logger="splitspec.models.row_attention"):
        assert keep_sdpa_off_cudnn([torch.device("cpu"), torch.device("cuda", 1)]) is True
    assert not torch.backends.cuda.cudnn_sdp_enabled()
    assert "cuDNN attention off" in caplog.text
    assert keep_sdpa_off_cudnn([torch.device("cuda", 0)]) is False  # already off: nothing to do, no second line
    assert caplog.text.count("cuDNN attention off") == 1


def test_use_row_attention_wraps_the_configs_implementation_once() -> None:
    config = LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1)
    config._attn_implementation = "eager"
    layer = nn.Module()
    layer.config = config  # type: ignore[assignment]  # what a decoder layer's attention reads
    configs = attention_configs([layer])
    assert configs == [config]
    use_row_attention(configs)
    use_row_attention(configs)
    assert config._attn_implementation == "splitspec_rows:eager"
    assert ROWS_KWARG == "splitspec_rows"
