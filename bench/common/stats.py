"""Small statistics shared by the benchmarks (no numpy needed)."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile, q in [0, 100]; nan for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def bootstrap_ratio_range(numerator: Sequence[float], denominator: Sequence[float], q: float,
                          *, coverage: float = 0.90, draws: int = 1_000, seed: int = 0
                          ) -> tuple[float, float]:
    """How precise percentile(numerator, q) / percentile(denominator, q) is: the central
    `coverage` of that ratio over `draws` resamples (with replacement) of each sample.

    A P99 of a few hundred requests is about their few slowest, so a ratio of two such P99s
    moves from draw to draw; a bar on it means little inside this range. (nan, nan) without
    values; a resample whose denominator is 0 or nan is left out."""
    if not numerator or not denominator:
        return math.nan, math.nan
    rng = random.Random(seed)
    ratios = []
    for _ in range(draws):
        top = percentile(rng.choices(numerator, k=len(numerator)), q)
        bottom = percentile(rng.choices(denominator, k=len(denominator)), q)
        if bottom > 0 and not math.isnan(top) and not math.isnan(bottom):
            ratios.append(top / bottom if not math.isinf(bottom) else math.nan)
    ratios = sorted(r for r in ratios if not math.isnan(r))
    if not ratios:
        return math.nan, math.nan
    tail = (1.0 - coverage) / 2
    low = ratios[min(len(ratios) - 1, int(tail * len(ratios)))]
    high = ratios[min(len(ratios) - 1, int((1.0 - tail) * len(ratios)))]
    return low, high
