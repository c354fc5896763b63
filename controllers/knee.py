"""`knee`: learn the throughput-vs-concurrency curve from live traffic; hold just below its knee.

Per window (closed on a tick; at least `window` seconds and `min_samples` samples, or three
engine scrapes and no sample at all: the engine's counters measure throughput while requests
that take tens of seconds are still running, and waiting for them would stretch a window to
`max_window` just when the engine changes) it records one point: (mean in-flight, output
tokens/s, TTFT p90, TPOT p50). When the engine publishes its counters
(`EngineStats.generation_tokens_total`) the point is the *engine's* (running + waiting, its
tokens/s): instant, and shared by every gateway in front of it; otherwise it is this
gateway's own, throughput by Little's law. Points are kept per level (bins `bin_ratio` wide,
averaged with weight `smoothing`, forgotten after `memory` s). A window right after a move
of the limit measures the move (a burst of prefills), and a window in which the engine
queued measures the plateau at no level: neither becomes a point. One exception: after a
rise, a saturated window whose engine in-flight (its counters) held 0.8 x the gateway's
peak and whose throughput kept pace is one (see linear, below).

The knee is the lowest of:
- room: what the engine holds — its running count when its queue never emptied in the window
  or it preempted (it is full), else running / KV-cache use (when the KV cache would be
  full). Falls at once, rises smoothed (`room_rise`). A queue under `queue_jitter` (1%) of
  the running count is no full engine: beside hundreds running (H100) a prefill or two
  wait for the next step's token budget in most scrapes, and reading that as full
  ratcheted the limit down by 5% a window. Rising slower (`room_rise` 0.25) kept the KV
  cliff's preemptions out of seed 1's TTFT p99 at 3x but slowed the return after a
  capacity change: 0.5 stays.
- the curve's: the saturating model tput = a c / (1 + c/k) fitted by least squares over the
  steady levels (a window whose in-flight stayed near its peak: with bursty demand a window's
  mean in-flight mixes a burst with its drain, and such points bend the fit where the engine
  has no knee) as the line c / tput = 1/a + c/(a k) (a slope within 3 standard errors of 0
  is no bend); the knee is where its elasticity 1 / (1 + c/k) falls to e_min, that of a 20%
  step adding `step_gain`.
- the plateau's, measured rather than fitted (a flat plateau need not bend the model): the
  lowest level from which every step up of at least `pair` to a kept level has elasticity
  ln(tput'/tput) / ln(c'/c) under e_min — the operators' rule, a step that adds too little —
  and from each level within `pair` under it too (one lucky window is no plateau). Only
  levels whose window held in-flight steady count (a draining burst's mean in-flight
  understates the level its throughput came from).
- the last level kept: walking up, the curve ends at the first level whose throughput is
  `decline` under the best so far, or whose Kleinrock power (throughput / (TTFT p90 + TPOT
  p50 x mean output tokens)) is under `power_floor` x the best and whose step up from the
  level of that best did not pay (elasticity under e_min, below); the false second peak
  after a preemption storm beyond is never read. Power alone is no end: on a plateau
  latency grows with concurrency (Little's law), so power halves over any doubling of a
  flat plateau, and on H100 it ended the curve at 128 while goodput kept rising to 500
  within the objectives (each 20% step still adding ~3%). A level measured by the engine's
  counters alone (no request finished in its windows) has no power: its latency is
  unknown, not zero, so it neither sets the best power nor is judged by it. The fit and
  the plateau read only kept levels.

    limit = min(headroom x knee, objective ceiling) x share

The objective ceiling is the highest level measured below the lowest one whose TTFT p90 or
TPOT p50 broke its objective. `share` is this gateway's part of the engine's in-flight
(smoothed, ≤ 1; 1 on a gateway curve), so several gateways hold the engine at
`headroom x knee` together without talking. Headroom is 0.95, not the operators' 0.8: the
knee here is measured continuously and the objectives already guard latency.

Regions:
- low: app-limited (in-flight at the limit for less than `saturation` of the window):
  never grows; still learns points and lowers the limit if the knee falls.
- linear: no knee in sight: grows by x (1 + `climb` x elasticity) per window (slow start,
  doubling while throughput rises in proportion), never past `headroom x knee`; while the
  engine's room is more than two climb steps away, never more than one climb step past the
  highest level measured (the initial limit before any), so every level of the climb is
  measured before the next and a plateau is seen before it is overshot. With the engine's
  counters the window after a rise measures it at once when the engine filled the new level
  (its mean in-flight >= 0.8 x the gateway's peak) and throughput grew from the highest
  level measured with elasticity >= 1/2; one that reads flat may be the rise's burst of
  prefills, and the next window decides. `kneegate demo` (clients 1..96, +8 per 4 s) held
  12 at 15-25 s; now 20 from 20 s, 38-42 at most before the plateau is measured at ~45 s,
  then 18-23 (4 runs of 5; one climbed with demand to 67, the curve's bend at cpu-tiny's
  20-64 is gentle enough for noise to make a step pay). Tried and dropped: holding the
  limit after a rise that
  reads flat (under 1/2: H100 seed 7 0.963 -> 0.954, seed 1 0.948; under e_min: H100 seed
  7 0.954, suite 13.19 -> 13.18, though the demo peaked at 30, not 38-42, in one run);
  any window the engine filled (cpu-tiny
  10x seed 7 1.002 -> 0.911: the burst read a false plateau at 27, the limit held 20-26
  where the oracle holds 34), and the gateway's in-flight for "filled" (a rise 16 -> 32
  reached the engine as a ramp: capacity-drop seed 7 0.846, TTFT p99 4.7 s).
- plateau: holds `headroom x knee`; when the curve's knee binds (not the room), every
  `probe_every` windows one window probes at `knee x (1 + probe_step)`, if that is within
  one climb step of the highest level measured (a fitted knee beyond is an extrapolation:
  the demo's ramp fitted 143 over levels 6..22 and a probe took the limit to 157, where it
  held for 15 s with 80 requests in the engine, against a knee of ~22-28).
- decline: a TTFT/TPOT breach or a drop cuts to `backoff x` in-flight and marks the level
  over the objectives; a full engine (queue, preemptions) caps at `headroom x` its running.

After a change (slower GPU, longer prompts, a noisy neighbour):
- a level whose throughput moves by more than `change` from what the curve holds means the
  engine changed: the curve is forgotten and relearnt from the levels met next, except the
  breaches of the objectives the change cannot have lifted: those measured since the
  contradicted point, and all of them when throughput fell (a slower engine breaks them no
  later). Clearing everything dropped the breach that set the objective ceiling after a 4x
  slowdown, and the climb doubled the limit again: in the wall-clock e2e test it swung
  13 <-> 28 for 20 s (a trace of the old code) and the test failed ~1 run in 6; 10 of 10
  pass with this. Keeping every point measured
  since the contradicted one (9 of 9 runs pass) kept points from before the change measured
  after that one;
- the room falls at once (a full engine caps the limit at `headroom x` its running count in
  the first window that sees its queue or a preemption) and rises smoothed;
- windows keep closing every `window` seconds on the engine's counters, so both happen
  within one window plus the scrape lag (~7 s), not after the requests in flight finish.
- prompt sizes lead (`on_admit`, the gateway's estimate: body bytes / 4): a mean over the
  last ~`admit_recent` admissions is compared with the learned one (~`admit_learned`
  admissions, JSON overhead included; estimates are put into tokens by the ratio of
  finished requests' prompt tokens to admitted estimates). When the footprint of a running
  request, prompt + half the mean answer (a slow mean over every finished request), moves
  past `footprint_jump` (1.3) x the learned one, room, knee estimate and limit fall at once
  by the ratio, sized by the plain mean of the last `admit_last` admissions (the slow mean
  tells a shift, the last few how far: an EWMA over 4 still held a third of the old size
  3-5 admissions in and cut x2.8 where the footprint grew x3.4); the curve is relearnt,
  samples admitted before are no measurement, and neither the room rises nor the gateway's
  share is learnt while requests admitted before it still finish (the engine still holds
  small ones). The next `admit_confirm` (8) admissions size the cut again: if their
  footprint is over `confirm_jump` (1.05) x the one the cut assumed, a second cut by that
  ratio follows (never a rise: probing and the room find space). A cut within `max_window`
  of the last corrects it: requests admitted between the two already have the new size, so
  the drain still waits only for those from before the first. Smaller prompts only rebase:
  probing and the room find the space. A single huge prompt counts at most `admit_clip` x
  the learned size.
- the mean answer length (`_ref_tokens`, in power's delay) learns only from windows with
  samples: a window closed on the engine's counters alone read 0 and halved it (154 and
  later ~0 tokens where answers average 256), and the footprint took it, cutting by the
  prompts' ratio alone.
At the KV-cache edge (one gateway; a request count is too coarse there: 11 large requests
fill L4's cache, 12 start a preemption storm that halves goodput, 10 lose ~9%):
- prompt sizes are read where requests arrive (`on_arrival`) when the gateway reports them,
  not at admission, which under overload lags them by the queue's wait (~5 s at 3x);
- each scrape sets the limit to what runs plus the free KV, (`kv_target` - KV use) x the
  capacity less one answer's growth and `kv_reserve` (half) a new request's peak, over a
  new request's peak (prompt + mean answer); each finish before the next scrape gives back
  its own prompt + answer (a small one frees a fraction of a slot). The capacity, in
  tokens, is learnt as running x (prompt + E[o^2] / 2 E[o]) / KV use while sizes hold
  still and nothing is preempted (a storm reads the cache full with fewer requests), once
  20 requests have finished (the first to finish have short answers). It caps the
  window's limit everywhere, and sets it, above the window's, where the cache is 3/4 full
  (the drain after a rescale: small requests' KV frees for large ones). Estimates are put
  into tokens by a ratio of slow means of admitted estimates and finished prompts, learnt
  only once both hold the same sizes (after a rescale, `admit_learned` finishes).
- the learned prompt size is a plain mean until `admit_learned` admissions (an EWMA from the
  first prompt held a third of it after 20 and read the capacity 10-18% low for minutes).
- a token budget (`fits`, asked by the admission queue for the request at its head): when
  the engine reports its KV cache's size (vLLM's `cache_config_info`: num_gpu_blocks x
  block_size), one more request is admitted only while the in-flight prompts (the gateway's
  estimates, put into tokens: one a token until 20 requests finished with a usage count,
  and for good when clients never ask for usage in streams; bytes / 4 reads high by the
  JSON, so the budget then errs low) plus the answer each holds on average, E[o^2] / 2
  E[o], stay within `kv_budget` (0.95) of it, or of the learned capacity / 1.25 where that is more
  (prefix caching: requests sharing a prefix hold it once; the emulator has no prefix
  cache, so this is tested with literal scrapes only). Each request weighs its own size,
  so the count limit's reserve against large ones goes (`kv_reserve` applies only without
  a budget): the head waits while the requests in flight are large, and more run while
  they are small. The learned capacity alone is no substitute: it reads 10-25% low for a
  minute or more after a start or a rescale (the first answers to finish are short ones, a
  burst's requests are all mid-answer), and a budget on it cost bursts-lowrate up to 0.26
  of the oracle; once settled it strays ~4% above the reported size, and widening the
  budget by that much let capacity-drop preempt (seed 1 settled in 32 s, not at once).
Measured in `benchmarks.simulate` (seeds 7/1/2): after a halving of the engine's speed
goodput stays within 10% of the switching oracle from the change on (seed 2 took 41 s
before the token budget). After prompts grow 4x the cut comes ~1 s after the change and
the drain admits large requests as the small ones' KV frees. With a limit counted in
requests alone settle took 112/0/0 s (10 of 14 seeds within 15 s): at the new level one
request is ~9% of the cache, a limit of 10 where the oracle holds 11 lost ~9%, and 10-11
unusually large prompts stormed the cache. With the token budget: 0 s at all 14 seeds
(1-14), goodput after the change 1.11-1.40 x the switching oracle's. `kv_budget` 0.93 and
0.95 both settle everywhere; 0.97 fails 2 of 14 (seeds 8, 12: 100, 105 s). The budget costs
H100 ~0.6% (seeds 1, 3-6: 0.940-0.946 against 0.944-0.954 without; its climb from 16 to
~600, 30-50 s at 0.70-0.78 of the oracle, is the larger loss there).
Tried and dropped for the budget: the learned capacity in place of the reported one
(bursts-lowrate seed 5 0.767, seed 3 0.796: it reads 25% low early); a margin of z
standard deviations of the held answers under `kv_target` in place of a flat share (z 3:
H100 unchanged, bursts and mixed over 4 seeds 7.785 -> 7.695).
Tried and dropped: a KV target lowered 0.02 per preempting scrape and raised a tenth of
that per clean one (8-seed settles 56/76/0 at 7/1/2); a capacity estimate that falls 4x
faster than it rises (seeds 7/1/2 0/96/0, 6 and 8 worse); `footprint_jump` 1.5 (48/86/inf
at 7/1/2); a new request's peak x1.1-1.3 (6, 5, 4 of 8 seeds within 15 s); `kv_target`
0.95 without reserve (steady-3x seed 7 0.931), 0.99-1.0 with reserve 0.5 (H100 seed 7
0.919-0.941); no answer's-growth term (steady-3x seed 7 0.948); the KV edge setting the
limit wherever the room binds (H100 seed 2: a queue of prefills at 37% KV read as room
for 500 more, a false knee at 128 followed: 0.673). Earlier: a correction by the mean of
the next 8 admissions after a cut with the answer length still broken (it over-cut:
150 s); a harder cut while the KV cache per running request grows (x 0.7 per window:
114 s); no room rise past a running count that preempted within `objective_memory`
(8-seed goodput 1.43 -> 1.40; seed 7 settles 0 but seed 1 never); headroom
1 - 0.35/sqrt(knee) under 0.95 for few requests (seeds 7/1/2
83/92/98 s); a room rise weighted by running/20 (no gain); rescaling with the
tokens-per-estimate ratio frozen while sizes shift (the admitted mean leads the finished
one by the drain: no measurable gain, 1.428 -> 1.429); a confirmation over 12 admissions
(1.40) or with no margin (seed 7 never).
Parameters and ranges are on `KneeConfig`.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any

from pydantic import Field

from kneegate.controllers.base import (
    BaseControllerConfig,
    EngineStats,
    LimitController,
    Sample,
    is_distress,
)
from kneegate.controllers.window import Summary, Window

__all__ = ["Knee", "KneeConfig", "Point"]


class KneeConfig(BaseControllerConfig):
    headroom: float = Field(0.95, gt=0.1, le=1.0, description="limit = headroom x knee")
    step_gain: float = Field(
        0.02, ge=0.005, le=0.5, description="a 20% step adding less throughput is past the knee"
    )
    climb: float = Field(1.0, gt=0, le=4, description="most growth per window, x (1 + climb)")
    decline: float = Field(0.2, gt=0, lt=0.9, description="throughput drop that ends the curve")
    power_floor: float = Field(
        0.5, ge=0, lt=1, description="power under this x the best ends a curve that stopped paying"
    )
    pair: float = Field(
        1.15, gt=1.05, le=2, description="levels this far apart measure a step's gain"
    )
    probe_every: int = Field(4, ge=1, le=1000, description="windows between upward probes")
    probe_step: float = Field(0.1, gt=0, le=2, description="a probe goes this far above the knee")
    backoff: float = Field(0.9, ge=0.5, lt=1, description="cut on breach or drop")
    room_rise: float = Field(
        0.5, gt=0, le=1, description="weight of a higher room reading (a lower one counts at once)"
    )
    queue_jitter: float = Field(
        0.01, ge=0, le=0.5, description="an engine queue under this x running is no full engine"
    )
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
    window: float = Field(5.0, gt=0, le=600, description="minimum window length, seconds")
    min_samples: int = Field(8, ge=1, le=10_000, description="samples before a window closes")
    max_window: float = Field(30.0, gt=0, le=3600, description="a window closes by this age")
    admit_recent: int = Field(
        20, ge=2, le=10_000, description="admissions averaged as the recent prompt size"
    )
    admit_learned: int = Field(
        200, ge=2, le=100_000, description="admissions averaged as the learned prompt size"
    )
    admit_last: int = Field(
        4, ge=1, le=1000, description="admissions averaged to size a shift once one is seen"
    )
    admit_clip: float = Field(
        8.0, gt=1, le=1000, description="an admission counts at most this x the learned size"
    )
    admit_confirm: int = Field(
        8, ge=1, le=1000, description="admissions after a rescale that size it again"
    )
    confirm_jump: float = Field(
        1.05, ge=1.0, le=10, description="footprint ratio, confirmed to cut, that cuts deeper"
    )
    footprint_jump: float = Field(
        1.3, gt=1.05, le=10, description="footprint ratio, recent to learned, that rescales"
    )
    kv_target: float = Field(
        0.98, gt=0.1, le=1.0, description="KV-cache use the KV-edge limit admits up to"
    )
    kv_reserve: float = Field(
        0.5,
        ge=0,
        le=4,
        description="new requests' peaks kept free below kv_target (without a token budget)",
    )
    kv_budget: float = Field(
        0.95, ge=0, le=1.0, description="KV-cache share in-flight requests' sizes may fill (0: off)"
    )
    kv_learn: float = Field(
        0.05, gt=0, le=1, description="weight of one scrape in the KV capacity estimate"
    )


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

    def as_dict(self) -> dict[str, Any]:
        return {
            "concurrency": round(self.concurrency, 2),
            "throughput": round(self.throughput, 2),
            "ttft_p90": self.ttft_p90,
            "tpot_p50": self.tpot_p50,
        }


def _line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of ys on xs; (1, 0) unless the slope is clear."""
    n = len(xs)
    if n < 2:
        return 1.0, 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if max(xs) < 1.5 * min(xs):
        return 1.0, 0.0  # too narrow a range to tell a bend from noise
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    a = my - b * mx
    res = sum((y - a - b * x) ** 2 for x, y in zip(xs, ys, strict=True))
    # a slope within 3 standard errors of zero is noise: the curve is still linear
    return (a, b) if b * b * sxx * (n - 2) > 9 * res else (1.0, 0.0)


