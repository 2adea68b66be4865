"""What popular clients send (LiteLLM, guidellm, lm-evaluation-harness, the openai SDK), through a
real trunk server: n choices, seeds, usage options, logit_bias, min_tokens, ignore_eos, penalties,
batched and token-id prompts, echo, and vLLM's tokenizer endpoints."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from splitspec.detokenize import CONTEXT_TOKENS, text_after
from tests.conftest import local_model
from tests.serve.conftest import MODEL_NAME, Stack
from tests.serve.helpers import chat, complete

ASK = [{"role": "user", "content": "to be or not"}]


@pytest.fixture(scope="module")
def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0)


def root(stack: Stack) -> str:
    return stack.base_url.removesuffix("/v1")


def token_ids(stack: Stack, text: str) -> list[int]:
    body = httpx.post(f"{root(stack)}/tokenize", json={"prompt": text}, timeout=30).json()
    return list(body["tokens"])


def end_id(stack: Stack) -> int:
    (end,) = stack.state.chat_stop_ids - stack.state.eos_token_ids
    return int(end)


def test_n_choices_are_indexed_and_usage_is_summed(client: openai.OpenAI) -> None:
    one = chat(client, model=MODEL_NAME, messages=ASK, max_tokens=6, temperature=0)
    three = chat(client, model=MODEL_NAME, messages=ASK, max_tokens=6, temperature=0, n=3)
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert {c.message.content for c in three.choices} == {one.choices[0].message.content}  # greedy: all alike
    assert one.usage is not None
    assert three.usage is not None
    assert three.usage.prompt_tokens == one.usage.prompt_tokens
    assert three.usage.completion_tokens == 3 * one.usage.completion_tokens
    sampled = complete(client, model=MODEL_NAME, prompt="the question", max_tokens=10, temperature=1.0,
                                        n=4, seed=11)  # fmt: skip
    texts = [c.text for c in sampled.choices]
    assert len(set(texts)) > 1  # independent draws
    singles = [complete(client, model=MODEL_NAME, prompt="the question", max_tokens=10, temperature=1.0,
                                         seed=11 + i).choices[0].text for i in (0, 3)]  # fmt: skip
    assert singles == [texts[0], texts[3]]  # choice i is seeded with seed + i


def test_usage_options(client: openai.OpenAI, stack: Stack) -> None:
    plain = chat(
        client,
        model=MODEL_NAME,
        messages=ASK,
        max_tokens=5,
        temperature=0,
        stream_options={"include_usage": True},
    )  # LiteLLM sends it unstreamed
    assert plain.usage is not None
    body = {
        "model": MODEL_NAME,
        "messages": ASK,
        "max_tokens": 5,
        "temperature": 0,
        "stream": True,
        "n": 2,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }  # guidellm's
    with httpx.stream("POST", f"{stack.base_url}/chat/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        payloads = [json.loads(e.removeprefix("data: ")) for e in response.read().decode().split("\n\n")
                    if e and e != "data: [DONE]"]  # fmt: skip
    assert all(p["usage"] is not None for p in payloads)  # on every chunk
    running = [p["usage"]["completion_tokens"] for p in payloads]
    assert running == sorted(running)
    assert payloads[-1]["choices"] == []
    assert payloads[-1]["usage"]["completion_tokens"] == 2 * plain.usage.completion_tokens
    assert {c["index"] for p in payloads for c in p["choices"]} == {0, 1}


def test_fields_clients_send_are_accepted(client: openai.OpenAI, stack: Stack) -> None:
    base = {"model": MODEL_NAME, "max_tokens": 6, "temperature": 0}
    system = chat(client, messages=[{"role": "system", "content": "to be"}, *ASK], **base)
    sent = {**base, "messages": [{"role": "developer", "content": [{"type": "text", "text": "to "},
            {"type": "text", "text": "be"}]}, *ASK], "stop": None, "user": "u-1", "max_completion_tokens": 6,
            "max_tokens": None, "presence_penalty": 0, "frequency_penalty": None, "logit_bias": {}}  # fmt: skip
    response = httpx.post(f"{stack.base_url}/chat/completions", json=sent, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == system.choices[0].message.content


def test_logit_bias_min_tokens_and_ignore_eos(client: openai.OpenAI, stack: Stack) -> None:
    end = {str(end_id(stack)): 100}  # the end-of-turn token almost surely next

    def reply(**kw: Any) -> tuple[int, str]:
        r = chat(
            client,
            model=MODEL_NAME,
            messages=ASK,
            max_tokens=9,
            temperature=0,
            logit_bias=end,
            **kw,
        )
        assert r.usage is not None
        return r.usage.completion_tokens, str(r.choices[0].finish_reason)

    assert reply() == (1, "stop")
    assert reply(extra_body={"min_tokens": 4}) == (5, "stop")  # the stop token only after 4 others
    assert reply(extra_body={"ignore_eos": True}) == (9, "length")


def test_penalties_are_openais(client: openai.OpenAI, stack: Stack, chat_model: Path) -> None:
    prompt = token_ids(stack, "to be or not to be")
    presence, frequency = 0.7, 1.3
    reply = complete(client, model=MODEL_NAME, prompt=prompt, max_tokens=12, temperature=0,
                                      presence_penalty=presence, frequency_penalty=frequency)  # fmt: skip
    plain = complete(client, model=MODEL_NAME, prompt=prompt, max_tokens=12, temperature=0)
    model, out = local_model(chat_model), list[int]()  # the whole model, the penalty written out here
    with torch.no_grad():
        for _ in range(12):
            logits = model(torch.tensor([prompt + out])).logits[0, -1].float()
            for t in set(out):
                logits[t] -= out.count(t) * frequency + presence
            out.append(int(logits.argmax()))
            if out[-1] in stack.state.eos_token_ids:
                break
    assert reply.choices[0].text == text_after(stack.state.decode, prompt[-CONTEXT_TOKENS:], out)  # its continuation
    assert reply.choices[0].text != plain.choices[0].text


def test_batched_and_token_id_prompts(client: openai.OpenAI, stack: Stack) -> None:
    texts = ["to be or", "def main():", "whether tis"]
    batch = complete(client, model=MODEL_NAME, prompt=texts, max_tokens=5, temperature=0, n=2)
    singles = [complete(client, model=MODEL_NAME, prompt=t, max_tokens=5, temperature=0) for t in texts]
    assert [c.index for c in batch.choices] == list(range(6))
    assert [c.text for c in batch.choices] == [s.choices[0].text for s in singles for _ in range(2)]
    assert batch.usage is not None
    assert batch.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    ids = [token_ids(stack, t) for t in texts[:2]]
    by_ids = complete(client, model=MODEL_NAME, prompt=ids, max_tokens=5, temperature=0)
    assert [c.text for c in by_ids.choices] == [s.choices[0].text for s in singles[:2]]
    unknown_bos = [5, *ids[0]]  # sent as is: no BOS added in front of token ids
    one = complete(client, model=MODEL_NAME, prompt=unknown_bos, max_tokens=1, temperature=0)
    assert one.usage is not None
    assert one.usage.prompt_tokens == len(unknown_bos)


def test_echo(client: openai.OpenAI) -> None:
    reply = complete(client, model=MODEL_NAME, prompt="to be or", max_tokens=4, temperature=0, echo=True)
    plain = complete(client, model=MODEL_NAME, prompt="to be or", max_tokens=4, temperature=0)
    assert reply.choices[0].text == "to be or" + plain.choices[0].text
    alone = complete(client, model=MODEL_NAME, prompt="to be or", max_tokens=0, echo=True)
    assert alone.choices[0].text == "to be or"
    assert alone.usage is not None
    assert alone.usage.completion_tokens == 0


def test_tokenizer_endpoints(stack: Stack) -> None:
    tokens = httpx.post(f"{root(stack)}/tokenize", json={"prompt": "to be or not", "return_token_strs": True}).json()
    assert tokens["count"] == len(tokens["tokens"]) == len(tokens["token_strs"])
    assert tokens["max_model_len"] == stack.state.max_positions
    back = httpx.post(f"{root(stack)}/detokenize", json={"tokens": tokens["tokens"]}).json()
    assert back == {"prompt": stack.state.tokenizer.decode(tokens["tokens"])}
    chat = httpx.post(f"{root(stack)}/tokenize", json={"messages": ASK, "model": MODEL_NAME}).json()
    reply = httpx.post(f"{stack.base_url}/chat/completions", json={"model": MODEL_NAME, "messages": ASK,
                                                                     "max_tokens": 1}).json()  # fmt: skip
    assert chat["count"] == reply["usage"]["prompt_tokens"]
    info = httpx.get(f"{root(stack)}/tokenizer_info").json()
    assert info["tokenizer_class"] == type(stack.state.tokenizer).__name__
    assert info["eos_token"] == "</s>"
    assert "<|assistant|>" in info["chat_template"]
    bad = httpx.post(f"{root(stack)}/detokenize", json={"tokens": [10**6]})
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "tokens"


def test_lm_evals_long_stop_lists_and_a_request_without_a_model(stack: Stack) -> None:
    """lm-eval's local-completions sends a task's whole stop list (humaneval: 5 and the EOS string; OpenAI's limit
    is 4), and vLLM serves a request that names no model."""
    stops = ["\nclass", "\ndef", "\n#", "\nif", "\nprint", "</s>"]
    body = {"model": MODEL_NAME, "prompt": "def main():", "max_tokens": 5, "temperature": 0, "stop": stops}
    reply = httpx.post(f"{stack.base_url}/completions", json=body, timeout=60)
    assert reply.status_code == 200
    assert not any(s in reply.json()["choices"][0]["text"] for s in stops)
    unnamed = httpx.post(f"{stack.base_url}/completions", json={k: v for k, v in body.items() if k != "model"},
                         timeout=60)  # fmt: skip
    assert unnamed.status_code == 200
    assert unnamed.json()["model"] == MODEL_NAME
    assert unnamed.json()["choices"][0]["text"] == reply.json()["choices"][0]["text"]
