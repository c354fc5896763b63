"""The throughput-vs-concurrency curve: points learnt per level, and the knee read from them.

A closed window gives one point (level c, throughput, TTFT p90, TPOT p50): the engine's
(running + waiting, its tokens/s) when it publishes its counters, else this gateway's
(mean in-flight, Little's law); the two are different curves, and a switch clears it.
Points are kept per level bin (`bin_ratio` wide, log scale), averaged with weight
`smoothing`, forgotten after `memory` s; a breach mark (`over_objective`) fades after
`objective_memory` s, and so does the level the curve declined at when one window read it
(`Curve._fade_decline`). A level whose throughput moved by more than `change` from the
nearest point says the engine changed: every point goes but the breached ones. A point
read by one scrape just after a rise (`Knee._climbed`) is an upper bound of its level: a
window's mean within `pair` of it measures the level, and the scrape's reading goes.

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
             within 2 standard errors under it (`_fit_knee`)
    plateau: the lowest kept level from which every step up of >= 1.5x (`SPAN`; and
             from each level within `pair` under it) has ln(t'/t) / ln(c'/c) < e_min;
             not from a level read by one scrape just after a rise (`Knee._climbed`)
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
objectives (`backoff` x that one when none is). Pure: no clock, no I/O.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Any

from kneegate.controllers.knee.config import KneeConfig
from kneegate.controllers.window import Summary

__all__ = ["Curve", "Point", "blend"]

SPAN = 1.5  # levels closer than this ratio cannot tell a bend or a plateau from noise
NOISE_KEEP = 20  # re-readings of a level that measure the noise (the last ones, `_reread`)
FIT_Z = 2.0  # standard errors of the fitted knee that cannot tell it from the top (`_fit_knee`)


@dataclass(slots=True)
class Point:
    """The curve at one concurrency level."""

    concurrency: float
    throughput: float
    ttft_p90: float | None
    tpot_p50: float | None
    over_objective: bool
    at: float
    steady: bool = False  # in-flight held level in the window, not a draining burst
    scrape: bool = False  # one scrape just after a rise (`Knee._climbed`), no window's mean
    windows: int = 1  # windows averaged into it (a point read once may be one lucky window)
    var: float = 1.0  # variance of its ln(throughput), in one window's (blending shrinks it)

    def as_dict(self) -> dict[str, Any]:
        return {
            "concurrency": round(self.concurrency, 2),
            "throughput": round(self.throughput, 2),
            "ttft_p90": self.ttft_p90,
            "tpot_p50": self.tpot_p50,
        }


def blend(old: float | None, new: float | None, w: float) -> float | None:
    """`old` moved towards `new` by weight `w`; either one alone when the other is None."""
    if old is None or new is None:
        return new if new is not None else old
    return old * (1 - w) + new * w


def _line(xs: list[float], ys: list[float]) -> tuple[float, float, float]:
    """Least-squares (intercept, slope) of ys on xs, and the variance of their ratio
    (`_fit_knee`); (1, 0, 0) unless the slope is clear."""
    n = len(xs)
    if n < 2:
        return 1.0, 0.0, 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if max(xs) < SPAN * min(xs):
        return 1.0, 0.0, 0.0  # too narrow a range to tell a bend from noise
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    a = my - b * mx
    res = sum((y - a - b * x) ** 2 for x, y in zip(xs, ys, strict=True))
    # a slope within 3 standard errors of zero is noise: the curve is still linear
    if b * b * sxx * (n - 2) <= 9 * res:
        return 1.0, 0.0, 0.0
    # a / b's variance, to first order: with s2 = res / (n - 2), var a = s2 (1/n + mx^2 /
    # sxx), var b = s2 / sxx, cov(a, b) = -mx s2 / sxx, it is s2 (sxx/n + (mx + a/b)^2) /
    # (sxx b^2); b is not 0 here, and a may be (a flat curve's exactly)
    return a, b, res / (n - 2) * (sxx / n + (mx + a / b) ** 2) / (sxx * b * b)


def _gain(p: Point, q: Point) -> float:
    """Elasticity d ln tput / d ln c between two levels of the curve."""
    return math.log(q.throughput / p.throughput) / math.log(q.concurrency / p.concurrency)


def _under(pts: list[Point], p: Point, pair: float) -> list[Point]:
    """p and the points of `pts` within `pair` under its level: a verdict read from p must
    hold from each of them, so that one lucky window at p is no verdict."""
    return [r for r in pts if p.concurrency / pair < r.concurrency <= p.concurrency]


def _fit(pts: list[Point]) -> tuple[float, float, float]:
    if len(pts) < 3:
        return 1.0, 0.0, 0.0  # two points are one noisy step: no curve yet
    return _line([p.concurrency for p in pts], [p.concurrency / p.throughput for p in pts])


def _fit_knee(pts: list[Point], a: float, b: float, var: float, e_min: float) -> float:
    """The knee of the line c / tput = a + b c fitted to `pts` (ascending; a, b > 0; `var`
    the variance of a / b, `_line`): where the elasticity 1 / (1 + b c / a) falls
    to e_min, (a / b)(1 / e_min - 1). Where that lies under the highest level but within
    `FIT_Z` standard errors of it, the highest level: so noisy a fit cannot tell the knee
    from it; else the knee raised by those errors, no lower than the lowest level.

    Why: the knee is a ratio of the two fitted coefficients, and where one window's
    throughput wanders it is uncertain by tens of percent; as the lowest of three
    readings its low end held the limit far under the knee. The error is added, and it
    is a / b's own, not its relative one: on a flat curve a ~ 0 and the relative error
    overflows. Measured: docs/design/knee.md, "The curve" (A fitted knee within its
    noise of the top)."""
    knee, top = a / b * (1 / e_min - 1), pts[-1].concurrency
    if knee < top:
        knee = min(top, knee + FIT_Z * (1 / e_min - 1) * math.sqrt(var))
    return max(knee, pts[0].concurrency)


class Curve:
    """The learnt points, by level bin, and what they say."""

    def __init__(self, cfg: KneeConfig) -> None:
        self.cfg = cfg
        self.points: dict[int, Point] = {}
        self.ref_tokens = 0.0  # mean answer length, in power's delay
        self.engine_mode: bool | None = None  # points are the engine's, not this gateway's
        # re-readings of a level (`_reread`), one window's variance each
        self._repeats: deque[float] = deque(maxlen=NOISE_KEEP)
        self._noise = 0.0  # their mean (`noise`), kept as they come: the verdicts read it often

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
        `scrape`: the window is one scrape read just after a rise, `Knee._climbed`)."""
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

    def nearest(self, level: float) -> Point | None:
        """The stored point closest to `level`, if within two bins of it."""
        best = min(self.points.values(), key=lambda p: abs(p.concurrency - level), default=None)
        if best is None or abs(best.concurrency - level) > 2 * self.cfg.bin_ratio * level:
            return None
        return best

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

    # --- reading --------------------------------------------------------------------------

    def top(self) -> float:
        """The highest level measured (the initial limit before any)."""
        return max((p.concurrency for p in self.points.values()), default=self.cfg.initial)

    def highest(self) -> Point | None:
        """The point at the highest level measured; None before any."""
        return max(self.points.values(), key=lambda p: p.concurrency, default=None)

    def ceiling(self) -> float:
        """Highest level measured below the lowest level that broke an objective."""
        bad = [p.concurrency for p in self.points.values() if p.over_objective]
        if not bad:
            return math.inf
        lowest_bad = min(bad)
        ok = [p.concurrency for p in self.points.values() if p.concurrency < lowest_bad]
        return max(ok) if ok else lowest_bad * self.cfg.backoff

    def knee(self) -> tuple[float | None, bool]:
        """(knee level of the throughput curve, still rising at the top); None: none seen yet."""
        kept, declined = self.kept()
        top = self._top(kept) if kept and declined else math.inf
        a, b, var = _fit(kept)
        knee = min(top, self._flat(kept))
        if b > 0 and a > 0:
            # a fit whose knee lies under every level measured says they are all on the
            # plateau, not where it starts: no lower than the lowest of them
            knee = min(_fit_knee(kept, a, b, var, self.e_min()), knee)
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
        return _gain(p, q) + se < self.e_min()

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
            near = _under(kept, p, pair)
            above = [q for q in kept if q.concurrency >= SPAN * p.concurrency]
            if above and all(self._unpaid(r, q) for r in near for q in above):
                return p.concurrency
        return math.inf

    def elasticity(self, level: float) -> float:
        """d ln tput / d ln c of the fitted curve at `level`; 1 (linear) without a fit."""
        a, b, _ = _fit(self.kept()[0])
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
                for r in _under(kept, peak, pair) if not r.scrape
            ):
                break  # past the decline; a second peak beyond is a false one
            # (a neighbour with no latency read, the engine's counters alone: the best's power)
            if power is not None and best is not None and all(
                power < (self._power(r) or best[0]) * floor and self._unpaid(r, p)
                for r in _under(kept, best[1], pair)
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
        a, b, _ = _fit(kept)
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
