"""Audit outcomes: per test token, the rank of the true token in each attacker's top-5 guesses.

:class:`AuditData` holds them while the audit runs (:mod:`splitspec.privacy.audit`); the report
(:mod:`splitspec.privacy.report`) writes them to ``outcomes.csv.gz`` with :func:`write_outcomes`,
and :func:`load_outcomes` reads them back so anyone can re-run the paired tests.
:func:`pack_hits` / :func:`unpack_hits` store one attacker's per-token top-1 outcomes compactly in a
JSON record (the frontier's points), so defences can be compared with paired tests later.
"""

from __future__ import annotations

import base64
import gzip
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from splitspec.privacy.corpus import Windows


@dataclass(frozen=True)
class SeriesKey:
    """One measured series: a condition, an attacker, a side and a depth."""

    condition: str  # "stock", "diverged/non-adaptive", "diverged/adaptive", or "-" for baselines
    attacker: str
    side: str  # "input", "output", or "-" for baselines
    depth: int  # 0 for baselines

    @property
    def column(self) -> str:
        return f"{self.condition}|{self.attacker}|{self.side}|{self.depth}"


@dataclass
class AuditData:
    """Per-token ranks of every series on the shared test tokens."""

    test: Windows
    targets: np.ndarray  # (n, W) test token ids
    vocab_size: int  # model vocabulary (for the uniform reference)
    ranks: dict[SeriesKey, np.ndarray] = field(default_factory=dict)  # (n, W) int8: 1..5, 0 = miss
    extra: dict[str, object] = field(default_factory=dict)


def ranks_of(top5: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """(n, W) int8 rank of each target among its guesses ``top5`` (n, W, 5): 1..5, 0 = not there."""
    match = top5 == targets[..., None]
    return np.where(match.any(-1), match.argmax(-1) + 1, 0).astype(np.int8)


def write_outcomes(data: AuditData, path: Path) -> None:
    """Per-token outcomes as gzipped CSV: one row per test token, one rank column per series."""
    n, w = data.targets.shape
    cols = sorted(data.ranks, key=lambda k: k.column)
    with gzip.open(path, "wt", encoding="utf-8", newline="") as f:
        f.write("# rank of the true token among the attacker's top-5 guesses (1..5), 0 = not in top-5\n")
        f.write(",".join(["window", "position", "doc_id", "token", *[c.column for c in cols]]) + "\n")
        flat = [data.ranks[c].reshape(-1) for c in cols]
        for i in range(n * w):
            win, pos = divmod(i, w)
            doc = data.test.doc_ids[int(data.test.doc_index[win])]
            f.write(
                f"{win},{pos + 1},{doc},{int(data.targets[win, pos])}," + ",".join(str(int(r[i])) for r in flat) + "\n"
            )


def load_outcomes(path: Path) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Read :func:`write_outcomes` back: {series column: ranks (tokens,)}, document id per token."""
    cols, docs, _ = _read_outcomes(path)
    return cols, docs


def _read_outcomes(path: Path) -> tuple[dict[str, np.ndarray], np.ndarray, list[list[str]]]:
    """:func:`load_outcomes`, and every row's first four fields (window, position, document, token) as text."""
    with gzip.open(path, "rt", encoding="utf-8") as f:
        lines = [ln for ln in f.read().splitlines() if not ln.startswith("#")]
    header = lines[0].split(",")
    rows = [ln.split(",") for ln in lines[1:]]
    docs = np.array([r[2] for r in rows])
    cols = {h: np.array([int(r[j]) for r in rows], dtype=np.int8) for j, h in enumerate(header) if j >= 4}
    return cols, docs, [r[:4] for r in rows]


def read_audit_data(
    path: Path, vocab_size: int, doc_ids: Sequence[str] = (), series: Sequence[SeriesKey] = ()
) -> AuditData:
    """The :class:`AuditData` that :func:`write_outcomes` wrote (BOS columns, not stored, read as 0).

    The paired tests need only the per-token ranks, their documents and the window layout, all of which
    the file holds. Given the audit's test documents (``doc_ids``, in its order: the bootstrap's cluster
    numbering) and its ``series`` order, :func:`splitspec.privacy.audit_stats.analyse` re-runs them exactly.
    """
    columns, docs, rows = _read_outcomes(path)  # one pass over the file
    if not rows:
        raise ValueError(f"{path} holds no outcomes")
    window = np.array([int(r[0]) for r in rows])
    position = np.array([int(r[1]) for r in rows])
    n, w = int(window.max()) + 1, int(position.max())
    if len(rows) != n * w or not np.array_equal(window * w + position - 1, np.arange(n * w)):
        raise ValueError(f"{path}: rows are not {n} whole windows of {w} tokens in order")
    doc_of_window = docs.reshape(n, w)[:, 0]
    order = list(doc_ids) or sorted(set(doc_of_window.tolist()))
    number = {d: i for i, d in enumerate(order)}
    missing = set(doc_of_window.tolist()) - set(number)
    if missing:
        raise ValueError(f"{path}: outcomes of documents outside the audit's test split: {sorted(missing)[:3]}")
    doc_index = np.array([number[d] for d in doc_of_window.tolist()], dtype=np.int64)
    targets = np.array([int(r[3]) for r in rows], dtype=np.int64).reshape(n, w)
    tokens = np.concatenate([np.zeros((n, 1), dtype=np.int64), targets], axis=1)
    test = Windows(tokens, doc_index, tuple(order), np.zeros(n, dtype=np.int64))
    data = AuditData(test, targets, vocab_size)
    stored = {}
    for column, ranks in columns.items():
        condition, attacker, side, depth = column.split("|")
        stored[SeriesKey(condition, attacker, side, int(depth))] = ranks.reshape(n, w)
    if series and set(series) != set(stored):
        raise ValueError(f"{path} holds other series than the report names")
    for key in series or sorted(stored, key=lambda k: k.column):
        data.ranks[key] = stored[key]
    return data


def pack_hits(hits: np.ndarray) -> str:
    """Per-token 0/1 outcomes (any shape, read in C order) as base64 of their packed bits."""
    bits = np.packbits(np.asarray(hits, dtype=bool).ravel())
    return base64.b64encode(bits.tobytes()).decode("ascii")


def unpack_hits(text: str, n: int) -> np.ndarray:
    """The (n,) boolean outcomes :func:`pack_hits` stored; refuses text of the wrong length."""
    raw = np.frombuffer(base64.b64decode(text, validate=True), dtype=np.uint8)
    if raw.size != (n + 7) // 8:
        raise ValueError(f"packed outcomes hold {raw.size} bytes, {n} tokens need {(n + 7) // 8}")
    return np.unpackbits(raw, count=n).astype(bool)
