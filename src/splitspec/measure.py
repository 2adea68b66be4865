"""Summary statistics of repeated measurements: the one median and quartiles every report uses.

The median of an even number of values is the mean of the two middle ones (``statistics.median``).
An empty sample has no median: callers say what stands for it (NaN in benchmark tables, where it
prints as "-"; 0 in a live summary).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence

__all__ = ["median", "quartiles"]


def median(values: Iterable[float], empty: float = float("nan")) -> float:
    """The median of ``values``; ``empty`` when there are none."""
    data = list(values)
    return float(statistics.median(data)) if data else empty


def quartiles(values: Sequence[float]) -> tuple[float, float]:
    """First and third quartiles (inclusive method); a single value is both, none gives NaN."""
    if len(values) < 2:
        v = values[0] if values else float("nan")
        return float(v), float(v)
    q = statistics.quantiles(values, n=4, method="inclusive")
    return float(q[0]), float(q[2])
