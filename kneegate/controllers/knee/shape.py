"""What the throughput curve's points say: its knee, and the objective ceiling. Pure: no
clock, no I/O. The points are learnt from windows by `Curve` (curve.py), built on this.

Only steady levels count (in-flight held >= 0.8 x its peak in the window and, on the
engine's curve, the engine's level too). Walking up
them, the curve is *kept* until the first level whose throughput is `decline` under the
best so far, or whose Kleinrock power (tput / (TTFT p90 + TPOT p50 x mean answer)) is under
`power_floor` x the best while its step up from the best's level did not pay; each from
the best's level and from every kept level within `pair` under it. The best is taken among
the levels read within `objective_memory` of the curve's latest window. The knee
is the lowest of:

    fit:     tput = a c / (1 + c/k), least squares on c / tput = 1/a + c/(a k)
             (a slope within 3 standard errors of 0 is no bend);
             knee where the elasticity 1 / (1 + c/k) = e_min, no lower than the
             lowest kept level; the highest kept level where the fit's knee lies
             within 2 standard errors under it (`fit.fit_knee`)
    plateau: the lowest kept level from which every step up of >= 1.5x (`SPAN`; and
             from each level within `pair` under it) has ln(t'/t) / ln(c'/c) < e_min;
             not from a level read by one scrape just after a rise (`signals.climbed`)
    top:     the last kept level, when the curve declined past it (the geometric
             middle of it and the declining level when they are over a climb step apart)

    e_min = ln(1 + step_gain) / ln 1.2   (a 20% step that adds `step_gain`)

A step "does not pay" (the plateau's steps, the power's decline) only where its gain is
under e_min by one standard error of the noise the curve measured (`Curve.noise`): each
re-reading of a level (a window in its bin, or in a new bin within two of a point, less
what the fitted curve's slope accounts for between them: `Curve._reread`) says how far
one window's throughput wanders, and each point's variance shrinks with the windows
blended into it (`Point.var`). Before any re-reading, and where re-readings agree, the
gain alone decides.

`ceiling()` is the highest level measured below the lowest one marked over the
objectives, where it lies within two climb steps of that one (`backoff` x that one when
none does).
"""

from __future__ import annotations

import math
from typing import Any

from kneegate.controllers.knee.config import KneeConfig
from kneegate.controllers.knee.fit import SPAN, fit, fit_knee
from kneegate.controllers.knee.point import Point, gain, under

__all__ = ["Shape"]


