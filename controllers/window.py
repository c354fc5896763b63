"""Measurement windows for the windowed controllers (`gradient`, `knee`).

A window collects the samples that finished and the ticks seen since it opened,
and closes on a tick once it is both old enough and holds enough samples (or has
grown too old to wait any longer). Generations take seconds, so windows are
seconds long: a 1 s / 10-sample window would starve.

Its summary gives, per window: mean in-flight (time-weighted over ticks), output
tokens/s, TTFT p90, TPOT p50, how much of the window the gateway was saturated
(in-flight at the limit), drops, and engine distress. When the engine publishes
`generation_tokens_total`, the summary also carries the engine's own in-flight
(running + waiting) and tokens/s, which are instant and count every gateway; any scrape at
all gives the engine's mean running and KV-cache use over the window, the fewest requests
waiting in any scrape (a queue that never emptied), and the preemptions counted in it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kneegate.controllers.base import EngineStats, Outcome, Sample

__all__ = ["Summary", "Window", "quantile"]


def quantile(values: list[float], q: float) -> float | None:
    """Nearest-rank quantile; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


@dataclass(frozen=True, slots=True)
class Summary:
    """What one closed window measured."""

    start: float
    end: float
    samples: int
    inflight: float  # time-weighted mean in-flight at this gateway
    max_inflight: int
    saturated: float  # fraction of the window with in-flight at or above the limit
    throughput: float  # output tokens/s, Little's law: inflight * sum(tokens) / sum(duration)
    ttft_p90: float | None
    tpot_p50: float | None
    ttft_mean: float | None
    tpot_mean: float | None
    drops: int
    distress: bool
    output_tokens_mean: float = 0.0
    engine_inflight: float | None = None  # running + waiting, mean over scrapes
    engine_throughput: float | None = None  # generation tokens/s between first and last scrape
    engine_running: float | None = None  # mean over the window's scrapes
    engine_waiting: float | None = None  # fewest waiting in any of the window's scrapes
    engine_preempted: float | None = None  # preemptions between the first and last scrape
    engine_kv: float | None = None  # mean KV-cache use, 0..1

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(slots=True)
class Window:
    """An open window. `tick` advances it; `summary` closes it."""

    start: float
    last_tick: float
    area: float = 0.0
    saturated_time: float = 0.0
    max_inflight: int = 0
    drops: int = 0
    distress: bool = False
    samples: list[Sample] = field(default_factory=list)
    stats: list[EngineStats] = field(default_factory=list)

    def add(self, s: Sample) -> None:
        if s.outcome.is_drop:
            self.drops += 1
        if s.outcome is Outcome.OK:
            self.samples.append(s)

    def tick(self, now: float, inflight: int, limit: int) -> None:
        dt = max(0.0, now - self.last_tick)
        self.last_tick = max(self.last_tick, now)
        self.area += inflight * dt
        if inflight >= limit:
            self.saturated_time += dt
        self.max_inflight = max(self.max_inflight, inflight)

    def ready(self, now: float, min_age: float, min_samples: int, max_age: float) -> bool:
        age = now - self.start
        # trouble needs no quorum: a drop or distress closes the window on time
        enough = len(self.samples) >= min_samples or self.drops > 0 or self.distress
        return (age >= min_age and enough) or age >= max_age

    def summary(self, now: float) -> Summary:
        span = max(now - self.start, 1e-9)
        inflight = self.area / span
        ttfts = [s.ttft for s in self.samples if s.ttft is not None]
        tpots = [t for s in self.samples if (t := s.tpot) is not None]
        busy = sum(s.duration for s in self.samples)
        tokens = sum(s.output_tokens for s in self.samples)
        eng_inflight, eng_tput = self._engine()
        n = len(self.stats)
        return Summary(
            start=self.start,
            end=now,
            samples=len(self.samples),
            inflight=inflight,
            max_inflight=self.max_inflight,
            saturated=self.saturated_time / span,
            throughput=inflight * tokens / busy if busy > 0 else 0.0,
            ttft_p90=quantile(ttfts, 0.9),
            tpot_p50=quantile(tpots, 0.5),
            ttft_mean=sum(ttfts) / len(ttfts) if ttfts else None,
            tpot_mean=sum(tpots) / len(tpots) if tpots else None,
            drops=self.drops,
            distress=self.distress,
            output_tokens_mean=tokens / len(self.samples) if self.samples else 0.0,
            engine_inflight=eng_inflight,
            engine_throughput=eng_tput,
            engine_running=sum(s.running for s in self.stats) / n if n else None,
            engine_waiting=min(s.waiting for s in self.stats) if n else None,
            engine_preempted=self.stats[-1].preemptions_total - self.stats[0].preemptions_total
            if n
            else None,
            engine_kv=sum(s.kv_cache_usage for s in self.stats) / n if n else None,
        )

    def _engine(self) -> tuple[float | None, float | None]:
        st = self.stats
        if len(st) < 2 or math.isnan(st[0].generation_tokens_total):
            return None, None
        span = st[-1].at - st[0].at
        if span <= 0 or math.isnan(st[-1].generation_tokens_total):
            return None, None
        inflight = sum(s.running + s.waiting for s in st) / len(st)
        tput = (st[-1].generation_tokens_total - st[0].generation_tokens_total) / span
        return inflight, tput
