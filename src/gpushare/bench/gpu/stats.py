"""The few statistics the report needs: a summary of repeated runs and shares of a
baseline (pure)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Summary:
    """Repeated measurements of one thing. ``n`` 0: nothing was measured (all zero)."""

    n: int
    median: float
    mean: float
    low: float
    high: float

    @property
    def spread(self) -> float:
        """(high - low) / median: how far apart the runs were, relative."""
        return (self.high - self.low) / self.median if self.median else 0.0


EMPTY = Summary(0, 0.0, 0.0, 0.0, 0.0)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100), linear between the closest ranks; 0 for none."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = (len(ordered) - 1) * min(max(q, 0.0), 100.0) / 100.0
    below = math.floor(rank)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (ordered[above] - ordered[below]) * (rank - below)


def summarize(values: Sequence[float]) -> Summary:
    if not values:
        return EMPTY
    return Summary(
        n=len(values),
        median=percentile(values, 50),
        mean=sum(values) / len(values),
        low=min(values),
        high=max(values),
    )


def share_of(values: Sequence[float], baseline: float) -> Summary:
    """Each value as a share of ``baseline`` (a dedicated card's median), summarised;
    empty where there is no baseline to divide by."""
    if baseline <= 0:
        return EMPTY
    return summarize([v / baseline for v in values])
