"""Order statistics for timings: medians across repetitions, percentiles across streams."""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) with linear interpolation between order statistics."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def median_interval(values: Sequence[float], confidence: float = 0.95, resamples: int = 4000) -> tuple[float, float]:
    """A bootstrap `confidence` interval of the median of `values` (seeded: the same values give the same interval).

    With few values it can only be as fine as their order statistics: for 5 it is their whole range (a resample
    takes the lowest value as its median about 6 % of the time, more than the 2.5 % tail).
    """
    if not values:
        return math.nan, math.nan
    draw = random.Random(0)
    medians = sorted(statistics.median(draw.choices(values, k=len(values))) for _ in range(resamples))
    tail = (1 - confidence) / 2
    return medians[int(tail * resamples)], medians[int((1 - tail) * resamples) - 1]
