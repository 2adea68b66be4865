"""Incremental detokenization with stop strings, as OpenAI streams text.

The generated ids become text one token at a time (:class:`~splitspec.detokenize.IncrementalText`,
a short window decoded per token). :class:`StopTextStream` releases only text that can no longer
turn into a stop string (the last ``len(longest stop) - 1`` characters are held back). When a stop
string appears, the text before it is the answer and the stop string itself is dropped, as OpenAI
does (kept with ``include_stop``, vLLM's ``include_stop_str_in_output``). Streaming and
non-streaming responses both concatenate these deltas, so the two always agree.
With vLLM's ``min_tokens`` m, a stop string counts only if it ends in the text of token m + 1 or a
later one (the first m tokens may not stop the reply, as they may not be a stop token).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from splitspec.detokenize import REPLACEMENT, IncrementalText


class StopTextStream:
    """Turns generated token ids into safe text deltas; ``stopped`` once a stop string appeared."""

    def __init__(
        self,
        decode: Callable[[list[int]], str],
        stops: Sequence[str] = (),
        min_tokens: int = 0,
        context: Sequence[int] = (),
        include_stop: bool = False,
    ) -> None:
        """``context``: the prompt's last ids, which the text is decoded after (see :mod:`splitspec.detokenize`);
        ``include_stop``: the stop string that ends the text is part of it."""
        self._decoded = IncrementalText(decode, context)
        self._stops = [s for s in stops if s]
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._sent = 0  # characters of _text already released
        self._min_tokens = min_tokens  # tokens that may not complete a stop string
        self._pushed = 0  # tokens pushed so far
        self._boundary = 0  # characters of the first min_tokens tokens: a stop string must end past them
        self._include_stop = include_stop
        self.stopped = False

    @property
    def _text(self) -> str:
        """The text of the tokens pushed so far (decoded incrementally)."""
        return self._decoded.text

    def push(self, token: int) -> str:
        """Add one generated token; return the text it releases (may be empty)."""
        if self.stopped:
            raise RuntimeError("the stream already hit a stop string")
        self._decoded.push(token)  # the characters it completes are in _text
        self._pushed += 1
        if self._pushed <= self._min_tokens:
            self._boundary = len(self._text)
        # a stop string not seen before must end in the unreleased text, so it starts at >= _sent,
        # and past the text of the first min_tokens tokens
        hits = []  # (where a stop string starts, where the text then ends)
        if self._pushed > self._min_tokens:
            for s in self._stops:
                i = self._text.find(s, max(self._sent, self._boundary - len(s) + 1))
                if i >= 0:
                    hits.append((i, i + len(s) if self._include_stop else i))
        if hits:
            self.stopped = True
            return self._release(min(hits)[1])  # the first stop string (the shortest of those starting there)
        end = len(self._text) - self._hold
        if self._text.endswith(REPLACEMENT):
            end = min(end, len(self._text) - 1)
        return self._release(end)

    def flush(self) -> str:
        """The text still held back once generation ended without a stop string."""
        if self.stopped:
            return ""
        self._decoded.finish()
        return self._release(len(self._text))

    def _release(self, end: int) -> str:
        if end <= self._sent:
            return ""
        out, self._sent = self._text[self._sent : end], end
        return out
