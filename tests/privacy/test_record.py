"""The divergence record round-trips, and a malformed one is a clear error."""

from __future__ import annotations

from pathlib import Path

import pytest

from splitspec.exceptions import ConfigError
from splitspec.privacy.record import EDGE_RECORD, DivergenceRecord


def test_record_round_trips(tmp_path: Path) -> None:
    record = DivergenceRecord(2, 3, "a" * 64, "b" * 64, published_model="models/base")
    assert record.write(tmp_path) == tmp_path / EDGE_RECORD
    assert DivergenceRecord.read(tmp_path) == record


def test_missing_and_malformed_records(tmp_path: Path) -> None:
    assert DivergenceRecord.read(tmp_path) is None
    (tmp_path / EDGE_RECORD).write_text('{"head": 2}')
    with pytest.raises(ConfigError, match="not a valid divergence record"):
        DivergenceRecord.read(tmp_path)
    (tmp_path / EDGE_RECORD).write_text("[1, 2]")
    with pytest.raises(ConfigError, match="not a valid divergence record"):
        DivergenceRecord.read(tmp_path)
