"""`aimd`: additive increase while the objectives hold, multiplicative decrease on trouble.

The shape and defaults follow Netflix's AIMDLimit (backoff 0.9, +1 per sample,
app-limited when ``inflight * 2 < limit``). Per finished request:

    breach or drop or error  ->  limit = limit * backoff      (at most once per round)
    healthy, not app-limited ->  limit = limit + increase
    healthy, app-limited     ->  limit unchanged

A *breach* is a TTFT above `ttft_objective` or a time-per-output-token above
`tpot_objective` (never whole-request time: it grows with answer length). A *drop*
is a timeout or an engine 429/503; an upstream error counts too. Engine distress
(`EngineStats`: waiting requests not draining, or preemptions rising) is a decrease.

One decrease per round, as TCP does per RTT: requests admitted before the last
decrease were admitted under the old limit, so their breaches are old news and
cannot cut again. Distress cuts at most once per `distress_cooldown` seconds, longer
than the scrape lag, so the engine has time to show the cut.

Regions (reads `ttft`, `tpot`, `outcome`, `inflight_at_admit`, `admitted_at`):
- low: app-limited, holds.
- linear: objectives hold, climbs by `increase` per sample.
- plateau: climbs until TPOT or TTFT crosses its objective, then saws between
  `backoff * x` and `x`: it finds the *objective*, not the knee.
- decline: breaches and distress cut it every round until it is back under.

Parameters: `increase` (default 1.0, range (0, 100]); `backoff` (default 0.9, range
[0.5, 1.0)); `distress_cooldown` (default 2.0 s, range (0, 60]); and the shared
bounds and objectives of `BaseControllerConfig`.
"""

from __future__ import annotations

import math

from pydantic import Field

from kneegate.controllers.base import (
    BaseControllerConfig,
    EngineStats,
    LimitController,
    Outcome,
    Sample,
    is_distress,
)

__all__ = ["Aimd", "AimdConfig"]


class AimdConfig(BaseControllerConfig):
    increase: float = Field(
        1.0, gt=0, le=100, description="added to the limit per healthy, non-app-limited sample"
    )
    backoff: float = Field(
        0.9, ge=0.5, lt=1.0, description="multiplier applied on a breach, a drop or distress"
    )
    distress_cooldown: float = Field(
        2.0, gt=0, le=60, description="seconds between two distress-driven decreases"
    )


class Aimd(LimitController):
    name = "aimd"

    def __init__(self, cfg: AimdConfig | None = None) -> None:
        self.cfg: AimdConfig = cfg or AimdConfig()
        super().__init__(self.cfg)
        self._last_decrease = -math.inf
        self._prev_stats: EngineStats | None = None

    def _on_sample(self, s: Sample) -> None:
        if s.outcome is not Outcome.OK or self.breaches(s):
            # admitted under an older limit: that round was already cut
            if s.admitted_at >= self._last_decrease:
                self._decrease(s.finished_at)
            return
        if s.inflight_at_admit * 2 >= self.limit:
            self._set_limit(self._limit + self.cfg.increase)

    def _on_engine_stats(self, stats: EngineStats) -> None:
        distressed = is_distress(self._prev_stats, stats)
        self._prev_stats = stats
        if distressed and stats.at - self._last_decrease >= self.cfg.distress_cooldown:
            self._decrease(stats.at)

    def _decrease(self, now: float) -> None:
        self._set_limit(self._limit * self.cfg.backoff)
        self._last_decrease = now
