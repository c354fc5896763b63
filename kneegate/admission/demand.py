"""Demand: the offered load against what the learned knees sustain. Pure: time comes in.

The scale-out signal (issue 14): when more is offered than the engines serve at their knee,
the answer is more engines. Fed by the admission queue (every arrival, accepted or not;
every change of the in-flight count; every completion), read at scrape time:

    offered   = arrivals per second                                 (A / T)
    capacity  = L x completions per in-flight-second                (L x C / S)
    ratio     = offered / capacity
    suggested = max(1, ceil(engines x ratio / target))

`L` is the sum of the usable upstreams' limits (headroom x knee, times this gateway's
share where several share an engine), `engines` their number, `target` the utilisation
the suggested count aims at (`scale.target`, 0.9). A, C and S are sums decayed with one
half-life (`scale.half_life`, 15 s): A counts arrivals, C completions, S the in-flight count
integrated over time, and T is the decayed elapsed time, so A / T and C / S are rates over
the same recent past with no bias from an empty start (a rate EWMA starting at zero needs
a correction; a ratio of two sums decayed alike does not).

Why capacity is L x C / S. Little's law: S / C is the mean time a request holds a slot
(R), so C / S = 1 / R is one slot's service rate, and a pool holding L requests in flight
serves L / R. Under overload the gateway holds in-flight at L, and L / R is the completion
rate itself. Below the knee's demand the completion rate is the arrival rate, so it reads
~1 whatever the load and cannot say how much room is left; L / R can: the ratio then reads
about N / L, the share of the limit's level in use (R grows with concurrency on the
plateau, so below saturation it errs low by R(N) / R(L); the limit a `knee` controller
holds when app-limited is lower than at overload, which errs the other way, and more).
Measured in `kneegate.sim` against offered / what the engine serves held full: the
ratio reads the offered load within a few percent wherever the engine is held full, and
errs high below capacity (docs/benchmarks.md, "The scale-out signal").

Warm-up: nothing is read before `warm` completions and `settle` (2) mean request
lifetimes (S / C, judged at each completion) since the first event. Early on S counts the
time of requests that have not finished yet and C / S reads low, so the ratio reads far
high until then.

Half-life 15 s: the simulator's completions come in bursts (long requests admitted
together), and a shorter half-life swings with them while a longer one follows a fall in
capacity later (the half-lives compared: docs/history/benchmarks.md, "The demand ratio in
the simulator (issue 14, part 3), 2026-12-01"). An autoscaler acts over minutes (an engine
takes minutes to start), so a few tens of seconds of averaging cost little.

Why `target` < 1 (0.9): an engine run at its knee has no room for a burst: Poisson
arrivals at 0.9 of capacity already queue for ~10x a request's time in an M/M/1 model,
and a new engine needs minutes to load its weights, so the count aims below full. The
HPA's own 10% tolerance keeps the count from flapping around the target.

Counting every arrival, refused ones included, is what makes the ratio read over 1: the
admitted load can never exceed the capacity. A client that retries a refusal (after its
Retry-After) is counted again: sustained overload with retrying clients reads high by
their retries, which errs on the side of adding an engine. A completion is any end of a
request (cancellations and errors too); an engine failing fast while still marked usable
would read as a fast one, so a broken engine should fail its health check (then L drops).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

__all__ = ["Demand", "DemandEstimate"]

_LN2 = math.log(2.0)


@dataclass(frozen=True, slots=True)
class DemandEstimate:
    """One reading of the pool's demand (rates in requests per second)."""

    offered: float  # arrivals per second, refused ones included
    capacity: float  # what the usable upstreams serve at their limits
    ratio: float  # offered / capacity: ~1 just full, 3 at three times that, < 1 room
    engines: int  # usable upstreams
    suggested_replicas: int  # engines needed at this demand, at `target` utilisation

    def as_dict(self) -> dict[str, float | int]:
        return {
            "offered": round(self.offered, 3),
            "capacity": round(self.capacity, 3),
            "ratio": round(self.ratio, 3),
            "engines": self.engines,
            "suggested_replicas": self.suggested_replicas,
        }


def suggested_replicas(engines: int, ratio: float, target: float) -> int:
    """ceil(engines x ratio / target), at least 1; 2 engines at 0.9 with target 0.9 is 2,
    not the 3 that rounding error in the product would give."""
    return max(1, math.ceil(engines * ratio / target - 1e-9))


