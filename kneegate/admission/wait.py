"""Waits: the one a request is predicted to have, and the one the queue's heads are seen to have.

Pure, like the queue that uses them (`admission.queue`): no clock, time comes in as `now`.

    CompletionRate  completions per busy second: an EWMA, debiased, idle time skipped
    WaitEstimate    queue_wait(ahead) = (ahead + 1) / the completion rate, or the queue's
                    drain rate (`departures`: dispatches out of the queue per second some
                    request was queued) where that is slower (None until warm);
                    duration, the mean dispatch to the end of an answer (an EWMA);
                    engine_ttft, the engine's recent TTFT, dispatch to first token (the first
                    one taken whole, then an EWMA of weight 0.1 per first token);
                    budget = queue_budget x (objective - engine_ttft) while arrivals
                    outnumber completions (`Demand.excess`), else objective - engine_ttft
    PrefillLine     ttft = base + slope x the prefill backlog a request found; the backlog
                    a horizon allows (`cap`)
    StandingQueue   the safety net: a class's queue stands once every head has waited
                    longer than its target (the budget) for STANDING (4) targets in a row

The rules `AdmissionQueue` builds from them, each with its reason; what was measured and
tried for each: docs/design/wait.md.

- **No wait is predicted shorter than the oldest request in flight has left to run** at the
  mean duration (`AdmissionQueue._first_free`, from `WaitEstimate.duration`): answers of one
  length started together end together, and the rate, an average, promises a slot within
  1 / rate while none frees until that wave ends (docs/design/wait.md, "The oldest answer's
  time left").
- **The budget** is the wait `AdmissionQueue.offer` admits against: a request whose predicted
  queue wait is over it is refused at once (429 `over_objective`). A quarter of the objective
  (`queue_budget`, 0.25) because the queue only has to cover the moment between two
  completions to keep the engine full; a request queued near the edge of its objective
  misses it on any variance, and then it had waited for nothing ("The budget"). The quarter
  rations an excess, so it holds only where there is one: while arrivals outnumber
  completions (`Demand.excess`: by over 1.2 to 1 and over 4, over the scale-out signal's
  half-life). Without one, a request refused is goodput lost, not one that the next
  arrival replaces: it may be predicted to wait what its objective allows, and one that
  only an engine's prefill backlog holds back is queued unpredicted, to wait for the
  prefills ahead as it would in the engine's own queue ("An excess to ration").
- **The safety net**, for when the prediction is wrong (capacity fell, prompts grew, other
  gateways share the engine): while a class's queue stands, `AdmissionQueue.pump` answers a
  head over target 503 instead of dispatching it: CoDel's test (a minimum sojourn above
  target for an interval) with its drop replaced by an answer. Newest-first service lost to
  it, and leaves the oldest to wait out their objective before their 503 ("The safety net").
- **A cold start** (before the first four answers end) has no completion rate; the
  prediction until then (`AdmissionQueue._cold_wait`) reads the time that has passed: no
  answer ended while the oldest in flight ran, so the n in flight free their slots no faster
  than n per that age. It starts at 0, so a burst onto a fresh gateway is queued, and only
  time without an answer refuses ("A cold start").
- **Counted in requests, not tokens**: the k-th queued request starts when k + 1 requests in
  flight have ended, whatever the sizes queued ahead of it; weighting the queue by its tokens
  predicted the simulator's trace waits worse ("Counted in requests, not tokens").
- **The queue's own drain**: where dispatches out of the queue (`departures`) are slower than
  answers end (an answer that ends while the limit is under what is in flight frees no slot;
  a small one's KV is too little for a larger request), the prediction takes the slower rate
  ("The queue's drain").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

__all__ = ["CompletionRate", "PrefillLine", "StandingQueue", "WaitEstimate"]


@dataclass
class CompletionRate:
    """Exponentially weighted completions per busy second, fed by `AdmissionQueue.release`.

    The average starts at zero, so for the first half-lives it reads low in proportion to
    the weight that empty start still has: `per_second` divides that weight out, as Adam's
    bias correction does, once `warm` completions have been seen. Time with nothing in
    flight is not counted (`resume`): an idle engine is no slower. The busy time starts at
    the dispatch that made the engine busy, not at the first completion: answers of one
    length sent together end together, and counted from the first of them a wave reads
    many times the rate the engine serves. Measured: docs/design/wait.md, "The completion
    rate".
    """

    half_life: float = 10.0
    warm: int = 4
    rate: float = 0.0
    last: float | None = None
    span: float = 0.0  # busy seconds seen since the first completion
    count: int = 0

    def note(self, now: float) -> None:
        self.count += 1
        if self.last is None:
            self.last = now
            return
        # decay the old rate over dt and add this completion: for dt << half_life each
        # completion adds ln2 / half_life, so a steady stream converges on its true rate
        dt = max(now - self.last, 1e-6)
        w = 0.5 ** (dt / self.half_life)
        self.rate = w * self.rate + (1 - w) / dt
        self.last = now
        self.span += dt

    def resume(self, now: float) -> None:
        """Work starts (again) after a time with nothing in flight: that time is skipped,
        and the busy time the completions are counted over starts here."""
        if self.last is None or now > self.last:
            self.last = now

    @property
    def per_second(self) -> float:
        """The debiased rate; 0.0 until `warm` completions have been seen."""
        if self.count < self.warm:
            return 0.0
        seen = 1 - 0.5 ** (self.span / self.half_life)
        return self.rate / seen if seen > 0 else 0.0


@dataclass
class PrefillLine:
    """An engine's TTFT against the prefill backlog a request found: ttft = base + slope x
    backlog, fitted by least squares over exponentially weighted moments (weight `WEIGHT`
    per first token), and the backlog it allows within a horizon (`cap`).

    The backlog is the streamed requests dispatched to the engine, ahead of this one, that
    had no first token yet. On an engine whose prefills queue behind each other (vLLM's CPU
    build: ~0.12 s a 128-token prompt), the slope is that time; on one that prefills a
    batch in one step (a GPU), it is near 0 and nothing is capped.
    """

    WEIGHT: ClassVar[float] = 0.05  # of one first token: ~20 of them in the moments
    WARM: ClassVar[int] = 8  # first tokens before a cap is read
    MIN_VARIANCE: ClassVar[float] = 0.25  # of the backlog: below it, no slope is read
    count: int = 0
    _b: float = 0.0  # E[backlog]
    _t: float = 0.0  # E[ttft]
    _bb: float = 0.0  # E[backlog^2]
    _bt: float = 0.0  # E[backlog x ttft]

    def note(self, backlog: int, ttft: float) -> None:
        """A first token came `ttft` s after its dispatch, which found `backlog` ahead."""
        a = self.WEIGHT if self.count else 1.0
        self._b += a * (backlog - self._b)
        self._t += a * (ttft - self._t)
        self._bb += a * (backlog * backlog - self._bb)
        self._bt += a * (backlog * ttft - self._bt)
        self.count += 1

    def cap(self, horizon: float) -> int:
        """The most requests awaiting a first token, this one included, whose TTFT the line
        puts within `horizon` (at least 1); 0 (no cap) until `WARM` first tokens, while the
        backlog has not varied, or where the TTFT does not grow with it."""
        variance = self._bb - self._b * self._b
        if self.count < self.WARM or variance < self.MIN_VARIANCE:
            return 0
        slope = (self._bt - self._b * self._t) / variance
        if slope <= 0:
            return 0
        base = self._t - slope * self._b
        return max(1, math.floor((horizon - base) / slope) + 1)


@dataclass
class WaitEstimate:
    """The completion rate and the engine's TTFT, the two figures a predicted wait is made of."""

    completions: CompletionRate = field(default_factory=CompletionRate)
    # dispatches out of the queue per second some request was queued (`departures`)
    departures: CompletionRate = field(default_factory=CompletionRate)
    engine_ttft: float = field(default=0.0, init=False)  # EWMA, dispatch to first token
    _ttft_seen: int = field(default=0, init=False)
    duration: float | None = field(default=None, init=False)  # EWMA, dispatch to the end
    _WEIGHT: ClassVar[float] = 0.1  # of one answer in `engine_ttft` and in `duration`

    def queue_wait(self, ahead: int) -> float | None:
        """Seconds a request with `ahead` queued before it is predicted to wait for a slot:
        their service at the measured completion rate, or at the queue's drain rate where
        that is slower (an answer that ends frees no slot while the limit is under what is
        in flight, or frees too little KV cache for a larger request). None until
        completions have been measured (then nothing is refused for its objective)."""
        rate = self.completions.per_second
        served = self.departures.per_second
        if rate > 0 and served > 0:
            rate = min(rate, served)
        return (ahead + 1) / rate if rate > 0 else None

    def note_duration(self, seconds: float) -> None:
        """A request ended well `seconds` after dispatch."""
        d = self.duration
        self.duration = seconds if d is None else d + self._WEIGHT * (seconds - d)

    def note_ttft(self, seconds: float) -> None:
        """A first token came `seconds` after dispatch: the engine's part of the wait."""
        a = self._WEIGHT if self._ttft_seen else 1.0
        self.engine_ttft += a * (seconds - self.engine_ttft)
        self._ttft_seen += 1

    def budget(self, queue_budget: float, objective: float) -> float:
        """Seconds of queue wait a request may be predicted to have: `queue_budget` of its
        `objective` less the engine's TTFT."""
        return queue_budget * (objective - self.engine_ttft)


@dataclass
class StandingQueue:
    """The safety net for wrong predictions (CoDel's idea), per class of the queue."""

    STANDING: ClassVar[float] = 4.0  # targets' worth of time with every head over target
    # per class, when its head last waited no more than its target
    _short_at: dict[str, float] = field(default_factory=dict)

    def standing(self, name: str, head_arrived_at: float | None, target: float,
                 now: float) -> bool:
        """True once every head of class `name`'s queue (now: the one that arrived at
        `head_arrived_at`; None when it is empty) has waited longer than `target` for
        `STANDING` x target."""
        if head_arrived_at is None or now - head_arrived_at <= target:
            self.empty(name, now)
            return False
        return now - self._short_at.setdefault(name, now) > self.STANDING * target

    def empty(self, name: str, now: float) -> None:
        """Class `name`'s queue is empty at `now`, or its head has waited no longer than its
        target: the standing time starts again (`standing(name, None, ...)`, unasked)."""
        self._short_at[name] = now
