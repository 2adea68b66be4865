"""Pieces of the server on their own: stop-string streaming, the prefix LRU, chat templates."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from splitspec.exceptions import ConfigError
from splitspec.serve.prefix_cache import PrefixCache, common_prefix
from splitspec.serve.templates import render_chat
from splitspec.serve.text import StopTextStream
from tests.serve.conftest import CHAT_TEMPLATE


def decode_letters(ids: list[int]) -> str:
    return "".join(chr(ord("a") + i) if i >= 0 else "\ufffd" for i in ids)


def run(stream: StopTextStream, ids: list[int]) -> list[str]:
    out = []
    for i in ids:
        out.append(stream.push(i))
        if stream.stopped:
            return out
    return [*out, stream.flush()]


def test_stop_string_across_tokens_is_cut_and_excluded() -> None:
    stream = StopTextStream(decode_letters, ["cde", "zz"])
    deltas = run(stream, [0, 1, 2, 3, 4, 5])  # a b c d e f
    assert "".join(deltas) == "ab"
    assert stream.stopped
    assert deltas[:2] == ["", ""]  # "a", "ab" could still begin "cde"/"zz": held back (hold = 2 chars)


def test_without_a_stop_everything_is_released() -> None:
    stream = StopTextStream(decode_letters, ["xyz"])
    assert "".join(run(stream, [0, 1, 2, 3])) == "abcd"
    assert not stream.stopped
    plain = StopTextStream(decode_letters)
    assert run(plain, [0, 1]) == ["a", "b", ""]  # no stop strings: nothing held


def test_incomplete_utf8_is_held_until_complete() -> None:
    stream = StopTextStream(decode_letters)
    assert stream.push(0) == "a"
    assert stream.push(-1) == ""  # ends in U+FFFD: maybe half a character
    assert stream.flush() == "\ufffd"


class FakeClient:
    def __init__(self, history: list[int], nbytes: int = 10, pending_keep: int = 0) -> None:
        self.history: tuple[int, ...] = tuple(history)
        self.edge_cache_bytes = nbytes
        self.pending_keep = pending_keep  # tokens at the end that a pending keep_last protects

    def rewind(self, length: int) -> int:
        if length == len(self.history):
            return length
        length = min(length, len(self.history) - self.pending_keep)
        self.history = self.history[:length]
        return length


def test_prefix_cache_takes_the_longest_match_and_leaves_a_token_to_run() -> None:
    cache: PrefixCache[FakeClient] = PrefixCache(max_entries=4, max_edge_bytes=1000)
    a, b = FakeClient([1, 2, 3, 4, 5]), FakeClient([1, 2, 9])
    cache.put(a)
    cache.put(b)
    taken = cache.take([1, 2, 3, 4, 5, 6, 7])
    assert taken is not None
    assert taken.client is a
    assert taken.reused == 5
    cache.put(a)
    taken = cache.take([1, 2, 3, 4, 5])  # the whole prompt is cached: one token must still run
    assert taken is not None
    assert taken.client is a
    assert taken.reused == 4
    assert a.history == (1, 2, 3, 4)
    assert cache.take([7, 7]) is None  # no match and room left: the caller opens a new session
    taken = cache.take([1, 2, 3])
    assert taken is not None
    assert taken.client is b
    assert taken.reused == 2


def test_prefix_cache_bounds_and_recycling() -> None:
    cache: PrefixCache[FakeClient] = PrefixCache(max_entries=2, max_edge_bytes=25)
    clients = [FakeClient([i, i]) for i in range(3)]
    assert cache.put(clients[0]) == []
    assert cache.put(clients[1]) == []
    assert cache.put(clients[2]) == [clients[0]]
    big = FakeClient([5, 5], nbytes=20)
    assert cache.put(big) == [clients[1], clients[2]]
    assert cache.put(FakeClient([6], nbytes=5)) == []
    taken = cache.take([7, 8])  # full and no match: the least recently used is recycled from scratch
    assert taken is not None
    assert taken.client is big
    assert taken.reused == 0
    assert big.history == ()
    keeper = FakeClient([1, 2, 3, 4], pending_keep=2)
    cache.put(keeper)
    taken = cache.take([1, 2, 3, 9], reuse=True)
    assert taken is not None
    assert taken.reused == 2
    cache.put(FakeClient([1, 2]))
    taken = cache.take([1, 2, 3], reuse=False)  # reuse off: always a full re-prefill
    assert taken is not None
    assert taken.reused == 0
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix([], [1]) == 0


def test_render_chat(make_checkpoint: Callable[..., Path], chat_model: Path) -> None:
    messages = [{"role": "user", "content": "to be"}]
    with_template = AutoTokenizer.from_pretrained(chat_model, local_files_only=True)
    assert render_chat(with_template, messages) == "<|user|> to be <|end|> <|assistant|> "
    plain = AutoTokenizer.from_pretrained(make_checkpoint("llama"), local_files_only=True)
    with pytest.raises(ConfigError, match="no chat template"):
        render_chat(plain, messages)
    assert render_chat(plain, messages, CHAT_TEMPLATE) == "<|user|> to be <|end|> <|assistant|> "
