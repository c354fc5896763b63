"""`SlowStart`: no refusal without evidence. Until an engine shows it is saturating, the
gateway admits what the engine would take, growing its allowance as TCP's slow start grows
its window.

Pure, like the queue that drives it (`admission.queue`): no clock, times come in as data.

A fresh gateway (a start, a reload that builds new upstreams, a new replica) knows nothing of
its engine; its controller's limit is a guess (`initial`, 16) and its windows take seconds to
close; held at that guess, it refuses what the engine alone would have served in time. So an
upstream's limit, while its slow start is open, is the larger of its controller's limit
and an allowance that grows by one for each first token that came back within the objective
while the upstream was full: it doubles per round trip to a first token (prefills take a
fraction of a second; whole answers take many seconds, so a first token, not a completion, is
the acknowledgement; an answer that does not stream acknowledges at its end).

The allowance stays within `REACH` (4) x the controller's limit when the slow start first
counted: two doublings past the first guess, the levels the controller's own climb visits in
its first windows, so that what the controller learns meanwhile is what its climb would have
read (docs/experiments/2026-12-06-slow-start.md).

Evidence of saturation, any one of which closes the slow start for good (until the upstream
is built anew):

    a first token later than the tightest class's objective after dispatch (the engine
        alone already misses it)
    preemptions between two scrapes of the engine (its KV cache ran out), or its own queue
        holding requests half the objective on average (`saturated`)
    the engine refusing a request unstarted (vLLM's queue caps, `AdmissionQueue.requeue`)
    for an engine judged by its queue time, a request queued at the gateway past its
        objective once the allowance is at its reach (`AdmissionQueue._stood`)
    an answer of `upstream_overloaded`

An engine that does not report its queue time (older vLLM, other servers) is judged by its
waiting gauge standing between two scrapes (`is_distress`): a burst of prefills also queues
there for a step or two, so a burst larger than the engine prefills at once can close the
slow start early.

Closed, the upstream's limit is its controller's again; what is in flight past it drains as
answers end. While any usable upstream's slow start is open, the queue refuses nothing for
its objective (`AdmissionQueue._predict`): a queued request waits at most until it is due. A
controller that is not adaptive (`fixed`: the operator's number) gets no slow start.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from kneegate.controllers.base import EngineStats, is_distress

__all__ = ["SlowStart", "saturated"]


@dataclass(slots=True)
class SlowStart:
    """One upstream's slow start: `open` until the engine shows saturation; `allowance`,
    the in-flight it may take meanwhile (0: none beyond the controller's limit)."""

    REACH: ClassVar[int] = 4  # the allowance stays within this x the first limit seen
    open: bool = True
    allowance: int = 0
    _base: int = 0  # the controller's limit when the slow start first counted
    ended_at_level: int | None = None  # the in-flight count that showed saturation
    # what showed it: late_first_token, engine_queue, engine_refused, upstream_overloaded,
    # queued_past_objective
    ended_by: str | None = None
    _last_stats: EngineStats | None = None

    @property
    def at_reach(self) -> bool:
        """The allowance has grown as far as it may (`REACH` x the first limit)."""
        return self._base > 0 and self.allowance >= self.REACH * self._base

    @property
    def timed(self) -> bool:
        """The engine reports how long requests wait in its own queue (`saturated`)."""
        last = self._last_stats
        return last is not None and not math.isnan(last.queue_time_count)

    def limit(self, controller_limit: int) -> int:
        """The in-flight count the upstream may hold now."""
        if self.open and self.allowance > controller_limit:
            return self.allowance
        return controller_limit

    def first_token(self, ttft: float, threshold: float, inflight: int,
                    controller_limit: int) -> bool:
        """A first token came `ttft` s after its dispatch, with `inflight` now in flight.
        Within `threshold` while the upstream is full (in-flight at its limit, less one:
        the request that just got its token is still in flight), the allowance grows by one;
        later, the slow start ends. True when this call ended it."""
        if not self.open:
            return False
        if ttft > threshold:
            return self.end(inflight, "late_first_token")
        self.acked(inflight, controller_limit)
        return False

    def acked(self, inflight: int, controller_limit: int) -> None:
        """The engine answered one request in time (a first token; for an answer that does
        not stream, its end) with `inflight` still in flight: while the upstream was full,
        one more may be in flight."""
        limit = self.limit(controller_limit)
        self._base = self._base or controller_limit
        if self.open and inflight >= limit - 1:
            self.allowance = min(self.REACH * self._base, limit + 1)

    def engine_stats(self, stats: EngineStats, inflight: int, threshold: float) -> bool:
        """A scrape of the engine: saturation since the last one (`saturated`) ends the
        slow start. True when this call ended it."""
        prev, self._last_stats = self._last_stats, stats
        return (prev is not None and saturated(prev, stats, threshold)
                and self.end(inflight, "engine_queue"))

    def end(self, inflight: int, why: str) -> bool:
        """Saturation (`why`) was seen at `inflight` in flight: close (True), unless closed
        already."""
        if not self.open:
            return False
        self.open, self.ended_at_level, self.ended_by = False, inflight, why
        return True

    def status(self) -> dict[str, object]:
        """For the status page: open, the allowance, and what ended it at which level."""
        return {"open": self.open, "allowance": self.allowance,
                "ended_at_level": self.ended_at_level, "ended_by": self.ended_by}


def saturated(prev: EngineStats, cur: EngineStats, threshold: float) -> bool:
    """Whether two scrapes show the engine saturated, for a first token due within
    `threshold` s: preemptions between them (its KV cache ran out); or, where the engine
    reports how long requests waited in its own queue (vLLM's request_queue_time_seconds),
    those that left it meanwhile waited threshold / 2 on average. Without those counters,
    its queue standing and not draining (`is_distress`). A burst's prefills wait a step or
    two in the engine's queue, which the counters tell from a queue that stands; the
    waiting gauge alone cannot. An interval in which none left tells nothing yet (a long
    prefill may hold the queue that long): their wait, when they leave, will."""
    left = cur.queue_time_count - prev.queue_time_count
    if math.isnan(left):
        return is_distress(prev, cur)  # preemptions, or the waiting gauge standing
    if cur.preemptions_total > prev.preemptions_total:
        return True
    return left > 0 and (cur.queue_time_sum - prev.queue_time_sum) / left > threshold / 2
