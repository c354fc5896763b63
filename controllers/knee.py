"""`knee`: learn the throughput-vs-concurrency curve from live traffic; hold just below its knee.

Per window (closed on a tick; at least `window` seconds and `min_samples` samples) it
records one point: (mean in-flight, output tokens/s, TTFT p90, TPOT p50). When the engine
publishes its counters (`EngineStats.generation_tokens_total`) the point is the *engine's*
(running + waiting, its tokens/s): instant, and shared by every gateway in front of it;
otherwise it is this gateway's own, with throughput by Little's law,
`inflight * sum(output_tokens) / sum(duration)`. Points are kept per concurrency level
(bins `bin_ratio` wide, averaged with weight `smoothing`, forgotten after `memory` s).

The knee, from the curve sorted by concurrency:
- decline: walking up, the curve ends at the first level whose throughput is `decline`
  under the best seen so far, or whose Kleinrock power (throughput / latency, latency =
  TTFT p90 + TPOT p50 x mean output tokens) is under `power_floor` x the best power so
  far. What lies beyond — the false second peak after a preemption storm, where
  per-request latency is already twice as bad — is never read.
- the 5% rule: the knee is the lowest level whose throughput is within `step_gain` of
  the best throughput on the kept curve (a step past it adds less than 5%).
- covariance: when the recent windows at the limit show throughput falling as in-flight
  rises (negative covariance), the limit steps down even before the curve says so.

    limit = min(headroom x knee, objective ceiling) x (own in-flight / curve in-flight)

The objective ceiling is the highest level measured below the lowest one whose TTFT
p90 or TPOT p50 broke its objective. The last factor is this gateway's share when the
curve is the engine's (1 otherwise), so several gateways together hold the engine at
`headroom x knee` without talking to each other.

Regions:
- low: app-limited (in-flight at the limit for less than `saturation` of the window):
  holds, but still learns points at the levels it sees.
- linear: no knee yet (the highest level measured is the knee): steps up by
  `probe_step` per window (a slow start), measuring as it goes.
- plateau: holds `headroom x knee`; every `probe_every` windows one window probes at
  `knee x (1 + probe_step)` — cheap, and the only way to see the knee move up.
- decline: a TTFT/TPOT breach, a drop, or engine distress (waiting not draining,
  preemptions rising) cuts the limit to `backoff x` in-flight at once and marks the
  level as over the objectives.

A level whose throughput moves by more than `change` from what the curve holds means the
engine changed (slower GPU, longer prompts): the rest of the curve is forgotten and
relearnt. Parameters and ranges are on `KneeConfig`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from pydantic import Field

from controllers.base import BaseControllerConfig, EngineStats, LimitController, Sample, is_distress
from controllers.window import Summary, Window

__all__ = ["Knee", "KneeConfig", "Point"]


class KneeConfig(BaseControllerConfig):
    headroom: float = Field(0.8, gt=0.1, le=1.0, description="limit = headroom x knee")
    step_gain: float = Field(0.05, ge=0.005, le=0.5, description="the 5% rule's gain")
    decline: float = Field(0.10, gt=0, lt=0.9, description="throughput drop that ends the curve")
    power_floor: float = Field(
        0.5, ge=0, lt=1, description="power under this x the best ends the curve"
    )
    probe_every: int = Field(4, ge=1, le=1000, description="windows between upward probes")
    probe_step: float = Field(0.15, gt=0, le=2, description="a probe goes this far above the knee")
    backoff: float = Field(0.9, ge=0.5, lt=1, description="cut on breach, drop or distress")
    change: float = Field(
        0.35, gt=0, lt=1, description="throughput shift at one level that resets the curve"
    )
    memory: float = Field(300.0, gt=0, le=86_400, description="seconds a curve point is kept")
    objective_memory: float = Field(
        30.0, gt=0, le=86_400, description="seconds a level stays marked as over the objectives"
    )
    bin_ratio: float = Field(0.05, gt=0, le=1, description="relative width of a level bin")
    smoothing: float = Field(0.5, gt=0, le=1, description="weight of a new window at its level")
    saturation: float = Field(
        0.5, gt=0, le=1, description="share of a window at the limit that means demand > limit"
    )
    window: float = Field(10.0, gt=0, le=600, description="minimum window length, seconds")
    min_samples: int = Field(8, ge=1, le=10_000, description="samples before a window closes")
    max_window: float = Field(30.0, gt=0, le=3600, description="a window closes by this age")


@dataclass(slots=True)
class Point:
    """The curve at one concurrency level."""

    concurrency: float
    throughput: float
    ttft_p90: float | None
    tpot_p50: float | None
    over_objective: bool
    at: float

    def as_dict(self) -> dict[str, Any]:
        return {
            "concurrency": round(self.concurrency, 2),
            "throughput": round(self.throughput, 2),
            "ttft_p90": self.ttft_p90,
            "tpot_p50": self.tpot_p50,
        }


def _blend(old: float | None, new: float | None, w: float) -> float | None:
    if old is None or new is None:
        return new if new is not None else old
    return old * (1 - w) + new * w


class Knee(LimitController):
    name = "knee"

    def __init__(self, cfg: KneeConfig | None = None) -> None:
        self.cfg: KneeConfig = cfg or KneeConfig()
        super().__init__(self.cfg)
        self._curve: dict[int, Point] = {}
        self._window: Window | None = None
        self._prev_stats: EngineStats | None = None
        self._since_probe = 0
        self._ref_tokens = 0.0
        self._engine_mode: bool | None = None
        self._last_cut = -math.inf
        self._cut_last = False

    # --- inputs -----------------------------------------------------------------------

    def _on_sample(self, s: Sample) -> None:
        # admitted before the last cut: it measures a level the limit already left
        if s.admitted_at >= self._last_cut:
            self._open(s.finished_at).add(s)

    def _on_engine_stats(self, stats: EngineStats) -> None:
        w = self._open(stats.at)
        if is_distress(self._prev_stats, stats):
            w.distress = True
        if not w.stats and self._prev_stats is not None:
            w.stats.append(self._prev_stats)  # counters need a baseline: span the whole window
        w.stats.append(stats)
        self._prev_stats = stats

    def _on_tick(self, now: float, inflight: int) -> None:
        w = self._open(now)
        w.tick(now, inflight, self.limit)
        c = self.cfg
        # engine counters measure throughput without waiting for requests to finish
        quorum = 1 if len(w.stats) >= 3 else c.min_samples
        if w.ready(now, c.window, quorum, c.max_window):
            self._window = None
            self._close(w.summary(now))

    def _open(self, now: float) -> Window:
        if self._window is None:
            self._window = Window(start=now, last_tick=now)
        return self._window

    # --- one closed window --------------------------------------------------------------

    def _close(self, w: Summary) -> None:
        bad = w.drops > 0 or w.distress or self._over_objective(w)
        if w.samples or w.engine_throughput is not None:
            self._learn(w, bad)
        # distress right after a cut is the engine still draining what the old limit admitted
        cut_again = bad and not (
            self._cut_last and w.distress and not w.drops and not self._over_objective(w)
        )
        self._cut_last = False
        if cut_again:
            self._cut_last = True
            # decrease needs no proof of load: cut below what was actually in flight
            self._set_limit(min(self._limit, max(w.inflight, 1.0)) * self.cfg.backoff)
            self._since_probe = 0
            self._last_cut = w.end
        elif not bad and w.saturated >= self.cfg.saturation:
            self._steer(w)
        # else app-limited: hold — there is no evidence the engine takes more

    def _over_objective(self, w: Summary) -> bool:
        c = self.cfg
        return (w.ttft_p90 is not None and w.ttft_p90 > c.ttft_objective) or (
            w.tpot_p50 is not None and w.tpot_p50 > c.tpot_objective
        )

    def _level(self, w: Summary) -> tuple[float, float]:
        """(concurrency, throughput) of the curve this window belongs to."""
        engine = w.engine_inflight is not None and w.engine_throughput is not None
        if self._engine_mode is not None and engine != self._engine_mode:
            self._curve.clear()  # engine and gateway points are different curves
        self._engine_mode = engine
        if engine:
            assert w.engine_inflight is not None and w.engine_throughput is not None
            return w.engine_inflight, w.engine_throughput
        return w.inflight, w.throughput

    def _learn(self, w: Summary, bad: bool) -> None:
        level, tput = self._level(w)
        if level <= 0:
            return
        a = self.cfg.smoothing
        self._ref_tokens = _blend(self._ref_tokens or None, w.output_tokens_mean, a) or 0.0
        self._forget(w.end)
        key = round(math.log(level) / math.log1p(self.cfg.bin_ratio))
        near = self._nearest(level)
        if near is not None and abs(tput - near.throughput) > self.cfg.change * near.throughput:
            self._curve.clear()  # the engine changed: the rest of the curve is stale
        old = self._curve.get(key)
        if old is None:
            self._curve[key] = Point(level, tput, w.ttft_p90, w.tpot_p50, bad, w.end)
            return
        old.concurrency = old.concurrency * (1 - a) + level * a
        old.throughput = old.throughput * (1 - a) + tput * a
        old.ttft_p90 = _blend(old.ttft_p90, w.ttft_p90, a)
        old.tpot_p50 = _blend(old.tpot_p50, w.tpot_p50, a)
        old.over_objective = bad
        old.at = w.end

    def _nearest(self, level: float) -> Point | None:
        """The stored point closest to `level`, if within two bins of it."""
        best = min(self._curve.values(), key=lambda p: abs(p.concurrency - level), default=None)
        if best is None or abs(best.concurrency - level) > 2 * self.cfg.bin_ratio * level:
            return None
        return best

    def _forget(self, now: float) -> None:
        for key in [k for k, p in self._curve.items() if now - p.at > self.cfg.memory]:
            del self._curve[key]
        for p in self._curve.values():
            if now - p.at > self.cfg.objective_memory:
                p.over_objective = False  # old news: let probes look again

    # --- the knee and the limit -----------------------------------------------------------

    def _steer(self, w: Summary) -> None:
        level, _ = self._level(w)
        share = w.inflight / level if level > 0 else 1.0
        knee, rising = self.knee()
        self.knee_estimate = knee
        step = 1 + self.cfg.probe_step
        ceiling = self.ceiling()
        if knee is None or rising:
            top = max((p.concurrency for p in self._curve.values()), default=level)
            target = min(max(top, level) * step, ceiling)  # still climbing: look higher
        elif self._since_probe + 1 >= self.cfg.probe_every and knee * step <= ceiling:
            target = knee * step  # one cheap window above the knee
            self._since_probe = -1
        else:
            target = min(self.cfg.headroom * knee, ceiling)
        self._since_probe += 1
        self._set_limit(max(1.0, target * share))

    def ceiling(self) -> float:
        """Highest level measured below the lowest level that broke an objective."""
        bad = [p.concurrency for p in self._curve.values() if p.over_objective]
        if not bad:
            return math.inf
        lowest_bad = min(bad)
        ok = [p.concurrency for p in self._curve.values() if p.concurrency < lowest_bad]
        return max(ok) if ok else lowest_bad * self.cfg.backoff

    def knee(self) -> tuple[float | None, bool]:
        """(knee level, still rising at the top); (None, True) with fewer than 2 points."""
        pts = sorted(self._curve.values(), key=lambda p: p.concurrency)
        if len(pts) < 2:
            return None, True
        kept = self._until_decline(pts)
        best = max(p.throughput for p in kept)
        i = next(i for i, p in enumerate(kept) if p.throughput * (1 + self.cfg.step_gain) >= best)
        rising = i == len(kept) - 1 and len(kept) == len(pts)
        return kept[i].concurrency, rising

    def _until_decline(self, pts: list[Point]) -> list[Point]:
        kept: list[Point] = []
        best_x = best_power = 0.0
        for p in pts:
            power = self._power(p)
            if p.throughput < best_x * (1 - self.cfg.decline):
                break  # past the decline; a second peak beyond is a false one
            if power < best_power * self.cfg.power_floor:
                break  # latency grew far faster than throughput
            kept.append(p)
            best_x = max(best_x, p.throughput)
            best_power = max(best_power, power)
        return kept

    def _power(self, p: Point) -> float:
        delay = (p.ttft_p90 or 0.0) + (p.tpot_p50 or 0.0) * max(self._ref_tokens, 1.0)
        return p.throughput / delay if delay > 0 else p.throughput

    def state(self) -> dict[str, Any]:
        pts = sorted(self._curve.values(), key=lambda p: p.concurrency)
        return {
            **super().state(),
            "curve": [p.as_dict() for p in pts],
            "curve_of": "engine" if self._engine_mode else "gateway",
        }
