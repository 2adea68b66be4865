"""Document-level splitting of the audit corpus."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from splitspec.exceptions import ConfigError
from splitspec.privacy.corpus import (
    DEFAULT_CORPUS,
    DocSplit,
    Document,
    load_documents,
    make_windows,
    split_documents,
)


def test_shipped_corpus_split_by_document() -> None:
    docs = load_documents(DEFAULT_CORPUS)
    split = split_documents(docs, 0.3, seed=0)
    train_ids = {d.doc_id for d in split.train}
    test_ids = {d.doc_id for d in split.test}
    assert not train_ids & test_ids
    assert train_ids | test_ids == {d.doc_id for d in docs}
    for domain in {d.domain for d in docs}:  # every domain on both sides
        assert any(d.domain == domain for d in split.train)
        assert any(d.domain == domain for d in split.test)
    again = split_documents(list(reversed(docs)), 0.3, seed=0)  # order-independent, deterministic
    assert {d.doc_id for d in again.test} == test_ids
    assert {d.doc_id for d in split_documents(docs, 0.3, seed=1).test} != test_ids


def test_split_rejects_overlap_and_bad_fraction(tmp_path: Path) -> None:
    doc = Document("a/x", "a", "text")
    with pytest.raises(ConfigError, match="both sides"):
        DocSplit((doc,), (doc,))
    with pytest.raises(ConfigError):
        split_documents([doc, Document("a/y", "a", "t")], 1.5, seed=0)
    (tmp_path / "only.txt").write_text("one document")
    with pytest.raises(ConfigError, match="at least 2"):
        load_documents(tmp_path)


def test_windows_round_robin_and_cap() -> None:
    lists = [list(range(100, 140)), list(range(200, 210)), list(range(300, 330))]
    w = make_windows(lists, ["a", "b", "c"], window=10, max_tokens=50, bos_id=0)
    assert w.tokens.shape == (5, 11)
    assert (w.tokens[:, 0] == 0).all()
    assert w.doc_index.tolist() == [0, 1, 2, 0, 2]  # round-robin across documents
    assert w.tokens[3, 1:].tolist() == list(range(110, 120))
    assert w.n_targets == 50
    assert np.array_equal(w.start, [0, 0, 0, 10, 10])
    with pytest.raises(ConfigError):
        make_windows([[1, 2]], ["a"], window=10, max_tokens=50, bos_id=0)
