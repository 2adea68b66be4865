"""The coordinator's verification emits tokens distributed as the reconstructed aggregate (chi-square)."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from splitspec.decoding.sampling import SamplingParams
from splitspec.federated.codec import decode_topk, encode_topk
from splitspec.federated.coordinator import aggregate_target, verify_against
from splitspec.federated.topk import RECONSTRUCTIONS, Reconstruction, TopKPolicy, select_topk

V = 6
GAMMA = 2


def _fixed_laws() -> tuple[list[torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    workers = [torch.softmax(torch.randn(GAMMA + 1, V, generator=g) * 1.5, -1) for _ in range(2)]
    draft = torch.softmax(torch.randn(GAMMA, V, generator=g), -1)
    return workers, draft


@pytest.mark.parametrize("method", RECONSTRUCTIONS)
def test_first_emitted_token_follows_the_aggregate(method: Reconstruction) -> None:
    workers, q = _fixed_laws()
    topks = []
    for law in workers:
        topks.append(decode_topk(encode_topk(law, select_topk(law, TopKPolicy(k=3))), GAMMA + 1, V))
    weights = [0.7, 0.3]
    p_hat = aggregate_target(topks, weights, method)
    exact = 0.7 * workers[0] + 0.3 * workers[1]
    assert not torch.allclose(p_hat, exact, atol=1e-3)  # compression does change the target ...
    params = SamplingParams(temperature=1.0)
    gen = torch.Generator().manual_seed(11)
    n = 6000
    counts = torch.zeros(V)
    for _ in range(n):
        draft = [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(GAMMA)]
        verdict = verify_against(draft, q, p_hat, params, gen)
        counts[verdict.tokens(draft)[0]] += 1
    expected = p_hat[0].double() / p_hat[0].double().sum() * n
    support = expected > 0
    assert int(counts[~support].sum()) == 0  # renorm: tokens outside every top-K never appear
    # ... and the emitted tokens follow the reconstructed aggregate, not the exact mixture
    assert chisquare(counts[support].numpy(), expected[support].numpy()).pvalue > 1e-3


def test_greedy_takes_the_argmax_of_the_aggregate() -> None:
    p_hat = torch.tensor([[0.1, 0.6, 0.3], [0.5, 0.2, 0.3], [0.2, 0.2, 0.6]])
    gen = torch.Generator()
    verdict = verify_against([1, 2], torch.zeros(2, 3), p_hat, SamplingParams(), gen)
    assert verdict.accepted == 1
    assert verdict.next_token == 0
    verdict = verify_against([1, 0], torch.zeros(2, 3), p_hat, SamplingParams(), gen)
    assert verdict.accepted == 2
    assert verdict.next_token == 2
