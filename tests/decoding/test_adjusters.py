"""logit_bias, allowed_token_ids, min_tokens, OpenAI's penalties and the repetition penalty as logits processors,
row by row of a draft chain."""

from __future__ import annotations

import random
from collections import Counter

import torch
from transformers import RepetitionPenaltyLogitsProcessor

from splitspec.decoding.adjusters import (
    AllowedTokens,
    BadWords,
    LogitBias,
    MinTokens,
    Penalties,
    RepetitionPenalty,
)
from splitspec.decoding.processors import ProcessorChain

V = 8


def test_logit_bias_adds_to_every_row() -> None:
    out = LogitBias({1: 5.0, 3: -100.0}, V).process(torch.zeros(2, V), [], [4])
    expected = torch.zeros(2, V)
    expected[:, 1], expected[:, 3] = 5.0, -100.0
    assert torch.equal(out, expected)


def test_allowed_tokens_ban_every_other_token_in_every_row() -> None:
    p = AllowedTokens([2, 5], V)
    logits = torch.arange(3 * V, dtype=torch.float32).reshape(3, V)
    out = p.process(logits.clone(), [], [2, 5])
    assert torch.equal(out[:, [2, 5]], logits[:, [2, 5]])  # untouched
    assert torch.isinf(out[:, [0, 1, 3, 4, 6, 7]]).all()
    assert p.validate_draft([5, 2, 5]) == 3
    assert p.validate_draft([5, 7, 2]) == 1  # cut at the first token it bans
    assert p.validate_draft([]) == 0
    chain = ProcessorChain([AllowedTokens([1], V), LogitBias({1: 2.0, 3: 100.0}, V)])
    out = chain.process(torch.zeros(1, V), [], [])
    assert out[0, 1] == 2.0
    assert torch.isinf(out[0, 3])  # a bias cannot bring a banned token back
    assert not chain.finished


def test_min_tokens_forbids_stops_until_reached() -> None:
    p = MinTokens(2, {7})
    p.accept([1])  # one generated: the next row is the second token, still forbidden; the third is free
    out = p.process(torch.zeros(3, V), [], [2, 3])
    assert torch.isinf(out[0, 7])
    assert not torch.isinf(out[1, 7])
    assert not torch.isinf(out[2, 7])
    assert not torch.isinf(out[:, :7]).any()
    assert p.validate_draft([7, 1]) == 0
    assert p.validate_draft([1, 7]) == 2
    p.rollback(1)
    assert p.validate_draft([1, 7]) == 1


def test_penalties_follow_openais_formula() -> None:
    p = Penalties(presence=0.5, frequency=0.25)
    p.accept([2, 2, 5])
    out = p.process(torch.zeros(2, V), [], [5])
    # row 0: c[2] = 2, c[5] = 1; row 1 also sees the draft's 5: c[5] = 2
    assert out[0, 2] == -(2 * 0.25 + 0.5)
    assert out[0, 5] == -(0.25 + 0.5)
    assert out[0, 0] == 0
    assert out[1, 2] == -(2 * 0.25 + 0.5)
    assert out[1, 5] == -(2 * 0.25 + 0.5)
    p.rollback(1)
    assert p.process(torch.zeros(1, V), [], [])[0, 5] == 0


def test_a_chain_applies_all_and_cuts_at_the_strictest() -> None:
    chain = ProcessorChain([LogitBias({0: 1.0}, V), MinTokens(3, {6})])
    out = chain.process(torch.zeros(1, V), [], [])
    assert out[0, 0] == 1.0
    assert torch.isinf(out[0, 6])
    assert chain.validate_draft([1, 6]) == 1
    assert not chain.finished


def test_penalties_kept_as_counts_equal_the_formula_over_everything_generated() -> None:
    """Counts kept through accepts and rollbacks: each row's penalty is OpenAI's formula over the generated
    tokens and the draft before it."""
    rng = random.Random(0)
    p = Penalties(presence=0.7, frequency=0.3)
    generated: list[int] = []
    for _ in range(60):
        tokens = [rng.randrange(V) for _ in range(rng.randrange(0, 4))]
        p.accept(tokens)
        generated += tokens
        if generated and rng.random() < 0.3:
            n = rng.randrange(0, len(generated) + 1)
            p.rollback(n)
            del generated[len(generated) - n :]
        draft = [rng.randrange(V) for _ in range(rng.randrange(0, 4))]
        out = p.process(torch.zeros(len(draft) + 1, V), [], draft)
        for row in range(len(draft) + 1):
            c = Counter(generated + draft[:row])
            want = torch.tensor([-(c[t] * 0.3 + (0.7 if c[t] else 0.0)) for t in range(V)])
            torch.testing.assert_close(out[row], want)


