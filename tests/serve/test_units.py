"""Pieces of the server on their own: stop-string streaming, the prefix LRU, chat templates."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from splitspec.bench.scenario import DEFAULT_CORPUS_DIR as HELDOUT
from splitspec.demo import embedded_model
from splitspec.detokenize import IncrementalText
from splitspec.edge import EdgeConfig
from splitspec.serve.app import create_app
from splitspec.serve.choices import bad_word_ids
from splitspec.serve.config import ServeConfig
from splitspec.serve.metrics import ServeMetrics
from splitspec.serve.prefix_cache import PrefixCache
from splitspec.serve.state import ServeState
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


def test_include_stop_keeps_the_first_stop_string_in_the_text() -> None:
    assert "".join(run(StopTextStream(decode_letters, ["cde", "zz"], include_stop=True), [0, 1, 2, 3, 4, 5])) == "abcde"
    # stop strings that appear within one token: the first to start, and of those starting there the shortest
    both = StopTextStream(lambda ids: "".join(["ab", "cdef"][i] for i in ids), ["cde", "cd", "f"], include_stop=True)
    assert "".join(run(both, [0, 1])) == "abcd"


def test_without_a_stop_everything_is_released() -> None:
    stream = StopTextStream(decode_letters, ["xyz"])
    assert "".join(run(stream, [0, 1, 2, 3])) == "abcd"
    assert not stream.stopped
    plain = StopTextStream(decode_letters)
    assert run(plain, [0, 1]) == ["a", "b", ""]  # no stop strings: nothing held


def test_min_tokens_ignores_stop_strings_ending_in_the_first_tokens() -> None:
    assert "".join(run(StopTextStream(decode_letters, ["b"], min_tokens=2), [0, 1, 2, 1, 3])) == "abc"
    assert "".join(run(StopTextStream(decode_letters, ["bc"], min_tokens=2), [0, 1, 2, 3])) == "a"  # ends in token 3
    assert "".join(run(StopTextStream(decode_letters, ["ab"], min_tokens=2), [0, 1, 0, 1, 2])) == "ab"
    assert "".join(run(StopTextStream(decode_letters, ["b"]), [0, 1, 2])) == "a"  # min_tokens 0: as before


def test_incomplete_utf8_is_held_until_complete() -> None:
    stream = StopTextStream(decode_letters)
    assert stream.push(0) == "a"
    assert stream.push(-1) == ""  # ends in U+FFFD: maybe half a character
    assert stream.flush() == "\ufffd"


class FakeClient:
    def __init__(self, history: list[int], nbytes: int = 10) -> None:
        self.history: tuple[int, ...] = tuple(history)
        self.edge_cache_bytes = nbytes

    def truncate(self, length: int) -> None:
        self.history = self.history[:length]


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


def test_a_shared_header_does_not_take_another_conversations_session_while_there_is_room() -> None:
    """Every chat shares its first few tokens (BOS, the system header) with every other: conversation B used to
    take A's idle session and cut it back to those, throwing A's turns away with room to spare."""
    header = [1, 2, 3]
    a = FakeClient([*header, *range(10, 30)])
    cache: PrefixCache[FakeClient] = PrefixCache(max_entries=8, max_edge_bytes=1000)
    cache.put(a)
    assert cache.take([*header, *range(40, 50)]) is None  # B opens a session of its own
    assert a.history == (*header, *range(10, 30))
    taken = cache.take([*header, *range(10, 30), 31])  # A's next turn reuses all of it
    assert taken is not None
    assert taken.reused == 23
    full: PrefixCache[FakeClient] = PrefixCache(max_entries=1, max_edge_bytes=1000)
    full.put(a)
    taken = full.take([*header, 99])  # no room: the best match is recycled, keeping what it can
    assert taken is not None
    assert taken.reused == 3


def test_a_session_larger_than_the_byte_bound_is_turned_away_alone() -> None:
    cache: PrefixCache[FakeClient] = PrefixCache(max_entries=8, max_edge_bytes=100)
    small = [FakeClient([i]) for i in range(5)]
    for client in small:
        assert cache.put(client) == []
    big = FakeClient([9], nbytes=120)
    assert cache.put(big) == [big]  # it used to flush the five others, then itself
    assert len(cache) == 5


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
    cache.put(FakeClient([1, 2]))
    taken = cache.take([1, 2, 3], reuse=False)  # reuse off: always a full re-prefill
    assert taken is not None
    assert taken.reused == 0
    assert len(cache.drain()) == 1
    assert len(cache) == 0


async def test_chat_needs_a_template(make_checkpoint: Callable[..., Path]) -> None:
    """A checkpoint without a chat template: chat is a 400 naming the fix; --chat-template supplies one."""
    plain = make_checkpoint("llama")
    edge = EdgeConfig(model_dir=plain, cloud_url="ws://127.0.0.1:9", allow_stock_edge_weights=True)
    state = ServeState(ServeConfig(edge=edge, served_model_name="m"))
    assert not state.templated
    app = create_app(state)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
        body = {"model": "m", "messages": [{"role": "user", "content": "to be"}], "max_tokens": 2}
        response = await http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "no_chat_template"
    assert "--chat-template" in response.json()["error"]["message"]
    templated = ServeState(ServeConfig(edge=edge, served_model_name="m", chat_template=CHAT_TEMPLATE))
    assert templated.templated


async def test_a_model_named_like_a_hub_id_is_found(make_checkpoint: Callable[..., Path]) -> None:
    """The default served name of a hub snapshot is "org/name": /v1/models/org/name must answer (it was a 404)."""
    edge = EdgeConfig(model_dir=make_checkpoint("llama"), cloud_url="ws://127.0.0.1:9", allow_stock_edge_weights=True)
    app = create_app(ServeState(ServeConfig(edge=edge, served_model_name="org/tiny")))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
        found = await http.get("/v1/models/org/tiny")
        missing = await http.get("/v1/models/org/other")
    assert found.status_code == 200
    assert found.json()["id"] == "org/tiny"
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "model_not_found"


def _demo_tokenizer() -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(embedded_model("base"))


def test_incremental_text_is_the_whole_decoding_and_decodes_a_short_window() -> None:
    """Per token, only the last few ids are decoded (not every id so far), and the text is the whole decoding."""
    tok = _demo_tokenizer()
    ids = tok.encode((HELDOUT / "code" / "chunk.txt").read_text() + " héllo wörld ✓ 日本語 🙂" * 20)[:1500]
    windows: list[int] = []

    def decode(part: list[int]) -> str:
        windows.append(len(part))
        return str(tok.decode(part, skip_special_tokens=True))

    text = IncrementalText(decode)
    for i, token in enumerate(ids):
        text.push(token)
        assert str(tok.decode(ids[: i + 1], skip_special_tokens=True)).startswith(text.text)
    pushed = list(windows)
    tail = text.finish()
    assert text.text == tok.decode(ids, skip_special_tokens=True)
    assert text.text.endswith(tail)
    assert len(pushed) == 2 * len(ids)  # two short decodings per token: the whole text was never decoded again
    assert max(pushed) <= 8


def test_incremental_text_on_random_ids_with_special_tokens_and_broken_utf8() -> None:
    """Random ids (special tokens, bytes that never make a character) end as the whole decoding."""
    tok = _demo_tokenizer()
    rng = random.Random(0)
    for _ in range(40):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 40))]
        text = IncrementalText(lambda part: str(tok.decode(part, skip_special_tokens=True)))
        deltas = [text.push(token) for token in ids]
        deltas.append(text.finish())
        assert "".join(deltas) == text.text == tok.decode(ids, skip_special_tokens=True)


def test_incremental_text_with_a_first_token_rule_and_a_decoder_that_rewrites_the_run() -> None:
    # a SentencePiece-like decoder: words joined by spaces, a string's first space dropped
    words = {0: "▁the", 1: "▁cat", 2: "s", 3: "▁sat"}

    def spm(part: list[int]) -> str:
        return "".join(words[i] for i in part).replace("▁", " ").removeprefix(" ")

    text = IncrementalText(spm)
    for token in [0, 1, 2, 3]:
        text.push(token)
    assert text.text == "the cats sat"
    # a decoder whose next token rewrites what came before (id 9 capitalises the previous letter): whole decoding

    def shifty(part: list[int]) -> str:
        out = ""
        for i in part:
            out = out[:-1] + out[-1:].upper() if i == 9 else out + chr(ord("a") + i)
        return out

    text = IncrementalText(shifty)
    for token in [0, 1, 9, 2]:
        text.push(token)
    assert text.text == "aBc"
    assert text.finish() == ""  # nothing was pending


def test_a_continuation_is_decoded_after_its_prompt() -> None:
    """A SentencePiece decoder drops a string's first space: the prompt's last ids keep the continuation's."""
    words = {0: "▁to", 1: "▁be", 2: "▁or", 3: "n", 9: "▁not"}

    def spm(part: list[int]) -> str:
        return "".join(words[i] for i in part).replace("▁", " ").removeprefix(" ")

    alone = IncrementalText(spm)
    after = IncrementalText(spm, [0, 1])
    for token in (2, 9):
        alone.push(token)
        after.push(token)
    assert alone.text == "or not"
    assert after.text == " or not"  # "to be" + text == the whole decoding
    assert spm([0, 1]) + after.text == spm([0, 1, 2, 9])
    pending = IncrementalText(spm, [0])
    assert pending.finish() == ""  # nothing pushed: the context is not text
    stream = StopTextStream(spm, [" not"], context=[0, 1])
    assert [stream.push(2), stream.push(9)] == ["", " or"]  # the stop string's space came from the decoding

    def shifty(part: list[int]) -> str:  # the next id rewrites the run: the whole text is decoded again
        out = ""
        for i in part:
            out = out[:-1] + out[-1:].upper() if i == 9 else out + chr(ord("a") + i)
        return out

    rewritten = IncrementalText(shifty, [0, 1])
    for token in (2, 9, 3):
        rewritten.push(token)
    assert rewritten.text == "Cd"  # after the context "ab": never the context's own letters


