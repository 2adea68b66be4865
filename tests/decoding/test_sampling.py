"""Our temperature/top-k/top-p/min-p transform equals transformers' warpers; parameters are validated."""

from __future__ import annotations

import pytest
import torch
from transformers import MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from splitspec.decoding.sampling import SamplingParams, choose_token, greedy_tokens, probabilities
from splitspec.exceptions import ConfigError


@pytest.mark.parametrize(
    ("temperature", "top_p", "top_k", "min_p"),
    [(1.0, 1.0, 0, 0.0), (0.7, 0.9, 0, 0.0), (1.5, 0.5, 0, 0.0), (0.3, 0.05, 0, 0.0), (1.0, 1.0, 5, 0.0),
     (0.7, 0.95, 12, 0.0), (1.2, 0.3, 40, 0.0), (1.0, 1.0, 0, 0.1), (0.7, 0.9, 12, 0.05), (1.5, 1.0, 0, 1.0)],
)  # fmt: skip
def test_probabilities_match_transformers(temperature: float, top_p: float, top_k: int, min_p: float) -> None:
    """The order of transformers' generate: temperature, then top-k, then top-p, then min-p."""
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0)) * 3
    scores = TemperatureLogitsWarper(temperature)(None, logits)
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    if min_p:
        scores = MinPLogitsWarper(min_p)(None, scores)  # type: ignore[arg-type]  # warpers do not read input_ids
    expected = scores.softmax(-1)
    torch.testing.assert_close(probabilities(logits, temperature, top_p, top_k, min_p), expected)
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p)
    torch.testing.assert_close(params.probabilities(logits), expected)
    if top_k:
        assert int((expected[0] > 0).sum()) <= top_k
    if min_p == 1.0:  # only the likeliest token is left: sampling is greedy
        assert torch.equal(expected.argmax(-1), logits.argmax(-1))
        assert (expected.max(-1).values == 1).all()


def test_greedy_tokens_are_argmax_with_its_ties_and_nans() -> None:
    generator = torch.Generator().manual_seed(0)
    tied = torch.randint(-2, 3, (9, 8192), generator=generator).float()  # many tied maxima per row
    assert torch.equal(greedy_tokens(tied), tied.argmax(dim=-1))
    assert greedy_tokens(torch.tensor([1.0, 3.0, 0.0, 3.0])).item() == 1  # the first of tied maxima
    with_nan = torch.tensor([[1.0, float("nan"), 5.0], [2.0, 7.0, 7.0]])
    assert greedy_tokens(with_nan).tolist() == with_nan.argmax(dim=-1).tolist() == [1, 1]
    strided = torch.randn(20, 300, generator=generator)[::2, ::3]  # a non-contiguous view
    assert torch.equal(greedy_tokens(strided), strided.argmax(dim=-1))


def test_greedy_and_seeded_choice() -> None:
    logits = torch.tensor([0.1, 3.0, 0.2])
    assert choose_token(logits, SamplingParams(), torch.Generator()) == 1
    params = SamplingParams(temperature=1.0, seed=3)
    draws = [choose_token(torch.zeros(1000), params, params.generator()[0]) for _ in range(2)]
    assert draws[0] == draws[1]


@pytest.mark.parametrize(
    ("temperature", "top_p", "top_k", "min_p"),
    [(-0.1, 1.0, 0, 0.0), (1.0, 0.0, 0, 0.0), (1.0, 1.5, 0, 0.0), (float("nan"), 1.0, 0, 0.0), (1.0, 1.0, -1, 0.0),
     (1.0, 1.0, 0, -0.1), (1.0, 1.0, 0, 1.5), (1.0, 1.0, 0, float("nan"))],
)  # fmt: skip
def test_bad_parameters(temperature: float, top_p: float, top_k: int, min_p: float) -> None:
    with pytest.raises(ConfigError):
        SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p)


def test_a_tiny_temperature_decodes_greedily() -> None:
    """1e-38 is greedy (below GREEDY_BELOW, as in vLLM): logits / T overflowed to inf and the softmax to NaN,
    and choose_token raised."""
    logits = torch.tensor([30.0, 2.0, -1.0])
    params = SamplingParams(temperature=1e-38)
    assert params.greedy
    assert choose_token(logits, params, torch.Generator().manual_seed(0)) == 0
    probs = params.probabilities(logits)
    assert torch.isfinite(probs).all()
    assert probs.tolist() == [1.0, 0.0, 0.0]
    assert not SamplingParams(temperature=1e-4).greedy