def test_a_row_after_drafted_tokens_is_penalised_to_the_bit_as_one_token_decoding_penalises_it() -> None:
    """Row 1 after a drafted t holds what one-token decoding computes once t was accepted twice: the penalty in
    one float32 subtraction (two, the accepted counts' then the draft's, were an ulp off and flipped near-ties)."""
    rng = random.Random(3)
    for _ in range(300):
        presence, frequency = rng.uniform(-2.0, 2.0), rng.uniform(-2.0, 2.0)
        t = rng.randrange(V)
        logits = torch.empty(1, V).uniform_(-10.0, 10.0, generator=torch.Generator().manual_seed(rng.randrange(2**31)))
        drafted = Penalties(presence, frequency)
        drafted.accept([t])
        two_rows = drafted.process(logits.repeat(2, 1), [], [t])  # (2, V)
        one_token = Penalties(presence, frequency)
        one_token.accept([t, t])
        assert torch.equal(two_rows[1], one_token.process(logits.clone(), [], [])[0])


def test_the_repetition_penalty_is_transformers_row_by_row_over_the_prompt_and_the_draft() -> None:
    """Row i after the context and draft[:i] equals transformers' processor over that whole sequence, to the bit;
    a context that grows is read incrementally, and one that is not the last one extended is read afresh."""
    rng = random.Random(5)
    vocab = 40
    penalty = RepetitionPenalty(1.3)
    context: list[int] = []
    for step in range(60):
        if step == 30:
            context = [rng.randrange(vocab) for _ in range(5)]  # another sequence (shorter): read afresh
        elif step == 45:  # the same length, its last token (wherever it is) replaced by an unseen one
            fresh = min(set(range(vocab)) - set(context))
            context = [fresh if t == context[-1] else t for t in context]
        else:
            context += [rng.randrange(vocab) for _ in range(rng.randrange(3))]
        draft = [rng.randrange(vocab) for _ in range(rng.randrange(5))]
        logits = torch.randn(len(draft) + 1, vocab, generator=torch.Generator().manual_seed(step)) * 4
        out = penalty.process(logits.clone(), context, draft)
        reference = RepetitionPenaltyLogitsProcessor(1.3)
        for i in range(len(draft) + 1):
            ids = torch.tensor([[*context, *draft[:i]]], dtype=torch.long)  # (1, n)
            want = reference(ids, logits[i : i + 1].clone())[0] if ids.shape[1] else logits[i]
            assert torch.equal(out[i], want), (step, i)


def test_the_repetition_penalty_lowers_seen_tokens_and_keeps_the_others() -> None:
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0]])
    out = RepetitionPenalty(2.0).process(logits.clone(), [0, 1, 0], [])
    assert out.tolist() == [[1.0, -4.0, 2.0, -2.0]]


def test_bad_words_ban_a_words_last_token_after_the_rest_of_it_row_by_row() -> None:
    """Row i (after draft[:i]) bans what one-token decoding bans once draft[:i] was generated: a one-token word
    always, a longer word's last token where the generated tokens end with the rest; a draft stops before one."""
    words = [[3], [1, 2], [4, 1, 5]]
    rng = random.Random(7)
    for _ in range(200):
        generated = [rng.randrange(V) for _ in range(rng.randrange(4))]
        draft = [rng.randrange(V) for _ in range(rng.randrange(5))]
        drafted = BadWords(words)
        drafted.accept(generated)
        out = drafted.process(torch.zeros(len(draft) + 1, V), [], draft)
        for i in range(len(draft) + 1):
            history = generated + draft[:i]
            want = {3} | ({2} if history[-1:] == [1] else set()) | ({5} if history[-2:] == [4, 1] else set())
            assert {t for t in range(V) if out[i, t] == -float("inf")} == want, (history, i)
            one_token = BadWords(words)
            one_token.accept(history)
            assert torch.equal(one_token.process(torch.zeros(1, V), [], [])[0], out[i])
        cut = drafted.validate_draft(draft)
        assert all(out[i, draft[i]] > -float("inf") for i in range(cut))  # the draft up to the cut is allowed ...
        assert cut == len(draft) or out[cut, draft[cut]] == -float("inf")  # ... and cut at the first banned token
    words_left = BadWords(words)
    words_left.accept([4, 1])
    words_left.rollback(1)
    assert words_left.process(torch.zeros(1, V), [], [])[0, 5] == 0.0  # forgotten: [4] alone bans nothing
