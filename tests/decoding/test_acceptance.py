"""Acceptance rules: greedy is exact; speculative sampling emits tokens distributed as p."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from scipy.stats import chisquare

from splitspec.decoding.acceptance import greedy_verify, one_hot_draft, residual, speculative_verify


def logits_for(choices: list[int], vocab: int = 6) -> torch.Tensor:
    out = torch.zeros(len(choices), vocab)
    out[torch.arange(len(choices)), torch.tensor(choices)] = 5.0
    return out


@pytest.mark.parametrize(
    ("draft", "choices", "accepted", "emitted"),
    [
        ([1, 2, 3], [1, 2, 3, 4], 3, [1, 2, 3, 4]),  # all accepted + bonus
        ([1, 2, 3], [1, 5, 3, 4], 1, [1, 5]),  # first mismatch replaced by the argmax
        ([1, 2, 3], [0, 2, 3, 4], 0, [0]),
        ([], [4], 0, [4]),
    ],
)
def test_greedy_verify(draft: list[int], choices: list[int], accepted: int, emitted: list[int]) -> None:
    verdict = greedy_verify(draft, logits_for(choices))
    assert verdict.accepted == accepted
    assert verdict.tokens(draft) == emitted


def test_residual() -> None:
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.6, 0.1, 0.3])
    torch.testing.assert_close(residual(p, q), torch.tensor([0.0, 1.0, 0.0]))
    torch.testing.assert_close(residual(p, p), p)


@pytest.mark.parametrize("deterministic", [False, True])
def test_speculative_sampling_first_token_follows_p(deterministic: bool) -> None:
    """Whatever q is, the first emitted token is distributed exactly as p (chi-square, 5 tokens)."""
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.05, 0.4, 0.25, 0.2, 0.1], [0.2, 0.2, 0.2, 0.2, 0.2]])
    q_model = torch.tensor([[0.5, 0.1, 0.1, 0.1, 0.2]])
    n = 6000
    counts: Counter[int] = Counter()
    accepted = 0
    for _ in range(n):
        if deterministic:
            draft = [0]  # an n-gram drafter always proposing token 0
            q = one_hot_draft(draft, 5)
        else:
            draft = [int(torch.multinomial(q_model[0], 1, generator=gen))]
            q = q_model
        verdict = speculative_verify(draft, q, p, gen)
        counts[verdict.tokens(draft)[0]] += 1
        accepted += verdict.accepted
    observed = [counts[t] for t in range(5)]
    assert chisquare(observed, (p[0] * n).tolist()).pvalue > 1e-3
    # acceptance rate matches sum_x min(p, q)
    expected_rate = float(torch.minimum(p[0], q[0]).sum())
    assert abs(accepted / n - expected_rate) < 0.03


def test_tree_recursive_rejection_follows_p() -> None:
    """Two deterministic branches at the root (tokens 1 and 2): the emitted first token is ~ p."""
    from splitspec.decoding.acceptance import sample_verify_tree

    gen = torch.Generator().manual_seed(1)
    p = torch.tensor([[0.1, 0.3, 0.2, 0.4], [0.25] * 4, [0.25] * 4])
    tokens, parents = [1, 2], [-1, -1]
    n = 6000
    counts: Counter[int] = Counter()
    for _ in range(n):
        verdict = sample_verify_tree(tokens, parents, None, p, gen)
        first = tokens[verdict.path[0]] if verdict.path else verdict.next_token
        counts[first] += 1
    law = p[0].double() / p[0].double().sum()
    assert chisquare([counts[t] for t in range(4)], (law * n).tolist()).pvalue > 1e-3


def test_greedy_tree_walks_the_matching_branch() -> None:
    from splitspec.decoding.acceptance import greedy_verify_tree

    # tree: 0:a(3) <- root, 1:b(4) <- 0, 2:c(5) <- root, 3:d(1) <- 2
    tokens, parents = [3, 4, 5, 1], [-1, 0, -1, 2]
    logits = logits_for([5, 0, 0, 1, 2])  # root picks 5 (node 2), node 2's row (3) picks 1 (node 3), then 2
    verdict = greedy_verify_tree(tokens, parents, logits)
    assert verdict.path == [2, 3]
    assert verdict.next_token == 2


def reference_chain_verify(draft: list[int], q: torch.Tensor, p: torch.Tensor, gen: torch.Generator) -> tuple[int, int]:
    """Leviathan et al.'s rule written out for a chain: (accepted, next token)."""
    for i, x in enumerate(draft):
        if torch.rand((), generator=gen).item() < min(1.0, float(p[i, x]) / float(q[i, x])):
            continue
        return i, int(torch.multinomial(residual(p[i], q[i]), 1, generator=gen))
    return len(draft), int(torch.multinomial(p[len(draft)], 1, generator=gen))


def test_chain_verification_is_plain_speculative_sampling() -> None:
    """One child per node: the tree rule makes the very draws of the single-draft rule, seed for seed."""
    torch.manual_seed(0)
    for seed in range(200):
        q = torch.rand(3, 6).softmax(-1)
        p = (2 * torch.rand(4, 6)).softmax(-1)
        draft = [int(torch.multinomial(q[i], 1)) for i in range(3)]
        verdict = speculative_verify(draft, q, p, torch.Generator().manual_seed(seed))
        assert (verdict.accepted, verdict.next_token) == reference_chain_verify(
            draft, q, p, torch.Generator().manual_seed(seed)
        )


def test_siblings_must_share_their_q() -> None:
    from splitspec.decoding.acceptance import sample_verify_tree

    q = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.8, 0.0]])
    p = torch.tensor([[0.0, 0.0, 1.0]] * 3)  # rejects every draft token: the second sibling is read
    with pytest.raises(ValueError, match="siblings"):
        sample_verify_tree([0, 1], [-1, -1], q, p, torch.Generator().manual_seed(0))
