"""vLLM's ``prompt_logprobs`` through a real trunk: each prompt token's logprob, rank and alternatives, against the
whole model's log-softmax computed locally by transformers; on completions per choice, on chat once per response."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import torch

from tests.serve.conftest import MODEL_NAME, Stack
from tests.serve.helpers import tokenize
from tests.serve.test_logprobs_api import TOL, local_logprobs

PROMPT = [5, 17, 42, 17, 8, 90, 3]  # token ids: sent as they are
ASK = [{"role": "user", "content": "to be or not to be"}]


def post(stack: Stack, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{stack.base_url}{path}", json={"model": MODEL_NAME, **body}, timeout=60)


def check_against_local(shown: list[Any], ids: list[int], local: torch.Tensor, top: int) -> None:
    """``shown`` is vLLM's list for ``ids``: None, then per token its own entry and the ``top`` likeliest."""
    assert len(shown) == len(ids)
    assert shown[0] is None
    for i, (token, row) in enumerate(zip(ids[1:], shown[1:], strict=True)):
        scores = local[i]  # (V,): scores token i + 1
        own = row[str(token)]
        assert abs(own["logprob"] - float(scores[token])) <= TOL
        # its rank: 1 + the tokens likelier there (a band of TOL around near ties)
        likelier = (scores > scores[token] + TOL).sum(), (scores > scores[token] - TOL).sum()
        assert int(likelier[0]) + 1 <= own["rank"] <= int(likelier[1]) + 1
        best = scores.topk(top)
        ranked = {int(t): r for r, t in enumerate(best.indices.tolist(), start=1)}
        assert set(row) == {str(token)} | {str(t) for t in ranked}
        for t, r in ranked.items():
            if t != token:
                assert row[str(t)]["rank"] == r
                assert abs(row[str(t)]["logprob"] - float(scores[t])) <= TOL
        assert all(isinstance(entry["decoded_token"], str) for entry in row.values())


def test_completions_carry_each_prompt_tokens_logprob_and_rank(stack: Stack, chat_model: Path) -> None:
    body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "prompt_logprobs": 2, "n": 2}
    reply = post(stack, "/completions", body)
    assert reply.status_code == 200, reply.text
    local = local_logprobs(chat_model, PROMPT)
    for choice in reply.json()["choices"]:
        check_against_local(choice["prompt_logprobs"], PROMPT, local, 2)
        assert choice["logprobs"] is None  # not asked for the generated tokens
    plain = post(stack, "/completions", {**body, "prompt_logprobs": None}).json()
    assert "prompt_logprobs" not in plain["choices"][0]
    assert [c["text"] for c in plain["choices"]] == [c["text"] for c in reply.json()["choices"]]
    # with echo and logprobs 1: the echoed prompt's logprobs keep 1 alternative, prompt_logprobs its 3
    both = post(stack, "/completions", {**body, "n": 1, "echo": True, "logprobs": 1, "prompt_logprobs": 3}).json()
    choice = both["choices"][0]
    check_against_local(choice["prompt_logprobs"], PROMPT, local, 3)
    echo_alone = post(stack, "/completions", {**body, "n": 1, "echo": True, "logprobs": 1, "prompt_logprobs": None})
    assert choice["logprobs"] == echo_alone.json()["choices"][0]["logprobs"]  # as if prompt_logprobs were not sent


def test_chat_carries_the_conversations_prompt_logprobs_once(stack: Stack, chat_model: Path) -> None:
    body = {"messages": ASK, "max_tokens": 3, "temperature": 0, "prompt_logprobs": 0, "logprobs": True}
    reply = post(stack, "/chat/completions", body)
    assert reply.status_code == 200, reply.text
    generated = reply.json()["choices"][0]["logprobs"]["content"]  # the reply's tokens alone
    assert len(generated) == reply.json()["usage"]["completion_tokens"]
    ids = tokenize(stack, {"messages": ASK})
    check_against_local(reply.json()["prompt_logprobs"], ids, local_logprobs(chat_model, ids), 0)
    assert "prompt_logprobs" not in post(stack, "/chat/completions", {**body, "prompt_logprobs": None}).json()


def test_prompt_logprobs_are_refused_with_stream_and_past_20(stack: Stack) -> None:
    for path, body in [("/completions", {"prompt": "to be", "stream": True, "prompt_logprobs": 1}),
                       ("/chat/completions", {"messages": ASK, "stream": True, "prompt_logprobs": 0}),
                       ("/completions", {"prompt": "to be", "prompt_logprobs": 21})]:  # fmt: skip
        reply = post(stack, path, body)
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["param"] == "prompt_logprobs"
