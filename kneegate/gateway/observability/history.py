"""The last ten minutes at one point a second, for the live page (`GET /kneegate/history`).

    History(upstreams, depths, metrics)   # Gateway builds it; its own task calls sample()
    history.view(now, since)              # {"interval", "size", "now", "points": [...]}

Sampled by a task of the gateway's (`Gateway.start`), never from the request path: each
point reads what /metrics reads at a scrape, the live state (limit, in-flight, knee
estimate, the engine's fresh figures, queue depth by class) and the counters, as
differences from the point before:

- `rejected`: requests refused per second, by reason: the `shed` reasons (queue_full,
  over_objective, no_upstream, shutting_down, client_gone) and queue_timeout, summed over
  classes;
- `ttft`: the user's time to first token (from arrival) by class, p50 and p99 read from the
  buckets of kneegate_request_ttft_seconds filled over the last `ttft_span` seconds (one
  second holds too few answers at low load), interpolated within a bucket as Prometheus'
  histogram_quantile does; absent for a class with no answer in that span.

One point is a few hundred bytes; the ring holds `size` of them (600: ten minutes), so its
memory is bounded whatever the traffic. Times are the gateway's clock (monotonic seconds):
the page plots them against `now`. With `--workers N` each worker keeps its own history,
and the page shows the worker that answered.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import Counter, Histogram

from kneegate.gateway.observability.gauges import LiveUpstream
from kneegate.gateway.observability.metrics import GatewayMetrics

__all__ = ["History", "quantile"]

Point = dict[str, Any]
Buckets = dict[str, list[tuple[float, float]]]  # class -> [(upper bound, cumulative count)]


def quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """The q-quantile of a cumulative histogram [(upper bound, count), ...] ending at +Inf;
    None when it is empty. Linear within the bucket; the +Inf bucket reads as the highest
    finite bound (Prometheus' histogram_quantile)."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower
            inside = count - below
            return lower + (bound - lower) * ((rank - below) / inside if inside else 1.0)
        lower, below = bound, count
    return lower


def _sum_by(metric: Counter, label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in metric.collect():
        for s in family.samples:
            if s.name.endswith("_total"):
                key = s.labels[label]
                out[key] = out.get(key, 0.0) + s.value
    return out


def _buckets(metric: Histogram) -> Buckets:
    out: Buckets = {}
    for family in metric.collect():
        for s in family.samples:
            if s.name.endswith("_bucket"):
                out.setdefault(s.labels["class"], []).append((float(s.labels["le"]), s.value))
    return out


def _minus(now: Buckets, then: Buckets) -> Buckets:
    out: Buckets = {}
    for cls, bs in now.items():
        old = dict(then.get(cls, []))
        out[cls] = [(bound, count - old.get(bound, 0.0)) for bound, count in bs]
    return out


class History:
    """A bounded ring of points; `sample(now)` adds one."""

    def __init__(
        self,
        upstreams: Callable[[], Iterable[LiveUpstream]],
        depths: Callable[[], Iterable[tuple[str, int]]],
        metrics: GatewayMetrics,
        *,
        size: int = 600,
        interval: float = 1.0,
        ttft_span: float = 5.0,
    ) -> None:
        self._upstreams, self._depths, self._metrics = upstreams, depths, metrics
        self.size, self.interval = size, interval
        self.points: deque[Point] = deque(maxlen=size)
        self._prev: tuple[float, dict[str, float]] | None = None  # (when, rejected counts)
        # (when, TTFT buckets): enough past readings to reach `ttft_span` back
        self._ttft: deque[tuple[float, Buckets]] = deque(
            maxlen=max(2, math.ceil(ttft_span / interval) + 1))

    def sample(self, now: float) -> Point:
        """Read the gateway now and keep the point (the oldest one goes past `size`)."""
        point: Point = {
            "t": round(now, 3),
            "upstreams": {u.name: _upstream(u, now) for u in self._upstreams()},
            "queue": dict(self._depths()),
            "rejected": self._rejected(now),
            "ttft": self._user_ttft(now),
        }
        self.points.append(point)
        return point

    def view(self, now: float, since: float | None = None) -> dict[str, Any]:
        """What /kneegate/history answers: the points after `since` (all when None)."""
        pts = list(self.points)
        if since is not None:
            pts = [p for p in pts if p["t"] > since]
        return {"interval": self.interval, "size": self.size, "now": round(now, 3),
                "points": pts}

    def _rejected(self, now: float) -> dict[str, float]:
        m = self._metrics
        counts = _sum_by(m.shed, "reason")
        counts["queue_timeout"] = sum(_sum_by(m.queue_timeout, "class").values())
        prev, self._prev = self._prev, (now, counts)
        if prev is None or now <= prev[0]:
            return {}
        dt = now - prev[0]
        return {r: round((n - prev[1].get(r, 0.0)) / dt, 3) for r, n in counts.items()}

    def _user_ttft(self, now: float) -> dict[str, dict[str, float | None]]:
        current = _buckets(self._metrics.user_ttft)
        self._ttft.append((now, current))
        _, oldest = self._ttft[0]
        out = {}
        for cls, bs in _minus(current, oldest).items():
            if bs and bs[-1][1] > 0:
                out[cls] = {"p50": _round(quantile(0.5, bs)), "p99": _round(quantile(0.99, bs)),
                            "n": bs[-1][1]}
        return out


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def _upstream(u: LiveUpstream, now: float) -> dict[str, Any]:
    knee = u.knee_estimate
    out: dict[str, Any] = {
        "limit": u.limit,
        "in_flight": u.inflight - u.handing,  # as kneegate_in_flight
        "knee": None if knee is None else round(knee, 2),
        "running": None, "waiting": None, "kv": None,
    }
    t = u.telemetry(now)
    if t is not None and t.stats is not None and not t.stale:  # only fresh figures, as /metrics
        kv = t.stats.kv_cache_usage
        out.update(running=t.stats.running, waiting=t.stats.waiting,
                   kv=None if math.isnan(kv) else round(kv, 4))
    return out
