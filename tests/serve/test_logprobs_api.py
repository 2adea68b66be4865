"""Logprobs through a real trunk with the official ``openai`` client: chat (whole and streamed) and
completions with ``echo``, against the whole model's log-softmax computed locally by transformers."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from transformers import AutoTokenizer

from tests.conftest import local_model
from tests.serve.conftest import MODEL_NAME, Stack
from tests.serve.helpers import chat, complete, tokenize
from tests.serve.test_tools_api import ADD
from tests.tool_model import TOOL_VOCAB

TOL = 1e-4
ASK = [{"role": "user", "content": "to be or not to be"}]


@pytest.fixture(scope="module")
def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0)


def local_logprobs(model_dir: Path, ids: Sequence[int]) -> torch.Tensor:
    """The whole model's log-softmax over ``ids`` (len, V), float32: row i scores token i + 1."""
    model = local_model(model_dir)
    with torch.no_grad():
        logits = model(torch.tensor([list(ids)])).logits[0].float()  # (len, V)
    return torch.log_softmax(logits, dim=-1)


def ids_of(model_dir: Path, texts: Sequence[str]) -> list[int]:
    """Token ids back from the tokens' texts (each text must name exactly one token)."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    by_text: dict[str, list[int]] = {}
    for i in range(len(tokenizer)):
        by_text.setdefault(str(tokenizer.decode([i], skip_special_tokens=False)), []).append(i)
    out = []
    for text in texts:
        assert len(by_text[text]) == 1, f"{text!r} names tokens {by_text[text]}"
        out.append(by_text[text][0])
    return out


def content_of(entries: Sequence[Any]) -> list[tuple[str, float, list[tuple[str, float]]]]:
    return [(e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs]) for e in entries]


def assert_close(a: Sequence[Any], b: Sequence[Any]) -> None:
    assert [(t, [x for x, _ in top]) for t, _, top in a] == [(t, [x for x, _ in top]) for t, _, top in b]
    for (_, lp_a, top_a), (_, lp_b, top_b) in zip(a, b, strict=True):
        assert abs(lp_a - lp_b) <= TOL
        assert all(abs(x - y) <= TOL for (_, x), (_, y) in zip(top_a, top_b, strict=True))


@pytest.mark.parametrize("mode", ["greedy", "sampled", "biased"])
def test_chat_logprobs_streamed_and_whole_equal_the_local_model(
    stack: Stack, client: openai.OpenAI, chat_model: Path, mode: str
) -> None:
    """``biased``: logit_bias picks every token, yet the logprobs are the model's own, before it."""
    kw: dict[str, Any] = dict(model=MODEL_NAME, messages=ASK, max_tokens=10, logprobs=True, top_logprobs=3)
    favoured = ids_of(chat_model, ["be"])[0]
    modes: dict[str, dict[str, Any]] = {
        "greedy": {"temperature": 0},
        "sampled": {"temperature": 1.0, "seed": 7},
        "biased": {"temperature": 0, "logit_bias": {str(favoured): 100}},
    }
    kw |= modes[mode]
    whole = chat(client, **kw)
    content = whole.choices[0].logprobs.content
    assert whole.usage is not None
    assert len(content) == whole.usage.completion_tokens  # every completion token has its entry
    streamed: list[Any] = []
    text = ""
    for chunk in chat(client, stream=True, **kw):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.content
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
    assert text == whole.choices[0].message.content
    assert_close(content_of(streamed), content_of(content))

    prompt = tokenize(stack, {"messages": ASK})  # the prompt ids the server builds
    generated = ids_of(chat_model, [e.token for e in content])
    assert [bytes(e.bytes).decode() for e in content] == [e.token for e in content]
    local = local_logprobs(chat_model, prompt + generated)[len(prompt) - 1 :]  # row k scores generated[k]
    expected = []
    for k, token in enumerate(generated):
        values, top_ids = local[k].topk(3)
        names = [e.token for e in content[k].top_logprobs]
        assert ids_of(chat_model, names) == top_ids.tolist()
        expected.append((content[k].token, float(local[k, token]), list(zip(names, values.tolist(), strict=True))))
    assert_close(content_of(content), expected)
    if mode == "greedy":  # each chosen token is the model's most likely one
        assert all(e.token == e.top_logprobs[0].token for e in content)
    if mode == "biased":  # the bias chose the tokens; the logprobs did not see it
        assert set(generated) == {favoured}
        assert any(e.token != e.top_logprobs[0].token for e in content)


