"""Benchmark prompts built deterministically from held-out documents.

Three sets, each a list of fixed-length token windows that *end* at a chosen cut point, so the
model continues the document from there:

* ``prose`` -- held-out prose documents (``corpus/prose/*.txt``); the cut is the first line break
  after one third of the document (past title pages and cast lists).
* ``code`` -- held-out source files (``corpus/code/*.txt``), cut the same way.
* ``structured`` -- data literals inside the held-out source files: runs of at least three
  consecutive lines that each start like a literal element (a quote, a digit or an opening
  bracket) and end with a comma -- dict/list/tuple tables such as ``_typeinfo_map = {...}`` or
  ``__all__ = [...]``. The cut is in the middle of the run, so the continuation is more table
  rows. This is the content on which the paper found lookahead decoding did *worse* than
  sequential; a separate set makes that visible once speculative modes plug in.

Documents are taken in sorted-name order, spread evenly over the list, at most one prompt per
document (the longest literal run, for ``structured``). Every window has exactly
``prompt_tokens`` tokens: the tokenizer's BOS (if it has one) followed by the last
``prompt_tokens - 1`` tokens of the text before the cut.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from splitspec.exceptions import ConfigError

__all__ = ["Prompt", "TokenizerLike", "build_prompts", "literal_runs"]

_CHARS_PER_TOKEN = 12  # text tokenized before the cut, characters per wanted token (BPE needs ~3-4)
_MIN_CONTEXT_CHARS = 256  # ... and at least this many characters
_LITERAL_LINE = re.compile(r"""^\s*(['"(\[{]|[-+]?\d).*,\s*(#.*)?$""")
_MIN_RUN_LINES = 3

_Candidate = tuple[Path, str, int]  # document, its text, cut offset


class TokenizerLike(Protocol):
    """The slice of a Hugging Face tokenizer the prompt builder needs."""

    @property
    def bos_token_id(self) -> int | None: ...

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...


@dataclass(frozen=True)
class Prompt:
    """One benchmark prompt."""

    prompt_set: str  # "code", "prose" or "structured"
    index: int  # position within its set, 0-based
    source: str  # document file name it was cut from
    cut_char: int  # character offset of the cut in that document
    token_ids: tuple[int, ...]  # the prompt, exactly prompt_tokens tokens

    @property
    def prompt_id(self) -> str:
        return f"{self.prompt_set}{self.index}"


def literal_runs(text: str) -> list[tuple[int, int]]:
    """``(first_line, n_lines)`` of every run of >= 3 literal-element lines in ``text``."""
    runs: list[tuple[int, int]] = []
    start, length = 0, 0
    for i, line in enumerate([*text.splitlines(), ""]):
        if _LITERAL_LINE.match(line):
            if length == 0:
                start = i
            length += 1
        else:
            if length >= _MIN_RUN_LINES:
                runs.append((start, length))
            length = 0
    return runs


def _line_cut(text: str, fraction: float) -> int:
    """Offset just after the first line break at or after ``fraction`` of the text."""
    pos = text.find("\n", int(len(text) * fraction))
    return len(text) if pos < 0 else pos + 1


def _structured_cut(text: str) -> int | None:
    """Offset in the middle of the longest literal run (after whole lines), or None."""
    runs = literal_runs(text)
    if not runs:
        return None
    start, length = max(runs, key=lambda r: (r[1], -r[0]))
    lines = text.splitlines(keepends=True)
    cut_line = start + max(2, length // 2)
    return sum(len(line) for line in lines[:cut_line])


def _spread(items: list[_Candidate], n: int) -> list[_Candidate]:
    """``n`` items spread evenly over ``items`` (all of them if there are fewer)."""
    if len(items) <= n:
        return items
    return [items[(i * len(items)) // n] for i in range(n)]


def _window(tokenizer: TokenizerLike, text: str, cut: int, n_tokens: int) -> tuple[int, ...] | None:
    body = n_tokens - (1 if tokenizer.bos_token_id is not None else 0)
    chars = max(_MIN_CONTEXT_CHARS, n_tokens * _CHARS_PER_TOKEN)
    ids = tokenizer.encode(text[max(0, cut - chars) : cut], add_special_tokens=False)
    if len(ids) < body:
        return None
    window = ids[len(ids) - body :]
    if tokenizer.bos_token_id is not None:
        window = [tokenizer.bos_token_id, *window]
    return tuple(int(t) for t in window)


def build_prompts(
    tokenizer: TokenizerLike, corpus_dir: Path, sets: tuple[str, ...], per_set: int, prompt_tokens: int
) -> list[Prompt]:
    """Build ``per_set`` prompts of ``prompt_tokens`` tokens for each set (see module doc)."""
    prompts: list[Prompt] = []
    for prompt_set in sets:
        folder = corpus_dir / ("code" if prompt_set == "structured" else prompt_set)
        docs = sorted(folder.glob("*.txt"))
        candidates: list[_Candidate] = []
        for doc in docs:
            try:
                text = doc.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise ConfigError(f"cannot read held-out document {doc}: {exc}") from None
            cut = _structured_cut(text) if prompt_set == "structured" else _line_cut(text, 1 / 3)
            if cut is not None:
                candidates.append((doc, text, cut))
        # Evenly spread documents first; the rest, in name order, stand in for any that are too
        # short for a full window.
        first = _spread(candidates, per_set)
        order = first + [c for c in candidates if c not in first]
        chosen: list[Prompt] = []
        for doc, text, cut in order:
            if len(chosen) == per_set:
                break
            ids = _window(tokenizer, text, cut, prompt_tokens)
            if ids is not None:
                chosen.append(Prompt(prompt_set, len(chosen), doc.name, cut, ids))
        if len(chosen) < per_set:
            raise ConfigError(
                f"prompt set {prompt_set!r}: only {len(chosen)} of {per_set} documents in {folder} "
                f"give a {prompt_tokens}-token window"
            )
        prompts.extend(chosen)
    return prompts
