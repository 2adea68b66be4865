"""The decode loop's prompt logprobs: every prompt token scored by the prefill row before it, the
same whatever the chunking, equal to transformers' whole model; decode's tokens are unchanged."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from splitspec.decoding.local import LocalSequence
from splitspec.decoding.loop import Emitted, PromptLogprobs, decode, prompt_token_logprobs
from splitspec.decoding.sampling import SamplingParams
from splitspec.models.checkpoint import Checkpoint
from splitspec.models.loading import load_full
from tests.conftest import local_model

PROMPT = [5, 9, 17, 3, 44, 2, 8, 5, 9, 17, 3, 61, 30, 12, 7, 5, 9, 40, 41, 42, 43]


async def tokens_of(seq: LocalSequence, prompt_logprobs: PromptLogprobs | None) -> list[Emitted]:
    out = decode(seq, PROMPT, 6, SamplingParams(), torch.Generator(), logprobs=1, prompt_logprobs=prompt_logprobs)
    return [e async for e in out]


async def test_prompt_logprobs_equal_the_whole_models(make_checkpoint: Callable[..., Path]) -> None:
    directory = make_checkpoint("llama")
    seq = LocalSequence(load_full(Checkpoint(directory), torch.float32))
    asked = PromptLogprobs(top=3)
    with_prompt = await tokens_of(seq, asked)
    assert with_prompt == await tokens_of(seq, None)  # asking for them changes nothing else
    assert [e.token for e in asked.entries] == PROMPT[1:]
    with torch.no_grad():
        logits = local_model(directory)(torch.tensor([PROMPT])).logits[0].float()  # (P, V)
    expected = torch.log_softmax(logits, dim=-1)[:-1]  # row i scores PROMPT[i + 1]
    got = torch.tensor([e.logprob for e in asked.entries])
    want = expected[torch.arange(len(PROMPT) - 1), torch.tensor(PROMPT[1:])]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    for e, row in zip(asked.entries, expected, strict=True):
        values, ids = row.topk(3)
        assert [t for t, _ in e.top] == ids.tolist()
        torch.testing.assert_close(torch.tensor([lp for _, lp in e.top]), values, atol=1e-4, rtol=0)


@pytest.mark.parametrize("rows", [1, 4, 7, 1000])
def test_chunked_rows_match_one_pass(rows: int) -> None:
    logits = torch.randn(len(PROMPT), 64, generator=torch.Generator().manual_seed(0))  # (P, V)
    whole = prompt_token_logprobs(logits, PROMPT, 2, rows_per_chunk=len(PROMPT))
    assert prompt_token_logprobs(logits, PROMPT, 2, rows_per_chunk=rows) == whole
    assert len(whole) == len(PROMPT) - 1
    assert prompt_token_logprobs(logits[:1], PROMPT[:1], 2) == []  # a one-token prompt: nothing scored


async def test_bad_prompt_logprobs_are_refused(make_checkpoint: Callable[..., Path]) -> None:
    seq = LocalSequence(load_full(Checkpoint(make_checkpoint("llama")), torch.float32))
    with pytest.raises(ValueError, match="prompt logprobs"):
        await tokens_of(seq, PromptLogprobs(top=21))