def test_completion_echo_gives_every_prompt_tokens_logprob(
    stack: Stack, client: openai.OpenAI, chat_model: Path
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(chat_model, local_files_only=True)
    prompt = list(tokenizer.encode("to be or not to be that is the question"))
    warm = complete(client, model=MODEL_NAME, prompt=prompt, max_tokens=2, temperature=0)  # a session keeps it
    assert warm.usage is not None
    alone = complete(client, model=MODEL_NAME, prompt=prompt, max_tokens=0, echo=True, logprobs=2)
    lp = alone.choices[0].logprobs
    assert alone.usage is not None
    assert alone.usage.completion_tokens == 0
    assert alone.usage.prompt_tokens_details.cached_tokens == 0  # a fresh session: every row computed
    assert alone.choices[0].text == tokenizer.decode(prompt, skip_special_tokens=True)
    assert lp.token_logprobs[0] is None
    assert lp.top_logprobs[0] is None
    assert len(lp.token_logprobs) == len(prompt)
    local = local_logprobs(chat_model, prompt)
    for i in range(1, len(prompt)):
        assert abs(lp.token_logprobs[i] - float(local[i - 1, prompt[i]])) <= TOL
        values, top_ids = local[i - 1].topk(2)
        best = dict(zip([tokenizer.decode([t]) for t in top_ids.tolist()], values.tolist(), strict=True))
        best.setdefault(lp.tokens[i], float(local[i - 1, prompt[i]]))  # the chosen token is always there
        assert lp.top_logprobs[i].keys() == best.keys()
        assert all(abs(lp.top_logprobs[i][k] - v) <= TOL for k, v in best.items())
    assert lp.tokens == [tokenizer.decode([t]) for t in prompt]

    more = complete(client, model=MODEL_NAME, prompt=prompt, max_tokens=3, echo=True, logprobs=2, temperature=0)
    both = more.choices[0].logprobs
    assert both.token_logprobs[0] is None
    assert len(both.token_logprobs) == len(prompt) + 3
    again = zip(both.token_logprobs[1 : len(prompt)], lp.token_logprobs[1:], strict=True)
    assert all(abs(a - b) <= TOL for a, b in again)
    generated = ids_of(chat_model, both.tokens[len(prompt) :])
    local = local_logprobs(chat_model, prompt + generated)
    for k, token in enumerate(generated):
        assert abs(both.token_logprobs[len(prompt) + k] - float(local[len(prompt) - 1 + k, token])) <= TOL

    pieces = list(complete(client, model=MODEL_NAME, prompt=prompt, max_tokens=3, echo=True, logprobs=2,
                           temperature=0, stream=True))  # fmt: skip
    tokens: list[str] = []
    offsets: list[int] = []
    streamed: list[float | None] = []
    for piece in pieces:
        if piece.choices and piece.choices[0].logprobs is not None:
            tokens += piece.choices[0].logprobs.tokens
            offsets += piece.choices[0].logprobs.text_offset
            streamed += piece.choices[0].logprobs.token_logprobs
    assert tokens == both.tokens
    assert offsets == both.text_offset  # text_offset counts on across chunks
    assert streamed[0] is None
    assert all(abs(a - b) <= TOL for a, b in zip(streamed[1:], both.token_logprobs[1:], strict=True))


def test_logprobs_line_up_with_the_text_under_a_stop_string(tool_stack: Stack, tool_model: Path) -> None:
    """Byte-level tokens: the tokens' texts concatenate to the text; a stop string cuts the text, not them."""
    client = openai.OpenAI(base_url=tool_stack.base_url, api_key="unused", max_retries=0)
    tokenizer = AutoTokenizer.from_pretrained(tool_model, local_files_only=True)
    unseen = [*tokenizer.all_special_ids, *range(len(tokenizer), TOOL_VOCAB)]  # tokens without visible text
    kw: dict[str, Any] = dict(model=MODEL_NAME, prompt="to be or", max_tokens=12, temperature=0, logprobs=0,
                              logit_bias={str(t): -100 for t in unseen})  # fmt: skip
    plain = complete(client, **kw)
    text, tokens = plain.choices[0].text, plain.choices[0].logprobs.tokens
    assert "".join(tokens) == text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    cut = complete(client, stop=stop, **kw)
    lp = cut.choices[0].logprobs
    assert cut.usage is not None
    assert cut.choices[0].finish_reason == "stop"
    assert len(lp.tokens) == cut.usage.completion_tokens
    assert "".join(lp.tokens).startswith(cut.choices[0].text + stop)
    shown, covered = "", ""
    for piece in complete(client, stop=stop, stream=True, **kw):
        if not piece.choices:
            continue
        shown += piece.choices[0].text
        if piece.choices[0].logprobs is not None:
            covered += "".join(piece.choices[0].logprobs.tokens)
        assert covered.startswith(shown)  # every chunk's text comes with the tokens that made it
    assert shown == cut.choices[0].text
    assert covered == "".join(lp.tokens)


def test_min_tokens_holds_off_stop_strings(tool_stack: Stack, tool_model: Path) -> None:
    """vLLM's rule: a stop string ending in the first min_tokens tokens does not stop the reply."""
    client = openai.OpenAI(base_url=tool_stack.base_url, api_key="unused", max_retries=0)
    tokenizer = AutoTokenizer.from_pretrained(tool_model, local_files_only=True)
    unseen = [*tokenizer.all_special_ids, *range(len(tokenizer), TOOL_VOCAB)]
    kw: dict[str, Any] = dict(model=MODEL_NAME, prompt="to be or", max_tokens=12, temperature=0, logprobs=0,
                              logit_bias={str(t): -100 for t in unseen})  # fmt: skip
    plain = complete(client, **kw)
    text, first = plain.choices[0].text, plain.choices[0].logprobs.tokens[0]
    assert first
    assert text.startswith(first)
    now = complete(client, stop=first, **kw).choices[0]
    assert (now.text, now.finish_reason) == ("", "stop")  # the first token's text is a stop string
    again = text.find(first, 1)  # the next occurrence ending past the first token's text
    held = complete(client, stop=first, extra_body={"min_tokens": 1}, **kw).choices[0]
    assert held.text == (text[:again] if again > 0 else text)
    assert held.finish_reason == ("stop" if again > 0 else "length")
    streamed = "".join(c.choices[0].text for c in complete(client, stop=first, extra_body={"min_tokens": 1},
                                                             stream=True, **kw) if c.choices)  # fmt: skip
    assert streamed == held.text


def test_tool_call_logprobs_cover_every_token(tool_stack: Stack) -> None:
    """A forced call under its grammar: whole and streamed logprobs agree, one per completion token."""
    client = openai.OpenAI(base_url=tool_stack.base_url, api_key="unused", max_retries=0)
    kw: dict[str, Any] = dict(model=MODEL_NAME, messages=ASK, tools=[ADD], max_tokens=60, temperature=0,
                              tool_choice={"type": "function", "function": {"name": "add"}}, logprobs=True,
                              top_logprobs=1)  # fmt: skip
    whole = chat(client, **kw)
    assert whole.choices[0].finish_reason == "stop"  # a named function's call ends as OpenAI's: "stop"
    call = (whole.choices[0].message.tool_calls or [])[0]
    content = whole.choices[0].logprobs.content
    assert whole.usage is not None
    assert len(content) == whole.usage.completion_tokens
    generated = b"".join(bytes(e.bytes) for e in content).decode()  # byte-level: the reply's exact text
    assert set(json.loads(call.function.arguments)) == {"a"}
    assert call.function.arguments.replace(" ", "") in generated.replace(" ", "")
    streamed = [e for c in chat(client, stream=True, **kw) if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]  # fmt: skip
    assert_close(content_of(streamed), content_of(content))


def test_top_logprobs_needs_logprobs(stack: Stack) -> None:
    body = {"model": MODEL_NAME, "messages": ASK, "max_tokens": 2, "top_logprobs": 2}
    reply = httpx.post(f"{stack.base_url}/chat/completions", json=body)
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "top_logprobs"
    assert httpx.post(f"{stack.base_url}/chat/completions", json={**body, "logprobs": True}).status_code == 200


def test_a_speculative_step_streams_as_one_chunk(make_stack: Callable[..., Stack]) -> None:
    """With n-gram drafting on the random model's repetitive output, steps deliver several tokens, and each step goes
    out as one chunk (as vLLM streams a step): fewer chunks than one-token decoding sends for the same reply (whose
    chunks are a token each, save where the detokenizer holds one back), each chunk's logprobs its own tokens."""
    kw: dict[str, Any] = dict(model=MODEL_NAME, prompt="to be or not to be", max_tokens=40, temperature=0, logprobs=0)
    chunks: dict[str, list[list[str]]] = {}
    for mode in ("off", "ngram"):
        client = openai.OpenAI(base_url=make_stack(speculate=mode).base_url, api_key="unused", max_retries=0)
        whole = complete(client, **kw)
        chunks[mode] = []
        text = ""
        for chunk in complete(client, stream=True, **kw):
            if chunk.choices and chunk.choices[0].text:
                chunks[mode].append(chunk.choices[0].logprobs.tokens)
                text += chunk.choices[0].text
        assert text == whole.choices[0].text
        assert [t for tokens in chunks[mode] for t in tokens] == whole.choices[0].logprobs.tokens
    assert [t for c in chunks["off"] for t in c] == [t for c in chunks["ngram"] for t in c]  # the same reply
    assert len(chunks["ngram"]) < len(chunks["off"]) * 0.8
