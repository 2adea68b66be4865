"""The two OpenAI logprobs shapes built from (token, logprob, alternatives) triples and a real
byte-level tokenizer, ready for the edge engine to fill."""

from __future__ import annotations

import math
from pathlib import Path

from transformers import AutoTokenizer

from splitspec.decoding.grammar import GrammarCompiler
from splitspec.serve.logprobs import FLOOR, TextOffsets, TokenBytes, chat_logprobs, completion_logprobs, token_text
from tests.tool_model import TOOL_VOCAB


def test_chat_and_legacy_shapes(tool_model: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tool_model, local_files_only=True)
    compiler = GrammarCompiler(tokenizer, TOOL_VOCAB)
    ids = tokenizer.encode("to be é", add_special_tokens=False)
    pieces = [compiler.token_bytes(t) for t in ids]
    assert b"".join(pieces) == "to be é".encode()
    entries = [(t, -0.5 * i, [(t, -0.5 * i), (ids[0], -3.0)]) for i, t in enumerate(ids)]
    chat = chat_logprobs(entries, compiler.token_bytes)
    assert chat["refusal"] is None
    assert [c["bytes"] for c in chat["content"]] == [list(p) for p in pieces]
    assert [c["token"] for c in chat["content"]] == [token_text(p) for p in pieces]
    assert chat["content"][1]["logprob"] == -0.5
    assert chat["content"][1]["top_logprobs"][1] == {"token": "to", "logprob": -3.0, "bytes": list(b"to")}
    legacy = completion_logprobs([(ids[0], None, []), *entries[1:]], compiler.token_bytes)
    assert legacy["token_logprobs"][0] is None
    assert legacy["top_logprobs"][0] is None
    assert legacy["tokens"] == [token_text(p) for p in pieces]
    assert legacy["text_offset"][:2] == [0, len("to")]
    assert all(token in top for token, top in zip(legacy["tokens"][1:], legacy["top_logprobs"][1:], strict=True))
    assert chat_logprobs([(ids[0], -math.inf, [])], compiler.token_bytes)["content"][0]["logprob"] == FLOOR


def test_partial_utf8_tokens_show_their_bytes() -> None:
    assert token_text("é".encode()[:1]) == "bytes:\\xc3"
    assert token_text(b"ok") == "ok"


def test_text_offsets_index_the_text_across_split_characters_special_tokens_and_chunks(tool_model: Path) -> None:
    """Each offset is the length of the text before its token: a token ending inside a UTF-8 character adds
    nothing until the character is whole, a special token (left out of the text) adds nothing, and a stream's
    chunks count on. Each token's bytes decoded alone used to count a split character as nothing at all."""
    tokenizer = AutoTokenizer.from_pretrained(tool_model, local_files_only=True)
    token_bytes = TokenBytes(tokenizer, TOOL_VOCAB)
    text = "é to be, or ü"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert any(len(token_bytes(t)) == 1 and token_bytes(t)[0] >= 0x80 for t in ids)  # é or ü is split
    end = tokenizer.added_tokens_encoder["<|im_end|>"]
    entries: list[tuple[int, float | None, list[tuple[int, float]]]] = [(t, -1.0, []) for t in [end, *ids]]
    offsets = completion_logprobs(entries, token_bytes)["text_offset"]
    decoded = tokenizer.decode([end, *ids], skip_special_tokens=True)
    assert decoded == text
    for (token, _, _), at in zip(entries, offsets, strict=True):
        piece = token_bytes(token).decode("utf-8", errors="ignore")
        if token != end and piece:  # a whole token's text starts where its offset says
            assert text[at:].startswith(piece), (at, piece)
    assert offsets == sorted(offsets)
    streamed = TextOffsets(token_bytes)  # the same tokens in chunks of 2
    chunks = [
        completion_logprobs(entries[i : i + 2], token_bytes, streamed)["text_offset"] for i in range(0, len(entries), 2)
    ]
    assert [at for chunk in chunks for at in chunk] == offsets
    assert streamed.at == len(text)
