"""Incremental detokenization: generated token ids to text, one token at a time.

Decoding every generated id again for each new token (what a stream printing ``decode(ids)[len(shown):]``
does) costs a time that grows with the answer: 1.1 ms per token at 2,000 tokens with the demo
tokenizer, so a long answer's detokenization grows with its square, and in ``splitspec serve`` it
runs on the event loop every stream shares. :class:`IncrementalText` decodes a short window of the
last ids instead (the offsets vLLM's and TGI's detokenizers keep).

A continuation is decoded after the last few ids of its prompt (``context``, as vLLM starts its
offsets inside the prompt): a SentencePiece decoder drops the leading space of a string's first
word, so "to be or" continued by "▁be" decodes to "be" alone but to " be" after the prompt, and an
echoed prompt plus its completion must read as the whole decoding.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"  # what a decoder shows for an incomplete UTF-8 sequence
CONTEXT_TOKENS = 5  # prompt ids a continuation is decoded after (vLLM's initial detokenization offset)


class IncrementalText:
    """``text``: what ``decode`` makes of the ids pushed so far, kept up to date by decoding a short window.

    The window starts at ``_prefix``, one settled run of tokens before ``_read`` (the ids whose text is in
    ``text``), so a decoder that treats the first token of a string differently (SentencePiece drops its
    leading space) decodes the run before the new ids and the window alike, and the new text is what the
    window adds to the run. A token whose text ends in an unfinished UTF-8 sequence, or adds nothing (a
    skipped special token), stays in the window until a later one completes it. Where the window's decoding
    does not extend the run's (a decoder's clean-up joining across the two), the whole text is decoded
    again: rare, and what every token cost before.
    """

    def __init__(self, decode: Callable[[list[int]], str], context: Sequence[int] = ()) -> None:
        """``context``: the ids before the ones pushed (a prompt's last :data:`CONTEXT_TOKENS`), decoded with
        them and not part of ``text``."""
        self._decode = decode
        self._tokens: list[int] = list(context)
        self._context = len(self._tokens)  # leading ids that are context, not text
        self._prefix = 0  # first id of the window
        self._read = self._context  # ids whose text is in ``text`` (after the context)
        self.text = ""

    def push(self, token: int) -> str:
        """Add one id -> the characters it completes (``text`` grows by them; may be empty)."""
        self._tokens.append(token)
        run = self._decode(self._tokens[self._prefix : self._read])
        window = self._decode(self._tokens[self._prefix :])
        if len(window) <= len(run) or window.endswith(REPLACEMENT):
            return ""  # nothing new yet, or half a character
        before = self.text
        if window.startswith(run):
            self.text += window[len(run) :]
        else:
            self.text = self._whole()
        self._prefix, self._read = self._read, len(self._tokens)
        return self.text[len(before) :]

    def _whole(self) -> str:
        """The text of every id pushed, decoded again in full after the context."""
        return text_after(self._decode, self._tokens[: self._context], self._tokens[self._context :])

    def finish(self) -> str:
        """Generation ended: the window's unfinished tail joins ``text`` as it decodes -> the characters added."""
        before = self.text
        if self._read < len(self._tokens):
            self.text = self._whole()
            self._prefix = self._read = len(self._tokens)
        return self.text[len(before) :]


def text_after(decode: Callable[[list[int]], str], context: Sequence[int], ids: Sequence[int]) -> str:
    """What ``ids`` add to the decoding of ``context`` (their own decoding where the two do not line up)."""
    whole, before = decode([*context, *ids]), decode(list(context))
    return whole[len(before) :] if whole.startswith(before) else decode(list(ids))