def _gain(p: Point, q: Point) -> float:
    """Elasticity d ln tput / d ln c between two levels of the curve."""
    return math.log(q.throughput / p.throughput) / math.log(q.concurrency / p.concurrency)


def _blend(old: float | None, new: float | None, w: float) -> float | None:
    if old is None or new is None:
        return new if new is not None else old
    return old * (1 - w) + new * w


class Knee(LimitController):
    name = "knee"
    _GROUNDED_KV = 0.25  # KV use from which running / use is a reading, not a guess
    _SHARED = 1.25  # learned over reported KV capacity beyond noise: a shared prefix

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
        # the engine's capacity in sequences: running / KV use, or running when queued
        self._room = math.inf
        # the last room reading was measured, not extrapolated: from a queue, or from a KV
        # cache at least `_GROUNDED_KV` full (1 running in 0.06% of it "reads" room for 1600)
        self._room_grounded = False
        self._moved = True  # the last window moved the limit by more than a bin (start: from 0)
        self._moved_up = False  # and raised it
        self._share_est: float | None = None
        self._probing = False  # this window's target is a probe above the knee
        self._now = -math.inf  # the last tick's time
        # prompt sizes at admission (estimates: only their ratios mean anything)
        self._admits = 0  # prompts noted (arrivals, or admissions without them)
        self._admitted = 0
        self._p_recent = 0.0  # EWMA over ~admit_recent admissions: detects a shift
        # the last admit_last admissions, unweighted: measures a shift's size (an EWMA
        # still holds the old size when the slow mean tells the shift, 3-5 admissions in)
        self._last: deque[float] = deque(maxlen=self.cfg.admit_last)
        self._p_learned = 0.0  # EWMA over ~admit_learned, rebased after a rescale
        # slow means never rebased, of admitted estimates and of finished requests' prompt
        # tokens (the engine's count): their ratio puts estimates into tokens
        self._p_slow = 0.0
        self._p_done, self._dones = 0.0, 0
        self._out_done, self._outs = 0.0, 0  # slow mean of every finished request's answer
        self._out_sq = 0.0  # and of its square
        self._rescaled_at = -math.inf  # the last rescale by footprint
        self._dones_since = 0  # requests finished since it
        self._confirm: list[float] | None = None  # admissions since it, until admit_confirm
        self._old_finish = -math.inf  # last finish of a request admitted before it
        self._arrivals_seen = False  # the gateway reports arrivals: admissions are not read
        self._kv_tokens: float | None = None  # the engine's KV capacity, in prompt tokens
        self._kv_limit: float | None = None  # in-flight that fills it to kv_target, now
        # the last scrape's (time, running, free KV tokens, a new request's peak tokens)
        self._kv_scrape: tuple[float, float, float, float] | None = None
        self._finished: deque[tuple[float, float]] = deque()  # (finished_at, KV tokens freed)
        self._k = 1.0  # engine prompt tokens per admitted estimate, learnt while sizes hold
        self._kv_prev: EngineStats | None = None
        self._kv_use = 0.0  # the last scrape's KV use
        self._kv_capacity: float | None = None  # the KV cache's size, as the engine reports it

    @property
    def limit(self) -> int:
        base = super().limit
        kv = self._kv_limit
        if kv is None or not self._alone():
            return base
        # the KV edge caps the window's limit, and sets it (above the window's: while small
        # requests sized before a rescale drain, their KV frees for the new sizes) where the
        # cache is what holds the engine back, 3/4 full; below that a level never measured
        # would skip the climb (H100: a queue of prefills at 37% KV read as room for 500)
        lift = self._kv_use >= 0.75
        kv = min(kv, self.ceiling()) if lift else min(kv, base)
        return max(self.cfg.min_limit, min(self.cfg.max_limit, math.floor(kv)))

    def fits(self, inflight: int, inflight_tokens: int, tokens: int) -> bool:
        """The token budget: one more request fits while the in-flight prompts (the gateway's
        estimates, put into tokens) plus the answer each running request holds on average,
        E[o^2] / 2 E[o], stay within `kv_budget` of the KV cache the engine reports. Off
        (everything fits) until the engine reports its size and an answer has finished, and
        with several gateways (each sees only its own requests)."""
        budget = self._token_budget()
        if budget is None or not self._alone() or self._out_done <= 0:
            return True
        need = self._k * (inflight_tokens + tokens) + (inflight + 1) * self._held_answer()
        return need <= budget

    def _held_answer(self) -> float:
        """Answer tokens a running request holds on average: E[o^2] / 2 E[o], as long answers
        stay longer (half the mean is 8% short for answers uniform in 0.5-1.5x the mean)."""
        return self._out_sq / (2 * self._out_done)

    def _token_budget(self) -> float | None:
        """`kv_budget` x the KV cache, in tokens as `fits` counts them; None: no budget. The
        size the engine reports, or more where the learned capacity (running x footprint /
        KV use) reads more than `_SHARED` x that: with prefix caching, requests that share a
        prefix hold it once, so the cache holds more of them than their prompts add up to.
        Once settled the learned one strays some 4% above the reported size in the simulator
        (no prefix cache there), and a budget widened by that much let capacity-drop's slow
        phase preempt (seed 1 settled in 32 s, not at once): only the excess counts."""
        if self._kv_capacity is None or self.cfg.kv_budget <= 0:
            return None
        shared = (self._kv_tokens or 0.0) / self._SHARED
        return self.cfg.kv_budget * max(self._kv_capacity, shared)

    def _alone(self) -> bool:
        """This gateway holds (nearly) all the engine's in-flight requests."""
        return (self._share_est or 1.0) >= 0.9

    # --- inputs -----------------------------------------------------------------------

    def on_arrival(self, prompt_tokens: int) -> None:
        """The leading signal, read where requests join the queue: under overload the queue
        ahead delays the same sizes at admission by its wait (~5 s at 3x)."""
        self._arrivals_seen = True
        self._note_prompt(prompt_tokens)

    def on_admit(self, prompt_tokens: int) -> None:
        """The leading signal from admissions, for a gateway that does not report arrivals.
        Admissions are also the population whose prompts finish: their slow mean, beside
        finished requests' prompt tokens, puts estimates into tokens (arrivals include the
        shed and timed out, and lead finishes by the queue and a lifetime)."""
        self._admitted += 1
        p = float(max(prompt_tokens, 1))
        self._p_slow += (p - self._p_slow) / min(self._admitted, self.cfg.admit_learned)
        if not self._arrivals_seen:
            self._note_prompt(prompt_tokens)

    def _note_prompt(self, prompt_tokens: int) -> None:
        """When recent prompts' KV footprint (prompt + mean output) moves past
        `footprint_jump` x the learned one, the room and limit scale at once."""
        c, p = self.cfg, float(max(prompt_tokens, 1))
        self._admits += 1
        if self._admits == 1:
            self._p_recent = self._p_learned = p
            self._last.append(p)
            return
        # one huge prompt among small ones is no shift: a single one moves the means little
        p = min(p, c.admit_clip * self._p_learned)
        # running means until their windows fill: an EWMA from the first prompt holds a
        # third of it after 20 and biased the learned size (and the KV capacity) for minutes
        self._p_recent += (p - self._p_recent) / min(self._admits, c.admit_recent)
        self._last.append(p)
        if self._confirm is not None and self._confirm_cut(p):
            return
        if self._admits < c.admit_recent:
            self._p_learned = self._p_recent  # too few to tell a shift from the start
            return
        r = self._footprint_ratio(self._p_recent)
        if r > c.footprint_jump:
            # the slow mean tells a shift; the last few admissions how far it went
            self._rescale(max(r, self._footprint_ratio(self._p_last())))
        elif r < 1 / c.footprint_jump:
            self._p_learned = self._p_recent  # smaller prompts: probing finds the room again
        else:
            self._p_learned += (p - self._p_learned) / min(self._admits, c.admit_learned)

    def _confirm_cut(self, p: float) -> bool:
        """The admissions after a cut size it again: a cut sized by a few admissions (3-5,
        some still from before the shift) is often short. Only ever deeper."""
        assert self._confirm is not None
        self._confirm.append(p)
        if len(self._confirm) < self.cfg.admit_confirm:
            return False
        size = sum(self._confirm) / len(self._confirm)
        self._confirm = None
        r = self._footprint_ratio(size)
        if r <= self.cfg.confirm_jump:
            return False
        self._rescale(r, size)
        return True

    def _p_last(self) -> float:
        return sum(self._last) / len(self._last)

    def _footprint_ratio(self, recent: float) -> float:
        """Recent over learned (prompt + mean output): output tokens from samples, prompts
        put into the engine's tokens by the ratio of finished prompts to admitted estimates."""
        k = self._p_done / self._p_slow if self._p_done > 0 and self._p_slow > 0 else 1.0
        k = max(0.25, min(4.0, k))  # read live: it damps a short run of large prompts
        out = self._out_done / 2  # a running request holds half its answer, on average
        return (k * recent + out) / (k * self._p_learned + out)

    def _rescale(self, r: float, size: float | None = None) -> None:
        """Each request now holds r x the KV it held: room and limit fall by r now, and the
        curve is relearnt; samples admitted before measure a level the limit left. `size`:
        the prompt size a confirmation measured (no further confirmation follows it)."""
        self._set_limit(max(1.0, self._limit / r))
        self._kv_limit = self._kv_scrape = None  # the next scrape sizes it anew
        if math.isfinite(self._room):
            self._room /= r
        if self.knee_estimate is not None:
            self.knee_estimate /= r
        self._curve.clear()
        self._moved, self._moved_up = True, False
        # a second cut while requests from before the first still drain corrects its size:
        # those admitted between the two already have the new size; the old ones are older
        if self._now - self._rescaled_at > self.cfg.max_window:
            self._rescaled_at = self._now
            self._dones_since = 0
        self._last_cut = self._old_finish = self._now
        self._p_learned = self._p_recent = size or max(self._p_recent, self._p_last())
        self._confirm = [] if size is None else None

    def _on_sample(self, s: Sample) -> None:
        if s.admitted_at < self._rescaled_at:
            self._old_finish = max(self._old_finish, s.finished_at)
        self._note_finish(s)
        if s.prompt_tokens > 0:
            self._dones += 1
            w = 1 / min(self._dones, self.cfg.admit_learned)
            self._p_done += (s.prompt_tokens - self._p_done) * w
        if s.output_tokens > 0:  # counted apart: a gateway may not know the prompt's tokens
            self._outs += 1
            w = 1 / min(self._outs, self.cfg.admit_learned)
            self._out_done += (s.output_tokens - self._out_done) * w
            self._out_sq += (s.output_tokens**2 - self._out_sq) * w
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
        self._kv_edge(stats)

    def _kv_edge(self, st: EngineStats) -> None:
        """The in-flight count that fills the KV cache to the KV target, from this scrape: what
        runs now, plus the free KV (less one answer's growth) over a new request's peak
        footprint (prompt + answer). Requests waiting in the engine hold no KV yet but will:
        they are in-flight, so they take their part of the free KV (no `+ waiting`). The
        capacity is learnt while sizes hold still and nothing is preempted."""
        prev, c = self._kv_prev, self.cfg
        self._kv_prev = st
        if st.kv_capacity_tokens > 0:  # NaN (not reported) is not
            self._kv_capacity = st.kv_capacity_tokens
        p, out, kv = self._tokens(self._p_learned), self._out_done, st.kv_cache_usage
        if st.running <= 0 or kv <= 0 or p <= 0 or out <= 0:
            return
        preempted = prev is not None and st.preemptions_total > prev.preemptions_total
        learn = self._settled(st.at) and self._k_ready() and kv >= 0.3 and st.waiting == 0
        if learn and not preempted:
            cap = st.running * (p + self._held_answer()) / kv
            self._kv_tokens = _blend(self._kv_tokens, cap, c.kv_learn)
        if self._kv_tokens is None:
            return
        new = p + out
        # the token budget weighs each request's own size: no reserve against large ones
        reserve = 0.0 if self._token_budget() is not None else c.kv_reserve
        free = (c.kv_target - kv) * self._kv_tokens - out - reserve * new
        self._kv_scrape = (st.at, st.running, free, new)
        self._kv_use = kv
        self._update_kv_limit()

    def _note_finish(self, s: Sample) -> None:
        """A finished request frees its prompt and answer: room for new ones before the next
        scrape shows it (a small one frees a fraction of a large one's room)."""
        self._dones_since += 1
        if self._k_ready() and self._p_done > 0 and self._p_slow > 0:
            self._k = max(0.25, min(4.0, self._p_done / self._p_slow))
        prompt = s.prompt_tokens or self._tokens(self._p_learned)
        self._finished.append((s.finished_at, prompt + s.output_tokens))
        while self._finished and self._finished[0][0] < s.finished_at - self.cfg.max_window:
            self._finished.popleft()
        self._update_kv_limit()

    def _update_kv_limit(self) -> None:
        if self._kv_scrape is None:
            return
        at, running, free, new = self._kv_scrape
        since = [fp for t, fp in self._finished if t > at]
        self._kv_limit = running - len(since) + math.floor((free + sum(since)) / new)

    def _k_ready(self) -> bool:
        """Tokens per estimate are read from two slow means, of admitted estimates and of
        finished prompts, which agree only once both hold the same sizes: 20 finishes at
        the start, a full `admit_learned` after a rescale (the admitted mean leads by the
        requests in flight: 0.8 where it is 1, after a 4x jump)."""
        c = self.cfg
        need = c.admit_learned if math.isfinite(self._rescaled_at) else c.admit_recent
        return self._dones_since >= need

    def _settled(self, now: float) -> bool:
        """No rescale lately and no request sized before it still finishing."""
        return now > self._old_finish + self.cfg.window and (
            now > self._rescaled_at + self.cfg.max_window
        )

    def _tokens(self, estimate: float) -> float:
        """A prompt estimate in the engine's tokens (finished prompts over admitted estimates)."""
        return self._k * estimate

    def _on_tick(self, now: float, inflight: int) -> None:
        self._now = now
        w = self._open(now)
        w.tick(now, inflight, self.limit)
        c = self.cfg
        # engine counters measure throughput without waiting for requests to finish
        quorum = 0 if len(w.stats) >= 3 else c.min_samples
        if w.ready(now, c.window, quorum, c.max_window):
            self._window = None
            self._close(w.summary(now))

    def _open(self, now: float) -> Window:
        if self._window is None:
            self._window = Window(start=now, last_tick=now)
        return self._window

    # --- one closed window --------------------------------------------------------------

    def _close(self, w: Summary) -> None:
        c = self.cfg
        bad = w.drops > 0 or self._over_objective(w)
        level, _ = self._level(w)
        # the window after a move measures the move (a burst of prefills), not the level
        # a full engine's level counts its queue: its throughput is the plateau's, at no level
        measured = w.samples or w.engine_throughput is not None
        if measured and (bad or not self._moved or self._climbed(w, level)) and not self._queued(w):
            self._learn(w, level, bad)
        self._measure_room(w)
        before = self._limit
        self._probing = False
        target = self._target(level) * self._share(w, level)
        if bad:
            # decrease needs no proof of load: cut below what was actually in flight
            cut = min(self._limit, max(w.inflight, 1.0)) * c.backoff
            self._set_limit(max(1.0, min(target, cut)))
        elif w.saturated >= c.saturation and not self._queued(w):
            # demand exceeds the limit and the engine keeps up: grow, at most one climb step
            # a probe goes to its level at once: on a flat plateau the fit's elasticity is ~0
            # and a climb step would never leave the knee
            grow = target if self._probing else self._grow(level)
            self._set_limit(max(1.0, min(target, grow)))
        else:
            # app-limited or queued: hold — there is no evidence the engine takes more
            self._set_limit(max(1.0, min(self._limit, target)))
        self._moved = abs(self._limit - before) > self.cfg.bin_ratio * before
        self._moved_up = self._moved and self._limit > before
        if self._limit < before:
            self._last_cut = w.end  # later samples admitted before this measure a level left

    def _climbed(self, w: Summary, level: float) -> bool:
        """The window after a rise measures the new level when the engine's counters show it
        kept pace: in-flight filled the level at once and throughput grew from the highest
        level measured with elasticity of at least 1/2. A window after a rise that reads
        flat may be the rise's burst of prefills (in the simulator, cpu-tiny at 10x read a
        false plateau at 27 that held the limit at 20-26 where the oracle's is 34): the next
        window decides, as for any move."""
        tput = w.engine_throughput
        top = max(self._curve.values(), key=lambda p: p.concurrency, default=None)
        if not (self._moved_up and self._engine_mode and tput and top is not None):
            return False
        full = (w.engine_inflight or 0.0) >= 0.8 * w.max_inflight
        if not full or w.saturated < self.cfg.saturation or level < self.cfg.pair * top.concurrency:
            return False
        return math.log(tput / top.throughput) >= 0.5 * math.log(level / top.concurrency)

    def _share(self, w: Summary, level: float) -> float:
        """This gateway's part of the engine's in-flight (1 on a gateway curve), smoothed;
        learnt only from settled windows, as scrapes lag a move by seconds."""
        now = min(1.0, w.inflight / level) if level > 0 else 1.0
        # nor while requests sized before a rescale drain (in-flight falls under the
        # engine's lagging scrape: the share would read low with one gateway alone)
        draining = self._old_finish >= w.start
        if self._share_est is None or not (self._moved or draining):
            self._share_est = _blend(self._share_est, now, self.cfg.smoothing)
        return self._share_est or now

    def _grow(self, level: float) -> float:
        step = 1 + self.cfg.climb
        grow = self._limit * (1 + self.cfg.climb * self._elasticity(level))
        if self._room <= step * step * self._limit:
            return grow  # the engine's room is within two steps: it stops the climb
        # else at most one step past the highest level measured (the initial limit before
        # any): doublings never measured overshoot a flat plateau
        return max(self._limit, min(grow, step * self._top()))

    def _top(self) -> float:
        """The highest level measured (the initial limit before any)."""
        return max((p.concurrency for p in self._curve.values()), default=self.cfg.initial)

    def _queued(self, w: Summary) -> bool:
        """The engine is full: its queue never emptied in the window, or it preempted.

        A queue under `queue_jitter` x the running count is the scheduler's jitter (a prefill
        waiting for the next step's token budget), not a full engine."""
        waiting, running = w.engine_waiting or 0.0, w.engine_running or 0.0
        full_queue = waiting > self.cfg.queue_jitter * running
        return full_queue or (w.engine_preempted or 0.0) > 0

    def _measure_room(self, w: Summary) -> None:
        """The engine's own capacity: what runs when its queue forms, or running / KV use."""
        run, kv = w.engine_running, w.engine_kv
        if run is None or run <= 0:
            return
        queued = self._queued(w)
        room = run if queued else (run / kv if kv and kv > 0 else math.inf)
        self._room_grounded = queued or (kv is not None and kv >= self._GROUNDED_KV)
        if room > self._room and self._old_finish >= w.start:
            return  # the engine still holds requests sized before a rescale: no rise yet
        # fast down (a change is news), slow up (one window may be a lucky mix of lengths)
        up = _blend(self._room, room, self.cfg.room_rise) if math.isfinite(self._room) else room
        self._room = min(room, up or room)

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

    def _learn(self, w: Summary, level: float, bad: bool) -> None:
        tput = w.engine_throughput if self._engine_mode else w.throughput
        if level <= 0 or tput is None:
            return
        a = self.cfg.smoothing
        if w.samples:  # a window closed on the engine's counters alone has no answers
            self._ref_tokens = _blend(self._ref_tokens or None, w.output_tokens_mean, a) or 0.0
        self._forget(w.end)
        # a level, not a ramp: in-flight stayed near its peak through the window
        steady = w.inflight >= 0.8 * w.max_inflight
        key = round(math.log(level) / math.log1p(self.cfg.bin_ratio))
        near = self._nearest(level)
        if near is not None and abs(tput - near.throughput) > self.cfg.change * near.throughput:
            self._forget_change()  # the engine changed since `near` was measured
        old = self._curve.get(key)
        if old is None:
            self._curve[key] = Point(level, tput, w.ttft_p90, w.tpot_p50, bad, w.end, steady)
            return
        old.concurrency = old.concurrency * (1 - a) + level * a
        old.throughput = old.throughput * (1 - a) + tput * a
        old.ttft_p90 = _blend(old.ttft_p90, w.ttft_p90, a)
        old.tpot_p50 = _blend(old.tpot_p50, w.tpot_p50, a)
        if bad or w.samples:  # no request finished, no latency read: no news on objectives
            old.over_objective = bad
        old.at = w.end
        old.steady = steady

    def _nearest(self, level: float) -> Point | None:
        """The stored point closest to `level`, if within two bins of it."""
        best = min(self._curve.values(), key=lambda p: abs(p.concurrency - level), default=None)
        if best is None or abs(best.concurrency - level) > 2 * self.cfg.bin_ratio * level:
            return None
        return best

    def _forget_change(self) -> None:
        """The engine changed since a stored point (`near`) was measured: the throughput
        curve is stale, but no breach of the objectives is dropped with it; marks age out
        after `objective_memory`. Clearing the whole curve dropped the breach that set the
        objective ceiling after a 4x slowdown and the climb doubled the limit again (the e2e
        test's 13 <-> 26). Keeping only the breaches measured since `near` (or all when
        throughput fell) was not enough: in the 1 s windows of that test a window read +35%
        against the breach point itself (`near`, a transition's low reading) and dropped it
        (16 <-> 29 for 20 s in one CI run); a breach is lifted by a clean window with answers
        at its level, or by time, not by a throughput reading."""
        for key, p in list(self._curve.items()):
            if not p.over_objective:
                del self._curve[key]

    def _forget(self, now: float) -> None:
        for key in [k for k, p in self._curve.items() if now - p.at > self.cfg.memory]:
            del self._curve[key]
        for p in self._curve.values():
            if now - p.at > self.cfg.objective_memory:
                p.over_objective = False  # old news: let probes look again

    # --- the knee and the limit -----------------------------------------------------------

    def _target(self, level: float) -> float:
        """Where the curve level should go: headroom below the knee, under the ceiling."""
        knee = self._knee_now()
        if knee is None:
            return self.ceiling()
        self.knee_estimate = knee if self._published(knee) else None
        self._since_probe += 1
        # a probe obeys the climb's bound, one climb step past the highest level measured:
        # the demo's ramp fitted a knee of 143 over levels 6..22 and a probe went to 157
        probe = knee * (1 + self.cfg.probe_step)
        near = probe <= (1 + self.cfg.climb) * self._top()
        if self._since_probe >= self.cfg.probe_every and self._room > knee and near:
            self._since_probe = 0  # one cheap window above a throughput knee: it may have moved
            self._probing = True
            return min(probe, self.ceiling())
        return min(self.cfg.headroom * knee, self.ceiling())

    def _published(self, knee: float) -> bool:
        """An estimate worth showing: within a climb step of the levels measured, or a room
        reading that was measured (an idle engine's extrapolated room is no knee)."""
        return knee <= (1 + self.cfg.climb) * self._top() or (
            knee >= self._room and self._room_grounded)

    def _knee_now(self) -> float | None:
        fit, _ = self.knee()
        knee = min(fit or math.inf, self._room)
        return knee if math.isfinite(knee) else None

    def ceiling(self) -> float:
        """Highest level measured below the lowest level that broke an objective."""
        bad = [p.concurrency for p in self._curve.values() if p.over_objective]
        if not bad:
            return math.inf
        lowest_bad = min(bad)
        ok = [p.concurrency for p in self._curve.values() if p.concurrency < lowest_bad]
        return max(ok) if ok else lowest_bad * self.cfg.backoff

    def knee(self) -> tuple[float | None, bool]:
        """(knee level of the throughput curve, still rising at the top); None: none seen yet.

        Fits the saturating curve tput = a c / (1 + c/k), i.e. the line c / tput = 1/a + c/(a k)
        by least squares over the kept points, and returns the level where its elasticity
        d ln tput / d ln c = 1 / (1 + c/k) falls to that of a 20% step adding `step_gain`;
        never above the plateau's measured start (`_flat`) nor the last level kept before a
        decline.
        """
        kept, declined = self._kept()
        top = kept[-1].concurrency if kept and declined else math.inf
        a, b = self._fit(kept)
        knee = min(top, self._flat(kept))
        if b > 0 and a > 0:
            # a fit whose knee lies under every level measured says they are all on the
            # plateau, not where it starts: no lower than the lowest of them
            fitted = max(a / b * (1 / self._e_min() - 1), kept[0].concurrency)
            knee = min(fitted, knee)
        if not math.isfinite(knee):
            return None, True
        return knee, not declined and knee >= kept[-1].concurrency

    def _e_min(self) -> float:
        """The elasticity of a 20% step that adds `step_gain`: below it, a step does not pay."""
        return math.log1p(self.cfg.step_gain) / math.log(1.2)

    def _flat(self, kept: list[Point]) -> float:
        """The lowest kept level from which no step up of `pair` or more to a kept level pays.

        Measured, not fitted: on a flat plateau the saturating model need not bend, but a
        pair of levels says directly that the higher one buys nothing.
        """
        e_min = self._e_min()
        # a draining window's mean in-flight understates the level its throughput came from
        kept = [p for p in kept if p.steady]
        pair = self.cfg.pair
        for p in kept:
            # p and the levels just under it, so one lucky window at p is not a plateau
            near = [r for r in kept if p.concurrency / pair < r.concurrency <= p.concurrency]
            above = [q for q in kept if q.concurrency >= pair * p.concurrency]
            if above and all(_gain(r, q) < e_min for r in near for q in above):
                return p.concurrency
        return math.inf

    def _elasticity(self, level: float) -> float:
        """d ln tput / d ln c of the fitted curve at `level`; 1 (linear) without a fit."""
        a, b = self._fit(self._kept()[0])
        return max(0.0, min(1.0, a / (a + b * level))) if b > 0 and a + b * level > 0 else 1.0

    def _kept(self) -> tuple[list[Point], bool]:
        # a draining window's mean in-flight understates the level its throughput came from
        pts = sorted((p for p in self._curve.values() if p.steady), key=lambda p: p.concurrency)
        kept = self._until_decline([p for p in pts if p.throughput > 0])
        return kept, len(kept) < len(pts)

    @staticmethod
    def _fit(pts: list[Point]) -> tuple[float, float]:
        if len(pts) < 3:
            return 1.0, 0.0  # two points are one noisy step: no curve yet
        return _line([p.concurrency for p in pts], [p.concurrency / p.throughput for p in pts])

    def _until_decline(self, pts: list[Point]) -> list[Point]:
        kept: list[Point] = []
        best_x = 0.0
        best: tuple[float, Point] | None = None  # the highest power so far, and its level
        for p in pts:
            power = self._power(p)
            if p.throughput < best_x * (1 - self.cfg.decline):
                break  # past the decline; a second peak beyond is a false one
            if (
                power is not None
                and best is not None
                and power < best[0] * self.cfg.power_floor
                and _gain(best[1], p) < self._e_min()
            ):
                break  # latency grew far faster than throughput, which the step did not buy
            kept.append(p)
            best_x = max(best_x, p.throughput)
            if power is not None and (best is None or power > best[0]):
                best = (power, p)
        return kept

    def _power(self, p: Point) -> float | None:
        """Kleinrock's power; None for a level measured by the engine's counters alone (no
        request finished in its window), whose latency is unknown, not zero."""
        if p.ttft_p90 is None and p.tpot_p50 is None:
            return None
        delay = (p.ttft_p90 or 0.0) + (p.tpot_p50 or 0.0) * max(self._ref_tokens, 1.0)
        return p.throughput / delay if delay > 0 else None

    def fit(self) -> dict[str, Any]:
        """The learned curve as the live page draws it; reads, never changes, the state.

        `kept`: the levels the knee is read from (steady, before any decline); `decline_from`:
        the first steady level past the decline (null: none); `intercept`, `slope`: the fitted
        line c / tput = intercept + slope x c, i.e. tput = c / (intercept + slope x c), null
        when the kept levels do not bend it; `curve_knee`: the knee of the throughput curve
        (fit, plateau, decline), `room`: the engine's (null: not measured); the lower of the
        two is the knee estimate while it is published. `over_objective`: levels marked."""
        kept, declined = self._kept()
        a, b = self._fit(kept)
        fitted = a > 0 and b > 0
        pts = self._curve.values()
        # _kept's prefix of these; `declined` also counts a level that measured no throughput
        past = sorted(p.concurrency for p in pts if p.steady and p.throughput > 0)[len(kept):]
        bad = sorted(p.concurrency for p in pts if p.over_objective)
        return {
            "kept": [round(p.concurrency, 2) for p in kept],
            "decline_from": round(past[0], 2) if declined and past else None,
            "intercept": a if fitted else None,
            "slope": b if fitted else None,
            "curve_knee": self.knee()[0],
            "room": self._room if math.isfinite(self._room) else None,
            "over_objective": [round(c, 2) for c in bad],
        }

    def state(self) -> dict[str, Any]:
        pts = sorted(self._curve.values(), key=lambda p: p.concurrency)
        return {
            **super().state(),
            "curve": [p.as_dict() for p in pts],
            "fit": self.fit(),
            "curve_of": "engine" if self._engine_mode else "gateway",
            "kv_capacity_tokens": self._kv_capacity,
            "token_budget": self._token_budget(),
        }
