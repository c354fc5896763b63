"""Judging a run by the user's clock: each request's TTFT from its arrival, and goodput,
the output tokens/s of requests that met their class's objectives.
"""

from __future__ import annotations

import itertools
import math

from kneegate.sim.loop import Result, _Req
from kneegate.sim.scenarios import Scenario

__all__ = ["engine_ttft", "goodput", "goodput_series", "user_ttft"]


def _objectives(sc: Scenario) -> dict[str, tuple[float, float]]:
    return {c.name: (c.ttft or sc.ttft, c.tpot or sc.tpot) for c in sc.classes}


def user_ttft(r: _Req) -> float:
    """TTFT as the user sees it: from arrival at the gateway, its queue's wait included."""
    return r.first - r.arrived


def engine_ttft(r: _Req) -> float:
    """TTFT as the engine (and the controller) sees it: from dispatch."""
    return r.first - r.dispatched


def _good(sc: Scenario, r: _Req, obj: dict[str, tuple[float, float]]) -> bool:
    if r.fate != "done":
        return False
    ttft, tpot = obj[r.cls]
    per_token = (r.done - r.first) / (r.tokens - 1) if r.tokens > 1 else 0.0
    return user_ttft(r) <= ttft and per_token <= tpot


def goodput(res: Result, sc: Scenario, start: float, end: float,
            tenant: str | None = None) -> float:
    """Tokens/s emitted in [start, end) by requests that met their objectives (spread evenly);
    `tenant`: that tenant's requests only."""
    obj, tokens = _objectives(sc), 0.0
    for r in res.requests:
        if not _good(sc, r, obj) or (tenant is not None and r.tenant != tenant):
            continue
        span = max(r.done - r.first, 1e-9)
        overlap = max(0.0, min(end, r.done) - max(start, r.first))
        tokens += r.tokens * overlap / span
    return tokens / max(end - start, 1e-9)


def goodput_series(res: Result, sc: Scenario, step: float = 1.0) -> list[float]:
    n = math.ceil(sc.duration / step)
    bins = [0.0] * n
    obj = _objectives(sc)
    for r in res.requests:
        if not _good(sc, r, obj):
            continue
        rate = r.tokens / max(r.done - r.first, 1e-9)
        t = r.first
        while t < r.done:
            b = int(t // step)
            if b >= n:
                break
            nxt = min(r.done, (b + 1) * step)
            bins[b] += rate * (nxt - t)
            t = nxt
    return [x / step for x in bins]


def _segments(sc: Scenario) -> list[tuple[float, float]]:
    cuts = [0.0, *sc.changes, sc.duration]
    return [(max(a, sc.warmup if a == 0 else a), b) for a, b in itertools.pairwise(cuts)]