def test_a_stop_stream_releases_held_utf8_at_the_end() -> None:
    stream = StopTextStream(decode_letters)
    assert stream.push(0) == "a"
    assert stream.push(-1) == ""  # unfinished, and nothing completes it
    assert stream.push(-1) == ""
    assert stream.flush() == "\ufffd\ufffd"


def test_a_workers_metrics_carry_its_index_on_every_sample() -> None:
    def samples(metrics: ServeMetrics) -> list[dict[str, str]]:
        metrics.requests.labels("/v1/completions", "200").inc()
        metrics.step_ms.labels("network").observe(3.0)
        page = metrics.render().decode()
        return [s.labels for f in text_string_to_metric_families(page) for s in f.samples]

    labelled = samples(ServeMetrics(worker=3))
    assert labelled
    assert all(labels.get("worker") == "3" for labels in labelled)
    assert {"endpoint": "/v1/completions", "status": "200", "worker": "3"} in labelled
    assert all("worker" not in labels for labels in samples(ServeMetrics()))


def test_bad_word_ids_are_vllms_word_alone_and_after_a_space() -> None:
    """vLLM's rule: the word without its leading spaces, and after a space where that starts with another token and
    is as long (byte-level BPE: "the" and " the" are different tokens)."""
    tokenizer = AutoTokenizer.from_pretrained(embedded_model("base"))

    def encode(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    assert bad_word_ids(encode, ["the", "  Romeo", "import os", "foo", "Verona"]) == [
        [1007],
        [281],  # "the", " the"
        [3494],
        [4818],  # the leading spaces dropped, then one put back
        [904, 709],
        [677, 709],  # two tokens, the first differs after a space
        [4410],  # " foo" is [756, 81]: longer, so left out
        [56, 272, 7580],  # " Verona" is [7523, 7580]: shorter, left out
    ]
    assert [encode(w) for w in ("the", " the", "foo", " foo", " Verona")] == [[1007], [281], [4410], [756, 81],
                                                                              [7523, 7580]]  # fmt: skip
