"""Held-out documents for the audit, split *by document* into attacker-train and test windows.

Token positions of one document are strongly dependent (repeated names, identifiers, phrases), so
a random split of positions leaks: the attacker would be tested on documents it trained on. Here
every document lands wholly on one side. Windows are consecutive, non-overlapping chunks of a
document's tokens, each prefixed with BOS (as the deployment's prompts are); the BOS position is
never a recovery target. Windows are taken round-robin across documents so a token cap spreads
over many documents (the clusters of the bootstrap).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from splitspec.exceptions import ConfigError

log = logging.getLogger(__name__)

DEFAULT_CORPUS = Path(__file__).resolve().parent.parent / "assets" / "corpus" / "heldout"


@dataclass(frozen=True)
class Document:
    """One text document of the corpus."""

    doc_id: str  # "<domain>/<file stem>"
    domain: str  # sub-directory name (e.g. "prose", "code")
    text: str


@dataclass(frozen=True)
class DocSplit:
    """Which documents the attacker may train on and which it is tested on (disjoint)."""

    train: tuple[Document, ...]
    test: tuple[Document, ...]

    def __post_init__(self) -> None:
        overlap = {d.doc_id for d in self.train} & {d.doc_id for d in self.test}
        if overlap:
            raise ConfigError(f"documents on both sides of the split: {sorted(overlap)[:5]}")


@dataclass(frozen=True)
class Windows:
    """Token windows of one side of the split; row i is a window, column 0 is BOS."""

    tokens: np.ndarray  # (n_windows, window + 1) int64 token ids, BOS first
    doc_index: np.ndarray  # (n_windows,) int64 index into ``doc_ids``
    doc_ids: tuple[str, ...]  # document of each doc index
    start: np.ndarray  # (n_windows,) int64 offset of the window's first token within its document

    @property
    def n_targets(self) -> int:
        """Recovery targets: every non-BOS position."""
        return int(self.tokens.shape[0] * (self.tokens.shape[1] - 1))


def load_documents(corpus_dir: Path) -> list[Document]:
    """Every ``<domain>/*.txt`` under ``corpus_dir`` (or ``*.txt`` directly, as domain "text")."""
    corpus_dir = Path(corpus_dir)
    if not corpus_dir.is_dir():
        raise ConfigError(f"corpus directory {corpus_dir} does not exist")
    docs: list[Document] = []
    for path in sorted(corpus_dir.rglob("*.txt")):
        rel = path.relative_to(corpus_dir)
        domain = rel.parts[0] if len(rel.parts) > 1 else "text"
        text = path.read_text(encoding="utf-8", errors="replace")
        if text.strip():
            docs.append(Document(f"{domain}/{path.stem}", domain, text))
    if len(docs) < 2:
        raise ConfigError(f"{corpus_dir} holds {len(docs)} non-empty .txt documents; the audit needs at least 2")
    return docs


def split_documents(docs: list[Document], test_fraction: float, seed: int) -> DocSplit:
    """Per domain, order documents by sha256(seed:doc_id); the first round(frac*n) (>= 1) go to test.

    A domain with a single document goes to train (it cannot be on both sides).
    """
    if not 0.0 < test_fraction < 1.0:
        raise ConfigError(f"test fraction must be in (0, 1), got {test_fraction}")
    by_domain: dict[str, list[Document]] = {}
    for d in docs:
        by_domain.setdefault(d.domain, []).append(d)
    train: list[Document] = []
    test: list[Document] = []
    for domain in sorted(by_domain):
        group = sorted(by_domain[domain], key=lambda d: hashlib.sha256(f"{seed}:{d.doc_id}".encode()).hexdigest())
        n_test = 0 if len(group) < 2 else min(len(group) - 1, max(1, round(test_fraction * len(group))))
        test.extend(group[:n_test])
        train.extend(group[n_test:])
    if not test or not train:
        raise ConfigError("the document split left one side empty; add documents")
    return DocSplit(tuple(train), tuple(test))


def make_windows(
    token_lists: list[list[int]], doc_ids: list[str], window: int, max_tokens: int, bos_id: int
) -> Windows:
    """Non-overlapping ``window``-token chunks, round-robin over documents, until ``max_tokens`` targets."""
    if window < 2:
        raise ConfigError(f"window must be at least 2 tokens, got {window}")
    chunks: list[list[tuple[int, int]]] = []  # per document: (doc index, start)
    for i, toks in enumerate(token_lists):
        chunks.append([(i, s) for s in range(0, len(toks) - window + 1, window)])
    rows: list[np.ndarray] = []
    doc_index: list[int] = []
    starts: list[int] = []
    rnd = 0
    while len(rows) * window < max_tokens and any(rnd < len(c) for c in chunks):
        for c in chunks:
            if rnd < len(c) and len(rows) * window < max_tokens:
                i, s = c[rnd]
                rows.append(np.array([bos_id, *token_lists[i][s : s + window]], dtype=np.int64))
                doc_index.append(i)
                starts.append(s)
        rnd += 1
    if not rows:
        raise ConfigError(f"no document is at least {window} tokens long; lower --window")
    return Windows(np.stack(rows), np.array(doc_index, dtype=np.int64), tuple(doc_ids), np.array(starts))


def tokenize_documents(tokenizer: object, docs: tuple[Document, ...]) -> list[list[int]]:
    """Token ids of each document without special tokens (BOS is added per window)."""
    out: list[list[int]] = []
    if hasattr(tokenizer, "model_max_length"):
        tokenizer.model_max_length = 1 << 40  # whole documents are tokenised, then cut into windows
    for d in docs:
        ids = tokenizer(d.text, add_special_tokens=False)["input_ids"]  # type: ignore[operator]
        out.append([int(t) for t in ids])
    return out


@dataclass(frozen=True)
class CorpusWindows:
    """A corpus split by document and cut into windows for one model's tokenizer."""

    split: DocSplit
    train: Windows
    test: Windows


def corpus_windows(
    model_dir: Path,
    corpus_dir: Path,
    *,
    test_fraction: float,
    seed: int,
    window: int,
    max_train_tokens: int,
    max_test_tokens: int,
    exclude_train: Collection[str] = (),
) -> CorpusWindows:
    """Split ``corpus_dir`` by document, tokenise with ``model_dir``'s tokenizer, cut both sides into windows.

    ``exclude_train`` names documents (ids) dropped from the train side before it is cut (the test side stays
    as the split makes it); the returned split's train side lists only the documents kept.
    """
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    bos = config.bos_token_id if config.bos_token_id is not None else tokenizer.bos_token_id
    if bos is None:
        raise ConfigError(f"{model_dir} defines no BOS token")
    split = split_documents(load_documents(corpus_dir), test_fraction, seed)
    if exclude_train:
        dropped = set(exclude_train)
        kept = tuple(d for d in split.train if d.doc_id not in dropped)
        if not kept:
            raise ConfigError(f"no train-side document of {corpus_dir} is left once {len(dropped)} are excluded")
        split = DocSplit(kept, split.test)

    def windows(docs: tuple[Document, ...], max_tokens: int) -> Windows:
        return make_windows(tokenize_documents(tokenizer, docs), [d.doc_id for d in docs], window, max_tokens, int(bos))

    return CorpusWindows(split, windows(split.train, max_train_tokens), windows(split.test, max_test_tokens))
