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
waiting in any scrape (a queue that never emptied), and the preemptions counted in it;
and the in-flight at its first scrape and at its last, with the tokens/s since the one
before (a level read past a rise's prefills).

`Windowed` is the template both use: a window opens on the first sample, scrape or tick
after the last one closed; every tick advances it and, once `ready` (the quorum is
`min_samples`, or what `_quorum` says), closes it into `_close(summary)`. Engine distress
(`is_distress` between consecutive scrapes) marks the open window; with `keeps_scrapes`
the window also keeps the scrapes, led by the one before it as the counters' baseline.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

from kneegate.controllers.base import (
    BaseControllerConfig,
    EngineStats,
    LimitController,
    Outcome,
    Sample,
    is_distress,
)

__all__ = ["LAST_SPAN", "Summary", "Window", "WindowSettings", "Windowed", "quantile"]

# seconds the last reading spans at least: one scrape interval at the default 1 s (the
# scrapes' times jitter by a step), three at 0.25 s, whose tokens/s swing with each batch
LAST_SPAN = 0.75


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
    engine_last: tuple[float, float] | None = None  # the last scrape's in-flight, its tokens/s
    engine_first: float | None = None  # running + waiting at the window's first scrape
    busy: float | None = None  # fraction of the window with any request in flight (None: all)
    engine_itl: float | None = None  # the engine's mean gap between tokens, first and last scrape

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def busy_inflight(self) -> float:
        """Mean in-flight over the time any request was in flight: the level a window of
        bursts held while it held any (its mean over the gaps between them is no level)."""
        return self.inflight / self.busy if self.busy else self.inflight

    @property
    def engine_tpot(self) -> float | None:
        """The engine's time per output token: its mean gap between a request's successive
        tokens where the engine reports it (vLLM's inter_token_latency_seconds: a prefill's
        wait is in it where it held up decodes, a request's own prefill never is); else its
        mean running count over its generated tokens/s, which counts requests still
        prefilling as decodes that made nothing, so it reads high at a ramp, a burst's start,
        or beside a long prompt. None: no scrapes to read, or nothing generated."""
        if self.engine_itl is not None:
            return self.engine_itl
        if self.engine_running is None or not self.engine_throughput:
            return None
        return self.engine_running / self.engine_throughput


@dataclass(slots=True)
class Window:
    """An open window. `tick` advances it; `summary` closes it."""

    start: float
    last_tick: float
    area: float = 0.0
    saturated_time: float = 0.0
    busy_time: float = 0.0
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
        if inflight > 0:
            self.busy_time += dt
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
            engine_last=self._last(),
            engine_first=self._first_own(),
            busy=self.busy_time / span,
            engine_itl=self._itl(),
        )

    def _first_own(self) -> float | None:
        """Running + waiting at the first scrape after the counters' baseline."""
        if not self.stats:
            return None
        s = self.stats[1] if len(self.stats) > 1 else self.stats[0]
        return s.running + s.waiting

    def _last(self) -> tuple[float, float] | None:
        """The last scrape's running + waiting, and tokens/s since the last scrape at least
        `LAST_SPAN` before it (the one before it at the default 1 s interval)."""
        if len(self.stats) < 2:
            return None
        b = self.stats[-1]
        a = next((s for s in reversed(self.stats[:-1]) if s.at <= b.at - LAST_SPAN),
                 self.stats[0])
        tokens = b.generation_tokens_total - a.generation_tokens_total
        if b.at <= a.at or math.isnan(tokens):
            return None
        return b.running + b.waiting, tokens / (b.at - a.at)

    def _itl(self) -> float | None:
        """The engine's mean gap between tokens from its first scrape to its last: the rise
        of its inter-token latency sum over the rise of its count. None: not exposed, or no
        gap in between."""
        if len(self.stats) < 2:
            return None
        a, b = self.stats[0], self.stats[-1]
        gaps = b.itl_count - a.itl_count
        if not gaps > 0:  # NaN (not exposed) or none
            return None
        return (b.itl_sum - a.itl_sum) / gaps

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


class WindowSettings(Protocol):
    """The window lengths a windowed controller's config carries."""

    @property
    def window(self) -> float: ...  # minimum window length, seconds

    @property
    def min_samples(self) -> int: ...  # samples before a window closes

    @property
    def max_window(self) -> float: ...  # a window closes by this age


class Windowed(LimitController):
    """Template for a controller that decides once per closed window (`_close`)."""

    keeps_scrapes: ClassVar[bool] = False  # the window keeps the engine's scrapes

    def __init__(self, cfg: BaseControllerConfig, spans: WindowSettings) -> None:
        super().__init__(cfg)
        self._spans = spans
        self._window: Window | None = None
        self._prev_stats: EngineStats | None = None

    def _open(self, now: float) -> Window:
        if self._window is None:
            self._window = Window(start=now, last_tick=now)
        return self._window

    def _on_sample(self, s: Sample) -> None:
        self._open(s.finished_at).add(s)

    def _on_engine_stats(self, stats: EngineStats) -> None:
        if self.keeps_scrapes:
            w = self._open(stats.at)
            if not w.stats and self._prev_stats is not None:
                w.stats.append(self._prev_stats)  # counters need a baseline: span the window
            w.stats.append(stats)
        if is_distress(self._prev_stats, stats):
            self._open(stats.at).distress = True
        self._prev_stats = stats

    def _on_tick(self, now: float, inflight: int) -> None:
        w = self._open(now)
        w.tick(now, inflight, self.limit)
        s = self._spans
        if w.ready(now, s.window, self._quorum(w), s.max_window):
            self._window = None
            self._close(w.summary(now))

    def _quorum(self, w: Window) -> int:
        """Samples the open window needs before it may close at `window` seconds."""
        return self._spans.min_samples

    def _close(self, w: Summary) -> None:
        """Decide on one closed window."""
