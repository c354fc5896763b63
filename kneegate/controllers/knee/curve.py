"""The throughput-vs-concurrency curve, learnt: a point per level from each closed window.
What the points say (the knee, the ceiling) is `Shape`'s (shape.py), which `Curve` is built
on. Pure: no clock, no I/O.

A closed window gives one point (level c, throughput, TTFT p90, TPOT p50): the engine's
(running + waiting, its tokens/s) when it publishes its counters, else this gateway's
(mean in-flight, Little's law); the two are different curves, and a switch clears it.
Points are kept per level bin (`bin_ratio` wide, log scale), averaged with weight
`smoothing`, forgotten after `memory` s; a breach mark (`over_objective`) fades after
`objective_memory` s, and so does the level the curve declined at when one window read it
(`Curve._fade_decline`). A level whose throughput moved by more than `change` from the
nearest point says the engine changed: every point goes but the breached ones. A point
read by one scrape just after a rise (`signals.climbed`) is an upper bound of its level: a
window's mean within `pair` of it measures the level, and the scrape's reading goes.

Each re-reading of a level (`_reread`) is one measure of how far one window's throughput
wanders: the noise the curve's verdicts must clear (`noise`, shape.py).
"""

from __future__ import annotations

import math
import statistics
from collections import deque

from kneegate.controllers.knee.config import KneeConfig
from kneegate.controllers.knee.point import Point, blend
from kneegate.controllers.knee.shape import Shape
from kneegate.controllers.window import Summary

__all__ = ["Curve"]

NOISE_KEEP = 20  # re-readings of a level that measure the noise (the last ones, `_reread`)


class Curve(Shape):
    """The points learnt from windows, by level bin (what they say: `Shape`)."""

    def __init__(self, cfg: KneeConfig) -> None:
        super().__init__(cfg)
        self.engine_mode: bool | None = None  # points are the engine's, not this gateway's
        # re-readings of a level (`_reread`), one window's variance each
        self._repeats: deque[float] = deque(maxlen=NOISE_KEEP)

    # --- learning -------------------------------------------------------------------------

    def level(self, w: Summary) -> tuple[float, float]:
        """(concurrency, throughput) of the curve this window belongs to."""
        engine = w.engine_inflight is not None and w.engine_throughput is not None
        if self.engine_mode is not None and engine != self.engine_mode:
            self.points.clear()  # engine and gateway points are different curves
        self.engine_mode = engine
        if engine:
            assert w.engine_inflight is not None and w.engine_throughput is not None
            return w.engine_inflight, w.engine_throughput
        return w.inflight, w.throughput

    def learn(self, w: Summary, level: float, bad: bool, scrape: bool = False) -> None:
        """Average the window into the point at its level (`bad`: it broke an objective;
        `scrape`: the window is one scrape read just after a rise, `signals.climbed`)."""
        tput = w.engine_throughput if self.engine_mode else w.throughput
        if level <= 0 or tput is None:
            return
        a = self.cfg.smoothing
        if w.samples:  # a window closed on the engine's counters alone has no answers
            self.ref_tokens = blend(self.ref_tokens or None, w.output_tokens_mean, a) or 0.0
        self._forget(w.end)
        # a level, not a ramp: in-flight stayed near its peak through the window
        steady = w.inflight >= 0.8 * w.max_inflight
        # and on the engine's curve the engine's level (its scrapes, seconds behind) reached
        # it too: else a burst's first window reads its prefills as a 'decline' that ends
        # the curve (docs/design/knee.md, "Details moved from the docstrings")
        if self.engine_mode:
            steady = steady and level >= 0.8 * w.max_inflight
        if not scrape:
            self._supersede(level)
        key = round(math.log(level) / math.log1p(self.cfg.bin_ratio))
        near = self.nearest(level)
        changed = (near is not None
                   and abs(tput - near.throughput) > self.cfg.change * near.throughput)
        if changed:
            self._forget_change()  # the engine changed since `near` was measured
        old = self.points.get(key)
        if old is None:
            if near is not None and not (changed or scrape or near.scrape):
                self._reread(near, level, tput)
            self.points[key] = Point(
                level, tput, w.ttft_p90, w.tpot_p50, bad, w.end, steady, scrape
            )
            return
        if not (changed or scrape or old.scrape):
            self._reread(old, level, tput)
        old.var = (1 - a) ** 2 * old.var + a * a
        old.concurrency = old.concurrency * (1 - a) + level * a
        old.throughput = old.throughput * (1 - a) + tput * a
        old.windows += 1
        old.ttft_p90 = blend(old.ttft_p90, w.ttft_p90, a)
        old.tpot_p50 = blend(old.tpot_p50, w.tpot_p50, a)
        if bad or w.samples:  # no request finished, no latency read: no news on objectives
            old.over_objective = bad
        old.at = w.end
        old.steady = steady

    def _reread(self, p: Point, level: float, tput: float) -> None:
        """A window at `level` read `tput` near point p (in its bin, or new within two bins of
        it, `nearest`): how far it lies from p, less what the fitted curve's slope (`elasticity`)
        accounts for between their levels, is one reading of the noise (`noise`): that
        residual of ln(tput) squared over (1 + p.var), one window's variance.

        Not only p's own bin: a limit held under a knee wanders over neighbouring bins, and
        each of its windows was otherwise a first reading that measured nothing.
        Measured: docs/design/knee.md, "The curve" (Neighbours measure the noise)."""
        if tput <= 0 or p.throughput <= 0:
            return
        r = math.log(tput / p.throughput) - self.elasticity(level) * math.log(level / p.concurrency)
        self._repeats.append(r * r / (1 + p.var))
        self._noise = statistics.fmean(self._repeats)

    def _supersede(self, level: float) -> None:
        """A window's mean within `pair` of a level read by one scrape just after a rise
        measures that level: the scrape's reading goes. It read the engine decoding all it
        held, no answer ending and no newcomer's prefill in it (on vLLM's CPU build far
        above a direct sweep at that level), and the limit's windows fall a bin or two under
        it, so blending never reached the point for its `memory`; here the first of them
        measures it. Measured: docs/design/knee.md, "Regions" (Linear)."""
        pair = self.cfg.pair
        for key, p in list(self.points.items()):
            if p.scrape and level / pair < p.concurrency < level * pair:
                del self.points[key]

    def clear(self) -> None:
        self.points.clear()

    def _forget_change(self) -> None:
        """The engine changed: the throughput curve is stale, but no breach of the objectives
        goes with it (those fade after `objective_memory`, or a clean window at the level
        lifts them); see docs/design/knee.md for what dropping them did."""
        for key, p in list(self.points.items()):
            if not p.over_objective:
                del self.points[key]

    def _forget(self, now: float) -> None:
        for key in [k for k, p in self.points.items() if now - p.at > self.cfg.memory]:
            del self.points[key]
        for p in self.points.values():
            if now - p.at > self.cfg.objective_memory:
                p.over_objective = False  # old news: let probes look again
        self._fade_decline(now)

    def _fade_decline(self, now: float) -> None:
        """The level the curve declined at, read by one window, fades after
        `objective_memory` as a breach mark does: the limit, held under it, never reads it
        again, and one window in a slow spell is no verdict for `memory` (300 s).
        Measured: docs/design/knee.md, "The curve"."""
        walked = self._walked()
        kept = self._until_decline(walked)
        if len(walked) <= len(kept):
            return
        past = walked[len(kept)]  # the first level past the kept ones: it declined
        if past.windows == 1 and now - past.at > self.cfg.objective_memory:
            for key in [k for k, p in self.points.items() if p is past]:
                del self.points[key]
