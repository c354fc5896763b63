"""One level of the throughput curve (`Point`), how a window's reading is blended into it
(`blend`: the weighted mean the room and the KV edge use too), and what two levels say of
each other (`gain`, `under`). Pure: no clock, no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = ["Point", "blend", "gain", "under"]


@dataclass(slots=True)
class Point:
    """The curve at one concurrency level."""

    concurrency: float
    throughput: float
    ttft_p90: float | None
    tpot_p50: float | None
    over_objective: bool
    at: float
    steady: bool = False  # in-flight held level in the window, not a draining burst
    scrape: bool = False  # one scrape just after a rise (`signals.climbed`), no window's mean
    windows: int = 1  # windows averaged into it (a point read once may be one lucky window)
    var: float = 1.0  # variance of its ln(throughput), in one window's (blending shrinks it)

    def as_dict(self) -> dict[str, Any]:
        return {
            "concurrency": round(self.concurrency, 2),
            "throughput": round(self.throughput, 2),
            "ttft_p90": self.ttft_p90,
            "tpot_p50": self.tpot_p50,
        }


def blend(old: float | None, new: float | None, w: float) -> float | None:
    """`old` moved towards `new` by weight `w`; either one alone when the other is None."""
    if old is None or new is None:
        return new if new is not None else old
    return old * (1 - w) + new * w


def gain(p: Point, q: Point) -> float:
    """Elasticity d ln tput / d ln c between two levels of the curve."""
    return math.log(q.throughput / p.throughput) / math.log(q.concurrency / p.concurrency)


def under(pts: list[Point], p: Point, pair: float) -> list[Point]:
    """p and the points of `pts` within `pair` under its level: a verdict read from p must
    hold from each of them, so that one lucky window at p is no verdict."""
    return [r for r in pts if p.concurrency / pair < r.concurrency <= p.concurrency]