class Shape:
    """The curve's points, by level bin, and what they say (`Curve` learns them)."""

    def __init__(self, cfg: KneeConfig) -> None:
        self.cfg = cfg
        self.points: dict[int, Point] = {}
        self.ref_tokens = 0.0  # mean answer length, in power's delay
        # one window's variance of ln(throughput) at one level: the mean of the curve's
        # re-readings (`Curve._reread`), kept as they come: the verdicts read it often
        self._noise = 0.0

    # --- reading --------------------------------------------------------------------------

    def nearest(self, level: float) -> Point | None:
        """The stored point closest to `level`, if within two bins of it."""
        best = min(self.points.values(), key=lambda p: abs(p.concurrency - level), default=None)
        if best is None or abs(best.concurrency - level) > 2 * self.cfg.bin_ratio * level:
            return None
        return best

    def top(self) -> float:
        """The highest level measured (the initial limit before any)."""
        return max((p.concurrency for p in self.points.values()), default=self.cfg.initial)

    def highest(self) -> Point | None:
        """The point at the highest level measured; None before any."""
        return max(self.points.values(), key=lambda p: p.concurrency, default=None)

    def ceiling(self) -> float:
        """Highest level measured below the lowest level that broke an objective, where
        that is within two climb steps of it; else (no such level) `backoff` x that one.

        Why the gap: the climb measures every level on its way up, one step past the
        highest measured, so a breach lies within a step or two of a good level. A good
        level further under it was not measured on the way there: the mean of windows in
        which bursts left the engine idle between them, or one from before a slow start's
        doublings. It says nothing of the levels between, and as the ceiling it took one
        breach to a limit of 1. Measured: docs/experiments/2026-12-07-ceiling-gap.md."""
        bad = [p.concurrency for p in self.points.values() if p.over_objective]
        if not bad:
            return math.inf
        lowest_bad = min(bad)
        ok = [p.concurrency for p in self.points.values() if p.concurrency < lowest_bad]
        gap = (1 + self.cfg.climb) ** 2  # two climb steps
        if ok and lowest_bad <= gap * max(ok):
            return max(ok)
        return lowest_bad * self.cfg.backoff

    def knee(self) -> tuple[float | None, bool]:
        """(knee level of the throughput curve, still rising at the top); None: none seen yet."""
        kept, declined = self.kept()
        top = self._top(kept) if kept and declined else math.inf
        a, b, var = fit(kept)
        knee = min(top, self._flat(kept))
        if b > 0 and a > 0:
            # a fit whose knee lies under every level measured says they are all on the
            # plateau, not where it starts: no lower than the lowest of them
            knee = min(fit_knee(kept, a, b, var, self.e_min()), knee)
        if not math.isfinite(knee):
            return None, True
        return knee, not declined and knee >= kept[-1].concurrency

    def _top(self, kept: list[Point]) -> float:
        """The highest the knee may be when the curve declined past the last level kept:
        that level, or, when the decline was read more than a climb step above it, the
        geometric middle of the two. The knee lies somewhere in such a gap, not at its
        foot: probes go one step past the knee, so nothing measures the declining level again
        for the point's `memory` (300 s), and a decline read from a window of prefills held
        the limit far under the knee on vLLM's CPU build. Bounded at the middle, the limit
        measures it, and each window halves the gap (by its logarithm) until the levels are
        a climb step apart. Measured: docs/design/knee.md, "The curve" (Where the curve
        ends)."""
        foot = kept[-1].concurrency
        past = [p.concurrency for p in self.points.values() if p.steady and p.concurrency > foot]
        if not past or min(past) <= foot * (1 + self.cfg.climb):
            return foot
        return math.sqrt(foot * min(past))

    def noise(self) -> float:
        """One window's variance of ln(throughput) at one level, as the curve measured it:
        the mean of its last `NOISE_KEEP` re-readings of a level (`_reread`); 0 before any."""
        return self._noise

    def _unpaid(self, p: Point, q: Point) -> bool:
        """The step from p up to q did not pay: its gain is under e_min by one standard
        error of the measured noise (the two points' variances, over the step's span): one
        lucky window is no verdict. Measured: docs/design/knee.md, "The curve" (Verdicts
        that clear the noise)."""
        span = math.log(q.concurrency / p.concurrency)
        se = math.sqrt(self.noise() * (p.var + q.var)) / span
        return gain(p, q) + se < self.e_min()

    def e_min(self) -> float:
        """The elasticity of a 20% step that adds `step_gain`: below it, a step does not pay."""
        return math.log1p(self.cfg.step_gain) / math.log(1.2)

    def _flat(self, kept: list[Point]) -> float:
        """The lowest kept level from which no step up of `SPAN` (1.5x) or more to a kept
        level pays (measured, not fitted: on a flat plateau the saturating model need not
        bend). Not a shorter step: where windows at one level differ by ~6% (vLLM's CPU
        build), a short step's elasticity reads noise alone. Each step must not pay by more
        than the measured noise (`_unpaid`). Measured: docs/design/knee.md, "The curve"
        (Three readings of the knee)."""
        # a draining window's mean in-flight understates the level its throughput came from
        kept = [p for p in kept if p.steady]
        pair = self.cfg.pair
        for p in kept:
            # one scrape just after a rise reads the engine decoding all it holds, no answer
            # ending and no newcomer's prefill in it: above the level's steady throughput, so
            # no plateau's foot (docs/design/knee.md, "Regions"); a window's mean at the
            # level may still be a foot
            if p.scrape:
                continue
            # p and the levels just under it, so one lucky window at p is not a plateau
            near = under(kept, p, pair)
            above = [q for q in kept if q.concurrency >= SPAN * p.concurrency]
            if above and all(self._unpaid(r, q) for r in near for q in above):
                return p.concurrency
        return math.inf

    def elasticity(self, level: float) -> float:
        """d ln tput / d ln c of the fitted curve at `level`; 1 (linear) without a fit."""
        a, b, _ = fit(self.kept()[0])
        return max(0.0, min(1.0, a / (a + b * level))) if b > 0 and a + b * level > 0 else 1.0

    def kept(self) -> tuple[list[Point], bool]:
        """The steady levels up to the decline, ascending; and whether one was cut off (a
        level that measured no throughput counts as one)."""
        kept = self._until_decline(self._walked())
        return kept, len(kept) < sum(p.steady for p in self.points.values())

    def _walked(self) -> list[Point]:
        """The levels `kept` walks up: steady ones with a throughput read, ascending (a
        draining window's mean in-flight understates the level its throughput came from)."""
        pts = (p for p in self.points.values() if p.steady and p.throughput > 0)
        return sorted(pts, key=lambda p: p.concurrency)

    def _until_decline(self, pts: list[Point]) -> list[Point]:
        """The levels up to the first that declined from the best before it: throughput down
        by `decline`, or power down to `power_floor` with a step that did not pay. A level
        read by one scrape after a rise (`Point.scrape`) is kept, but its throughput is no
        reference for a decline (its power still is: a step past it that did not pay is
        still one): it reads the engine decoding all it holds, and one second's counters
        swing far besides.

        A decline holds from its reference (the best throughput, the best power) and from
        each level kept within `pair` under it (`_under`), as a plateau must: one lucky
        window is no reference. The reference is a level read within `objective_memory`
        (30 s) of the curve's latest window: an older reading may be from another spell of
        the host, and the limit, held under the decline, never reads it again. On a curve
        that settled under a real knee the limit re-reads the levels just under it: the
        references stay fresh. Measured: docs/design/knee.md, "The curve" (Where the curve
        ends)."""
        kept: list[Point] = []
        peak: Point | None = None  # the highest throughput so far (no scrape's)
        best: tuple[float, Point] | None = None  # the highest power so far, and its level
        pair, floor = self.cfg.pair, self.cfg.power_floor
        # a reference is fresh: read within `objective_memory` of the curve's latest window
        fresh = max((p.at for p in self.points.values()), default=0.0) - self.cfg.objective_memory
        for p in pts:
            power = self._power(p)
            # a decline holds from its reference and from each level kept just under it
            if peak is not None and all(
                p.throughput < r.throughput * (1 - self.cfg.decline)
                for r in under(kept, peak, pair) if not r.scrape
            ):
                break  # past the decline; a second peak beyond is a false one
            # (a neighbour with no latency read, the engine's counters alone: the best's power)
            if power is not None and best is not None and all(
                power < (self._power(r) or best[0]) * floor and self._unpaid(r, p)
                for r in under(kept, best[1], pair)
            ):
                break  # latency grew far faster than throughput, which the step did not buy
            kept.append(p)
            if p.at < fresh:
                # kept, but no reference: another spell of the host read it. Within `pair`
                # under a fresh reference it still must show the decline (`_under`): an old
                # reading may hold a verdict back, never make one
                continue
            if not p.scrape and (peak is None or p.throughput > peak.throughput):
                peak = p
            if power is not None and (best is None or power > best[0]):
                best = (power, p)
        return kept

    def _power(self, p: Point) -> float | None:
        """Kleinrock's power; None for a level measured by the engine's counters alone (no
        request finished in its window), whose latency is unknown, not zero."""
        if p.ttft_p90 is None and p.tpot_p50 is None:
            return None
        delay = (p.ttft_p90 or 0.0) + (p.tpot_p50 or 0.0) * max(self.ref_tokens, 1.0)
        return p.throughput / delay if delay > 0 else None

    def view(self, room: float) -> dict[str, Any]:
        """The curve as the live page draws it (see `Knee.fit`); reads, never changes it."""
        kept, declined = self.kept()
        a, b, _ = fit(kept)
        fitted = a > 0 and b > 0
        # `declined` also counts a level that measured no throughput
        past = [p.concurrency for p in self._walked()[len(kept):]]
        bad = sorted(p.concurrency for p in self.points.values() if p.over_objective)
        return {
            "kept": [round(p.concurrency, 2) for p in kept],
            "decline_from": round(past[0], 2) if declined and past else None,
            "intercept": a if fitted else None,
            "slope": b if fitted else None,
            "curve_knee": self.knee()[0],
            "room": room if math.isfinite(room) else None,
            "over_objective": [round(c, 2) for c in bad],
        }

    def as_list(self) -> list[dict[str, Any]]:
        """The points by level, as `state()` shows them."""
        return [p.as_dict() for p in sorted(self.points.values(), key=lambda p: p.concurrency)]
