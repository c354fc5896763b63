"""Waits: the one a request is predicted to have, and the one the queue's heads are seen to have.

Pure, like the queue that uses them (`admission.queue`): no clock, time comes in as `now`.

    CompletionRate  completions per busy second: an EWMA, debiased, idle time skipped
    WaitEstimate    queue_wait(ahead) = (ahead + 1) / the completion rate, or the queue's
                    drain rate (`departures`: dispatches out of the queue per second some
                    request was queued) where that is slower (None until warm);
                    duration, the mean dispatch to the end of an answer (an EWMA);
                    engine_ttft, the engine's recent TTFT, dispatch to first token (the first
                    one taken whole, then an EWMA of weight 0.1 per first token);
                    budget = queue_budget x (objective - engine_ttft)
    StandingQueue   the safety net: a class's queue stands once every head has waited
                    longer than its target (the budget) for STANDING (4) targets in a row

No wait is predicted shorter than the oldest request in flight has left to run at the mean
duration (`AdmissionQueue._first_free`, from `WaitEstimate.duration`): answers of one length
started together end together, and the rate, an average, promises a slot within 1 / rate
while none frees until that wave ends. On the emulator at 3x (`python -m
kneegate.benchmarks.overload --arms kneegate --loads 3 --seconds 30`, answers of 64 tokens)
48-64 answers ended in one second and none in the next one or two. Requests queued after a
wave left were answered 503 after 1.4-1.5 s. That happened in 7 of 12 runs of builds with
the later changes of the `knee12b` branch (not merged), and in none of 4 of that branch with
this bound, nor in 3 of main with it (rejection p99 5-31 ms). The simulator's answers vary
in length, so the bound moves little there: seeds 1 and 2 unchanged in every scenario; at
seed 7 cpu-tiny-3x 0.979 -> 0.958, small-kv-decline 1.009 -> 0.982, cpu-tiny-10x 0.973 ->
0.981, the others within 0.003 (suite total 14.58 -> 14.55).

The budget is the wait `AdmissionQueue.offer` admits against: a request whose predicted
queue wait is over it is refused at once (429 `over_objective`). Why a quarter of the
objective (`queue_budget`, 0.25): the queue only has to cover the moment between two
completions to keep the engine full; a request queued near the edge of its objective misses
it on any variance, and then it had waited for nothing. In the simulator (seed 7, knee, from
arrival) a budget of 1 / 0.75 / 0.5 / 0.25 read 0.93 / 0.96 / 0.99 / 1.05 of the oracle at
steady 3x and 0.85 / 0.98 / 0.97 / 1.00 at cpu-tiny 3x, with TTFT p99 from arrival 2.2 / 2.2 /
1.8 / 0.5 s; the oracle's own best wait caps are 0.25-0.5 of the objective.

The safety net, for when the prediction is wrong (capacity fell, prompts grew, other
gateways share the engine): while a class's queue stands, `AdmissionQueue.pump` answers a
head over target 503 instead of dispatching it: CoDel's test (a minimum sojourn above target
for an interval) with its drop replaced by an answer. Chosen over newest-first service by
measurement (`python -m kneegate.benchmarks.simulate --scenario NAME --controllers knee
--seed 7`, goodput / oracle, without the net -> CoDel -> newest-first): prompt-growth 1.50 ->
1.60 -> 1.54 (TTFT p99 from arrival 4.3 -> 3.3 -> 3.6 s), steady-3x 1.02 -> 1.05 -> 1.07,
four-gateways 0.82 -> 0.83 (p99 1.5 -> 0.5 s), capacity-drop 1.07 -> 1.07 -> 1.09, cpu-tiny-3x
0.98 -> 0.98 -> 0.97, bursts 0.87 -> 0.87 -> 0.81; newest-first also leaves the oldest to
wait out their objective before their 503, where CoDel answers them at the target. An
interval of 2 / 3 / 8 targets read about the same (prompt-growth 1.63 / 1.59 / 1.56).

Tried and dropped: re-judging the queue when a limit cut leaves more in flight than the new
limit (that excess must finish before any queued request starts). Two parts were tried: the
excess counted in an arrival's predicted wait, and, at each tick, the queued requests that
could no longer start before they were due refused at once (429). On the wall clock this
targets `knee`'s probe on the emulator at 3x, 32 -> 63 -> 35: at 18 completions a second the
cut stalls the queue for 1.5 s. In the simulator, though, `knee` cuts for about a second
when prompts grow (40 -> 12 -> 40 at 61 s, seed 7). Requests refused in that second would
have been served. Prompt-growth over seeds 1-7, goodput / oracle, mean 1.61 -> 1.59
(refusals at the tick only; with the arrival's prediction too, seed 7 read 1.595 -> 1.539).
Its time to settle went past 15 s at 2 of 7 seeds instead of 1. The excess was read from the
instant's limit, which a controller may take back.

Before the first four answers end (a cold start) there is no completion rate. Under
sustained overload a fresh gateway then queued to its count, and requests waited out their
objective: on the simulator's L4 (answers of ~256 tokens, the first ending ~13 s after the
start), 5-16% of all requests in the overload scenarios were answered 503 after waiting, at
seeds 7 and 1. The prediction now used until then (`AdmissionQueue._cold_wait`) reads the
time that has passed: no answer ended while the oldest in flight ran, so the n in flight
free their slots no faster than n per that age. It starts at 0, so a burst onto a fresh
gateway is queued as before (e.g. 8 requests at a limit of 4 on a fast engine), and only
time without an answer refuses. With it those 503s fell to 0-1% of requests in every
scenario at both seeds (`python -m kneegate.benchmarks.simulate --scenario all --controllers
knee --seed N`, the `t/out` column). Its price is the wave it cannot see coming: when the
first answers all end together, the guess has refused the requests that would have taken
their slots. capacity-drop read 1.074 -> 1.048 at both seeds (over seeds 1-7, mean 1.068 ->
1.051); prompt-growth, whose figure swings by 0.1 from seed to seed, 1.595 -> 1.426 and
1.467 -> 1.373 (seeds 1-7, mean 1.46 -> 1.45); the rest within 0.04 either way. On the
emulator fitted to vLLM's CPU build at 3x (`python -m kneegate.benchmarks.overload --profile
cpu-tiny-avx2 --arms kneegate --loads 3 --seconds 30 --capacity 310 --seed N`, N = 1, 2, 3,
before both this and the busy clock above, and after them), 503s 17 / 2 / 2 -> 2 / 2 / 2,
rejections answered in 1129 / 14 / 5 -> 7 / 3 / 9 ms at p99, goodput the same (230 / 233 /
233 -> 234 / 231 / 233 tokens/s).

The queue's own drain, where it is slower than answers end. While requests sized before
the prompts grew drain, `knee`'s KV edge lets in one new, larger request per two or three
small ones that end; an answer that ends while the limit is under what is in flight frees
no slot at all. The completion rate then promised waits the queue did not keep: on the
simulator's prompt-growth at seed 1 (prompts x4 at 60 s), requests queued at 82-92 s were
dispatched 3.7-3.8 s after arriving where ~0.9 s was predicted, and missed their 4 s
objective; goodput stayed under 0.9 of the oracle's until 112 s. `departures` counts
dispatches out of the queue per second some request was queued (the same EWMA and
debiasing), and the prediction takes the slower of the two rates. Measured
(`python -m kneegate.benchmarks.simulate --scenario all --controllers knee --seed N`, before
-> after): prompt-growth settles in 4 -> 0 s at seed 7 and 52 -> 0 s at seed 1 (over seeds
1-7 in 5 s at most; goodput / oracle mean 1.45 -> 1.51), and reads 1.426 -> 1.587 / 1.373 ->
1.396; totals 14.45 -> 14.60 / 14.36 -> 14.33. gpu-h100 at seed 1 read 0.955 -> 0.926: its
climb took another path (193 -> 389 in one step) and one window at 387, read as a plateau
from 193, cut the limit to 183 for ~20 s; at seeds 2-5 its goodput moved by 0.2% at most.
On the emulator fitted to vLLM's CPU build at 3x (the command above, seeds 1 and 2) goodput
read 231 / 231 -> 228 / 234 tokens/s and the rejections' p99 14 / 28 -> 8 / 25 ms.

A first rule, tried and dropped, queued one round of the limits' slots unpredicted and
guessed past it that each slot frees once a second, as Retry-After does; at the default
budget (a quarter of 2 s) that refused everything past the first round. It also refused what
a cold gateway served in time before: every burst of two or three times the limit onto a
fast engine (a dozen tests, over sockets and in-process).
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
    the weight that empty start still has (after 2 s of 10 completions a second it read
    1.3/s, and Retry-After said 21 s for 30 queued requests): `per_second` divides that
    weight out, as Adam's bias correction does, once `warm` completions have been seen.

    Time with nothing in flight is not counted (`resume`): an idle engine is no slower.
    Counted, the first completion after 20 s idle cut the rate to a quarter, and the
    predicted wait refused most of the next burst as over its objective.

    The busy time starts at the dispatch that made the engine busy, not at the first
    completion. Answers of one length sent together end together: the first 16 on the
    emulator fitted to vLLM's CPU build ended within 0.3 s of each other, 7 s after they
    were sent. Counted from the first of them the rate read 29/s, against the 4-5/s the
    engine served, and the queue took requests it could then not start in time. In a
    traced run at 3x (seed 11 of a script around `benchmarks.overload.run_cell`, 30 s), 4
    of the 6 503s came so, ~1 s after arrival, and put the rejections' p99 at 992 ms;
    counted from the dispatch, such a wave reads 2.7/s (16 answers over 7.3 s, the EWMA
    weighing its end above its start), and the same run had 2 503s and a p99 of 8.5 ms.
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
