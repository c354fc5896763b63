"""A run against its oracle: one table row (`judge`), and the settle time after a change.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from kneegate.sim.goodput import (
    _segments,
    engine_ttft,
    goodput,
    goodput_series,
    user_ttft,
)
from kneegate.sim.loop import Result
from kneegate.sim.oracle import Oracle
from kneegate.sim.scenarios import Scenario

__all__ = ["Row", "judge", "settle_time"]


def settle_time(res: Result, orc: Oracle, sc: Scenario) -> float | None:
    """Worst, over the changes, of the time until goodput stays within 10% of the new oracle.

    Both series are 10 s moving averages of goodput, compared second by second until the
    segment ends; 'within' means at least 0.9 x the switching oracle's (`_switching`: the best
    fixed limit for the new segment, entered from the previous segment's best). None when the
    scenario has no change; inf if it never does.
    """
    if not sc.changes:
        return None
    mine = _smooth(goodput_series(res, sc))
    worst = 0.0
    for (a, b), best in zip(_segments(sc)[1:], orc.segment_runs[1:], strict=True):
        ref = _smooth(goodput_series(best, sc))
        settled, end = math.inf, int(b) - 5  # the last 5 s of a segment see the next change
        for t in range(int(a), end):
            if all(mine[u] >= 0.9 * ref[u] for u in range(t, end)):
                settled = t - a
                break
        worst = max(worst, settled)
    return worst


def _smooth(xs: list[float], k: int = 10) -> list[float]:
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x - (xs[i - k] if i >= k else 0.0)
        out.append(acc / min(i + 1, k))
    # centre the window so a step is not reported late by half its width
    return out[k // 2 :] + [out[-1]] * (k // 2)


@dataclass
class Row:
    scenario: str
    controller: str
    ratio: float
    ttft_p50: float  # from arrival, as the user sees it
    ttft_p99: float
    engine_ttft_p99: float  # from dispatch, as the engine and the controller see it
    shed: float
    timeout: float
    settle: float | None
    oscillation: float
    mean_inflight: float


def judge(res: Result, orc: Oracle, sc: Scenario) -> Row:
    reqs = res.requests
    n = max(1, len(reqs))
    served = [r for r in reqs if r.fate == "done" and r.arrived >= sc.warmup]
    ttfts = sorted(user_ttft(r) for r in served)
    steady = [x for t, x in zip(res.times, res.limits, strict=True) if t >= sc.warmup]
    inflight = [x for t, x in zip(res.times, res.inflight, strict=True) if t >= sc.warmup]
    mean = statistics.fmean(steady) if steady else 0.0
    return Row(
        scenario=sc.name,
        controller=res.controller,
        ratio=goodput(res, sc, sc.warmup, sc.duration) / max(orc.goodput, 1e-9),
        ttft_p50=_q(ttfts, 0.5),
        ttft_p99=_q(ttfts, 0.99),
        engine_ttft_p99=_q(sorted(engine_ttft(r) for r in served), 0.99),
        shed=sum(r.fate == "shed" for r in reqs) / n,
        timeout=sum(r.fate == "timeout" for r in reqs) / n,
        settle=settle_time(res, orc, sc),
        oscillation=statistics.pstdev(steady) / mean if mean > 0 else 0.0,
        mean_inflight=statistics.fmean(inflight) if inflight else 0.0,
    )


def _q(xs: list[float], q: float) -> float:
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else math.nan