@dataclass
class Demand:
    """Decayed sums of arrivals, completions and in-flight time; see the module doc."""

    EXCESS: ClassVar[float] = 1.2  # arrivals per completion over which there is an excess
    EXCESS_MARGIN: ClassVar[float] = 4.0  # and this many arrivals more than completions
    half_life: float = 15.0  # seconds
    warm: int = 8  # completions before a capacity is read
    settle: float = 2.0  # and mean request lifetimes (S / C) since the first event
    _arrivals: float = 0.0  # A
    _completions: float = 0.0  # C
    _busy: float = 0.0  # S: in-flight x seconds
    _span: float = 0.0  # T: seconds
    _inflight: int = 0  # N since `_last`
    _last: float | None = None
    _start: float = 0.0  # the first event
    _seen: int = 0  # completions, not decayed
    _settled: bool = False  # `settle` lifetimes have passed since the first event

    # --- feeding -------------------------------------------------------------------

    def arrive(self, now: float) -> None:
        """A request arrived (whatever admission then decides)."""
        self._advance(now)
        self._arrivals += 1.0

    def occupy(self, now: float, inflight: int) -> None:
        """The pool's in-flight count is `inflight` from `now` on."""
        self._advance(now)
        self._inflight = inflight

    def complete(self, now: float, inflight: int) -> None:
        """A request ended; `inflight` are left in flight."""
        self._advance(now)
        self._completions += 1.0
        self._seen += 1
        self._inflight = inflight
        if not self._settled and self._busy > 0:
            self._settled = now - self._start >= self.settle * self._busy / self._completions

    def _advance(self, now: float) -> None:
        if self._last is None:
            self._last = self._start = now
            return
        dt = now - self._last
        if dt <= 0:  # an event stamped before the last one (the simulator's steps): same time
            return
        # `_decayed`, inline: this runs two or three times a request
        w = 0.5 ** (dt / self.half_life)
        held = (1.0 - w) * self.half_life / _LN2
        self._arrivals *= w
        self._completions *= w
        self._busy = self._busy * w + self._inflight * held
        self._span = self._span * w + held
        self._last = now

    def _decayed(self, dt: float) -> tuple[float, float, float, float]:
        """(A, C, S, T) `dt` seconds after the last event, nothing new in between."""
        w = 0.5 ** (dt / self.half_life)
        held = (1.0 - w) * self.half_life / _LN2  # the integral of the decay over dt
        return (self._arrivals * w, self._completions * w, self._busy * w + self._inflight * held,
                self._span * w + held)

    # --- reading -------------------------------------------------------------------

    def arrivals_per_completion(self) -> float:
        """A / C: ~1 while the engines serve what arrives (completions trail arrivals by a
        request's lifetime, and decayed alike the two sums meet), the multiple of what they
        serve under overload (refused arrivals count, only served ones end). Both decay
        alike, so the ratio is the same at any later time. inf with arrivals and no
        completion yet, 0 with no arrival."""
        if self._completions > 0:
            return self._arrivals / self._completions
        return math.inf if self._arrivals > 0 else 0.0

    def excess(self) -> bool:
        """More arrives than the engines serve: A over `EXCESS` x C, and by more than
        `EXCESS_MARGIN` requests (decayed), which the first few events of a start, one
        arrival ahead of its completion, do not make."""
        return (self.arrivals_per_completion() > self.EXCESS
                and self._arrivals - self._completions > self.EXCESS_MARGIN)

    def estimate(self, now: float, limits: Sequence[int], target: float) -> DemandEstimate | None:
        """The reading at `now` for usable upstreams with these `limits`; None until `warm`
        completions have been seen, with no usable upstream, or while nothing completes
        (a capacity of zero: a stalled pool, for which the stall alert speaks)."""
        level = sum(limits)
        if self._last is None or self._seen < self.warm or level <= 0:
            return None
        a, c, s, t = self._decayed(max(0.0, now - self._last))
        if self._inflight == 0 and self._busy > 0:
            per_slot = self._completions / self._busy  # idle: both decay alike (no underflow)
        else:
            per_slot = c / s if s > 0 else 0.0
        capacity = level * per_slot
        if capacity <= 0 or t <= 0 or not self._settled:
            return None
        offered = a / t
        ratio = offered / capacity
        return DemandEstimate(offered, capacity, ratio, len(limits),
                              suggested_replicas(len(limits), ratio, target))
