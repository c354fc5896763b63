"""The operator's rule for where a sweep's knee is: the 5% rule and the 20% back-off.

The knee is the last level whose next step adds less than `min_gain` (5%) throughput; the
safe level is `backoff` (80%) of it, rounded down, at least 1. Pure: the simulator judges
its engines' true knee by it, and `kneegate sweep` (kneegate_bench.sweep) the live ones.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Knee", "find_knee"]


@dataclass(frozen=True, slots=True)
class Knee:
    level: int | None  # None: every step still paid (no knee inside the levels tried)
    index: int | None  # position of the knee in the levels
    safe: int | None  # floor(backoff x level), at least 1
    peak_level: int  # the level with the highest throughput
    peak: float


def find_knee(
    levels: Sequence[int],
    throughputs: Sequence[float],
    *,
    min_gain: float = 0.05,
    backoff: float = 0.8,
) -> Knee:
    """Apply the 5% rule to a sweep (levels ascending, one throughput each)."""
    if len(levels) != len(throughputs) or not levels:
        raise ValueError("need one throughput per level, and at least one level")
    peak_i = max(range(len(levels)), key=lambda i: throughputs[i])
    for i in range(len(levels) - 1):
        if throughputs[i + 1] < throughputs[i] * (1.0 + min_gain):
            safe = max(1, math.floor(levels[i] * backoff))
            return Knee(levels[i], i, safe, levels[peak_i], throughputs[peak_i])
    return Knee(None, None, None, levels[peak_i], throughputs[peak_i])
