"""`gradient`: a port of Netflix's Gradient2Limit, with per-token latency and drops honoured.

Once per window (Netflix wraps Gradient2 in a WindowedLimit; here a window closes on a
tick, at least `window` seconds and `min_samples` samples long):

    short    = mean of the signal over the window
    long     = exponential average of `short` (`long_window` windows, `warmup` plain mean)
    if long / short > 2: long *= 0.95          # recover fast after a long overload
    gradient = clamp(tolerance * long / short, 0.5, 1.0)
    new      = limit * gradient + queue(limit) # queue = sqrt(limit), or `queue_size`
    limit    = limit * (1 - smoothing) + new * smoothing

Two known defects of the original are fixed:
- latency is per token: the gradient is computed for TTFT and for time per output
  token separately and the smaller one wins; whole-request time, which grows with the
  answer's length, is never used.
- drops and distress are honoured (the original ignores `didDrop`): a window with a
  timeout, an engine 429/503 or engine distress uses the floor gradient 0.5.

App-limited (max in-flight in the window < limit / 2, Netflix's rule): hold, but
still learn the long averages.

Regions: low — app-limited, holds. linear — latency flat, gradient 1, grows by about
`smoothing * queue` per window. plateau — TPOT rises with batch size, so the gradient
drops below 1 as soon as TPOT exceeds `tolerance` x its long average: the limit parks
near where latency starts to climb, often below the knee (the known weakness of
latency-gradient limiters on LLMs). decline — TTFT and TPOT climb, drops and distress
appear, the limit falls by up to half of `smoothing` per window.

Parameters: `smoothing` 0.2 (0, 1]; `tolerance` 1.5 [1, 10]; `long_window` 600
windows [1, 100000]; `warmup` 10 windows [0, 1000]; `queue_size` None (sqrt of the
limit) or a fixed number [0, 1000]; `window` 5 s, `min_samples` 10, `max_window` 30 s.
"""

from __future__ import annotations

import math

from pydantic import Field

from kneegate.controllers.base import BaseControllerConfig
from kneegate.controllers.window import Summary, Windowed

__all__ = ["ExpAverage", "Gradient", "GradientConfig"]


class GradientConfig(BaseControllerConfig):
    smoothing: float = Field(0.2, gt=0, le=1, description="weight of the new estimate per window")
    tolerance: float = Field(1.5, ge=1, le=10, description="latency growth tolerated (x long)")
    long_window: int = Field(600, ge=1, le=100_000, description="windows in the long average")
    warmup: int = Field(10, ge=0, le=1000, description="windows averaged plainly at first")
    queue_size: float | None = Field(
        None, ge=0, le=1000, description="growth allowance per window; None: sqrt(limit)"
    )
    window: float = Field(5.0, gt=0, le=600, description="minimum window length, seconds")
    min_samples: int = Field(10, ge=1, le=10_000, description="samples before a window closes")
    max_window: float = Field(30.0, gt=0, le=3600, description="a window closes by this age")


class ExpAverage:
    """Netflix's ExpAvgMeasurement: a plain mean for `warmup` values, then an EMA."""

    def __init__(self, window: int, warmup: int) -> None:
        self.factor = 2.0 / (window + 1)
        self.warmup = warmup
        self.count = 0
        self.value = 0.0

    def add(self, x: float) -> float:
        if self.count < self.warmup:
            self.count += 1
            self.value += (x - self.value) / self.count
        else:
            self.value = self.value * (1 - self.factor) + x * self.factor
        return self.value


class Gradient(Windowed):
    name = "gradient"

    def __init__(self, cfg: GradientConfig | None = None) -> None:
        self.cfg: GradientConfig = cfg or GradientConfig()
        super().__init__(self.cfg, self.cfg)
        self._long_ttft = ExpAverage(self.cfg.long_window, self.cfg.warmup)
        self._long_tpot = ExpAverage(self.cfg.long_window, self.cfg.warmup)
        self._last: dict[str, float | None] = {"ttft_long": None, "tpot_long": None}

    def _close(self, w: Summary) -> None:
        gradients = [
            self._gradient(self._long_ttft, w.ttft_mean, "ttft_long"),
            self._gradient(self._long_tpot, w.tpot_mean, "tpot_long"),
        ]
        known = [g for g in gradients if g is not None]
        limit = self._limit
        if w.drops or w.distress:
            gradient = 0.5  # the original ignores drops; an overloaded engine is not "no signal"
        elif not known or w.max_inflight < limit / 2:
            return  # no latency seen, or app-limited: hold
        else:
            gradient = min(known)
        queue = self.cfg.queue_size if self.cfg.queue_size is not None else math.sqrt(limit)
        new = limit * gradient + queue
        new = limit * (1 - self.cfg.smoothing) + new * self.cfg.smoothing
        if w.drops or w.distress:
            new = min(new, limit)  # a decrease signal never grows the limit
        self._set_limit(new)

    def _gradient(self, long_avg: ExpAverage, short: float | None, key: str) -> float | None:
        if short is None or short <= 0:
            return None
        long = long_avg.add(short)
        if long / short > 2:
            long_avg.value *= 0.95
        self._last[key] = long_avg.value
        return max(0.5, min(1.0, self.cfg.tolerance * long / short))

    def state(self) -> dict[str, object]:
        return {**super().state(), **self._last}
