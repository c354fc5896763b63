"""`Knee`: the region policy that turns the parts' readings into one limit per window.

A window closes on a tick once `window` s old with `min_samples` samples, or with three
engine scrapes and no sample at all (the engine's counters measure throughput while long
requests still run), or at `max_window`. Each closed window:

    bad     = a drop, or TTFT p90 > ttft_objective, or TPOT p50 > tpot_objective (in a
            window with no answer in it, held at the limit, not after a rise nor through
            the engine's own: the engine's TPOT, `Summary.engine_tpot`)
    learn   the curve's point, unless the window measured a move of the limit (the burst
            of prefills after it), or the engine's in-flight rose by more than a bin
            through it (the KV edge lifted the limit: a move too), or the engine queued
            (the plateau at no level); after a rise, a window whose last scrape filled
            0.8 x the gateway's peak and read throughput grown with elasticity >= 1/2 from
            the highest level measured (before any, from the last window's last scrape)
            counts, as that scrape's point (the window's means mix the late scrapes from
            before the rise), marked as one scrape: no plateau's foot (`Curve._flat`)
    room    re-read (`Room.measure`); app-limited, a lower reading is no news
    share   learnt (`Share.update`), not while app-limited
    knee    = min(curve knee, room)          (published only within a climb step of the
                                              levels measured, or from a grounded room)
    target  = min(headroom x knee, ceiling) x share          (ceiling x share: no knee)
    probe   every `probe_every` windows with a knee, if the curve's knee binds (room >
            knee) and knee x (1 + probe_step) is within a climb step of the highest
            level measured: target = min(knee x (1 + probe_step), ceiling) x share

Regions, in order:

    confirm  not bad, the target cuts the limit by more than a bin, and the curve's top is
             the point this window learnt at the limit's level, one window's reading:
             target = limit, so the regions below hold it (`signals.unconfirmed`)
    decline  bad: limit = min(target, backoff x min(limit, busy in-flight)), busy in-flight
             the mean over the window's time with any request in flight (bursts: the
             gaps between them are no level the breach was read at)
    linear   in-flight at the limit for >= `saturation` of the window, engine not full,
             its last scrape not a measured level's throughput fallen by more than
             `change` (a slowdown within the window: hold, as `low`):
             a probe goes to its target at once, up to (1 + climb) x the limit; else
             limit = min(target,
             limit x (1 + climb x elasticity)), and while the room is more than two climb
             steps away, no more than (1 + climb) x the highest level measured (every
             level of the climb is measured before the next); nor more than
             limit x ttft_objective / TTFT p90, nor than
             level x aim x tpot_objective / TPOT p50, aim = tpot_aim lowered by one
             standard deviation of the curve's noise (`steps.in_step`, `steps.aim_level`; a window
             no answer ended in reads them at the curve's point at its level, `steps.latency`)
    low      the engine queued, or app-limited: limit = min(limit, target) (never grows);
             app-limited where the room was measured (grounded) and the window read a level
             (no move, no ramp): limit = target, the level the next demand meets (`_await`)

Then, after a saturated window that read a level (no move, no ramp) and broke no objective,
with TPOT p50 over aim x `tpot_objective`: limit = min(limit, max(backoff x limit,
level x aim x tpot_objective / TPOT p50)) (`steps.to_aim`): TPOT's aim holds both ways.

App-limited (`idle`): in-flight at the limit for under `saturation` of the window, the
token budget refused no request in it (`fits`; then demand met the budget, not the
limit), the engine not full, no breach.

A window that moved the limit by more than a bin marks the next one as measuring the
move; a cut makes samples admitted before it no measurement.

Between windows:
- a prompt-size shift (`PromptSizes`) cuts limit, room and knee estimate by its ratio at
  once and clears the curve (the rescale's `Epoch` then holds the room and the share);
- each scrape re-sizes the KV edge (`KvEdge`), which, times this gateway's share beside
  others (1 alone), caps the limit, and sets it (up to the ceiling) where the cache is
  >= 3/4 full; `fits` is the token budget, the share of it beside others;
- a tick with in-flight under half the limit, where the engine's room was measured, marks
  the engine drained: for one request's life after it the budget is a burst's (`_burst`).

Reads `Sample` (admitted_at, duration, ttft, prompt and output tokens, outcome),
`EngineStats` (running, waiting, KV use and size, preemptions, generated tokens), the
in-flight count per tick and prompt estimates on arrival or admission. Pure: no clock,
no I/O. What a window says beside its means is read by signals.py; how far a saturated
window may move the limit, by steps.py. Why each rule is as it is: docs/design/knee.md.
"""

from __future__ import annotations

import math
from typing import Any

from kneegate.controllers.base import EngineStats, Sample
from kneegate.controllers.knee import signals, steps
from kneegate.controllers.knee.config import KneeConfig
from kneegate.controllers.knee.curve import Curve
from kneegate.controllers.knee.kv import KvEdge
from kneegate.controllers.knee.room import Room, Share, queued
from kneegate.controllers.knee.sizes import Epoch, PromptSizes
from kneegate.controllers.knee.tokens import Calibration
from kneegate.controllers.window import Summary, Window, Windowed

__all__ = ["Knee"]

DRAINED = 0.5  # in-flight under this x the limit: the engine drained (demand fell away)


class Knee(Windowed):
    name = "knee"
    keeps_scrapes = True

    def __init__(self, cfg: KneeConfig | None = None) -> None:
        self.cfg: KneeConfig = cfg or KneeConfig()
        super().__init__(self.cfg, self.cfg)
        self._curve = Curve(self.cfg)
        self._room = Room()
        self._share = Share()
        self._cal = Calibration(self.cfg.admit_learned)
        self._sizes = PromptSizes(self.cfg)
        self._epoch = Epoch()
        self._kv = KvEdge(self.cfg)
        self._since_probe = 0
        self._last_cut = -math.inf  # samples admitted before it measure a level left
        self._moved = True  # the last window moved the limit by more than a bin (start: from 0)
        self._moved_up = False  # and raised it
        self._probing = False  # this window's target is a probe above the knee
        self._now = -math.inf  # the last tick's time
        self._arrivals_seen = False  # the gateway reports arrivals: admissions are not read
        self._held_back = False  # the token budget refused a request in this window
        self._before: tuple[float, float] | None = None  # the last window's last scrape
        self._drained_at = -math.inf  # the last tick that found the engine drained

    @property
    def limit(self) -> int:
        base = super().limit
        kv = self._kv.limit
        if kv is None:
            return base
        kv *= self._part()
        # the KV edge caps the window's limit, and sets it (above the window's: while small
        # requests sized before a rescale drain, their KV frees for the new sizes) where the
        # cache is what holds the engine back, 3/4 full; below that a level never measured
        # would skip the climb (H100: a queue of prefills at 37% KV read as room for 500)
        lift = self._kv.use >= 0.75
        kv = min(kv, self.ceiling()) if lift else min(kv, base)
        return max(self.cfg.min_limit, min(self.cfg.max_limit, math.floor(kv)))

    def fits(self, inflight: int, inflight_tokens: int, tokens: int) -> bool:
        """The token budget (`KvEdge.fits`): beside other gateways, this one's share of it."""
        fits = self._kv.fits(
            inflight, inflight_tokens, tokens, self._cal, self._part(), self._burst()
        )
        self._held_back = self._held_back or not fits  # demand met the budget: not idle
        return fits

    def _burst(self) -> bool:
        """The requests in flight came in a burst: the engine drained (a tick with in-flight
        under half the limit, where its room was measured, so not the start) within one
        request's life (`Calibration.life`). The token budget counts each running request at
        the answer it holds on average once requests of every age run (`held`); a burst's
        requests are younger and hold less until the burst has lasted a life. Until then
        the budget is `kv_budget_burst` of the cache (all of it), not `kv_budget`.
        Measured: docs/design/knee.md, "The token budget" (Bursts)."""
        return self._now - self._drained_at <= self._cal.life

    def _part(self) -> float:
        """This gateway's part of the engine's KV edge and token budget: the engine's
        running and KV use, and its cache, are everyone's; its share of them is its own."""
        return 1.0 if self._share.alone() else (self._share.estimate or 1.0)

    # --- inputs -----------------------------------------------------------------------

    def on_arrival(self, prompt_tokens: int) -> None:
        """The leading signal, read where requests join the queue: under overload the queue
        ahead delays the same sizes at admission by its wait (~5 s at 3x)."""
        self._arrivals_seen = True
        self._note_prompt(prompt_tokens)

    def on_admit(self, prompt_tokens: int) -> None:
        """Admissions are the population whose prompts finish (calibration), and the leading
        signal for a gateway that does not report arrivals."""
        self._cal.admit(prompt_tokens)
        if not self._arrivals_seen:
            self._note_prompt(prompt_tokens)

    def _note_prompt(self, prompt_tokens: int) -> None:
        cut = self._sizes.note(prompt_tokens, self._cal)
        if cut is not None:
            self._rescale(*cut)

    def _rescale(self, r: float, size: float | None) -> None:
        """Each request now holds r x the KV it held: limit, room and knee estimate fall by r
        now, and the curve is relearnt; samples admitted before measure a level left."""
        self._set_limit(max(1.0, self._limit / r))
        self._kv.reset()
        self._room.rescale(r)
        if self.knee_estimate is not None:
            self.knee_estimate /= r
        self._curve.clear()
        self._moved, self._moved_up = True, False
        self._epoch.begin(self._now, self.cfg.max_window)
        self._last_cut = self._now
        self._sizes.rebase(size)

    def _calibrated(self) -> bool:
        return self._epoch.calibrated(self.cfg.admit_recent, self.cfg.admit_learned)

    def _on_sample(self, s: Sample) -> None:
        self._epoch.finish(s)
        self._cal.learn_k(self._calibrated())
        # a finish gives back its prompt and answer before the next scrape shows it
        prompt = s.prompt_tokens or self._cal.tokens(self._sizes.learned)
        self._kv.finish(s.finished_at, prompt + s.output_tokens)
        self._cal.finish(s)
        if s.admitted_at >= self._last_cut:
            super()._on_sample(s)

    def _on_engine_stats(self, stats: EngineStats) -> None:
        super()._on_engine_stats(stats)
        self._share.scrape(stats.at, stats.running + stats.waiting)
        c = self.cfg
        learn = self._epoch.settled(stats.at, c.window, c.max_window) and self._calibrated()
        self._kv.scrape(stats, self._cal.tokens(self._sizes.learned), self._cal, learn)

    def _on_tick(self, now: float, inflight: int) -> None:
        self._now = now
        if inflight < DRAINED * self._limit and self._room.grounded:
            self._drained_at = now  # demand fell away: what comes next is a burst
        self._share.tick(now, inflight, self.cfg.max_window)
        super()._on_tick(now, inflight)

    def _quorum(self, w: Window) -> int:
        # engine counters measure throughput without waiting for requests to finish
        return 0 if len(w.stats) >= 3 else self.cfg.min_samples

    # --- one closed window --------------------------------------------------------------

    def _close(self, w: Summary) -> None:
        c = self.cfg
        ramped = signals.ramped(w, c)
        bad = w.drops > 0 or signals.over_objective(w, c, ramped, self._moved_up)
        level, _ = self._curve.level(w)
        read_at = level  # the window's mean level, where its answers ended: `steps.in_step`
        full = queued(w, c.queue_jitter)
        # the window after a move measures the move (a burst of prefills), not the level
        # a full engine's level counts its queue: its throughput is the plateau's, at no level
        measured = w.samples or w.engine_throughput is not None
        steady = not (self._moved or ramped)  # the window read a level, not a move
        climbed = signals.climbed(w, c, self._curve, self._before, self._moved_up)
        if climbed is not None and not (bad or full):
            # the rise kept pace: its level is what the last scrape read, past the prefills
            w, level = climbed, climbed.engine_inflight or level
            self._curve.learn(w, level, bad, scrape=True)
        elif measured and (bad or steady) and not full:
            self._curve.learn(w, level, bad)
        # app-limited: demand under the limit, and under the token budget, with room to spare
        idle = w.saturated < c.saturation and not (full or bad or self._held_back)
        self._held_back = False
        self._room.measure(w, full, self._epoch.draining(w.start), c.room_rise, idle)
        before = self._limit
        self._probing = False
        target = self._target(level) * self._share.update(
            w, level, not (idle or self._moved or self._epoch.draining(w.start)), c.smoothing
        )
        if not bad and signals.unconfirmed(w, target, self._limit, c, self._curve):
            target = self._limit  # the cut rests on one window at the top: a second confirms
        if bad:
            # decrease needs no proof of load: cut below what was actually in flight while
            # any was (`Summary.busy_inflight`): a burst's mean over its gaps is no level
            cut = min(self._limit, max(w.busy_inflight, 1.0)) * c.backoff
            self._set_limit(max(1.0, min(target, cut)))
        elif (w.saturated >= c.saturation and not full
              and not signals.stalled(w, c, self._curve, self._moved)
              and not signals.unproven(w, c)):
            # demand exceeds the limit and the engine keeps up: grow, at most one climb step
            # a probe goes to its level at once (up to one climb step, `steps.probe_step`): on a
            # flat plateau the fit's elasticity is ~0 and a climb step would never leave the knee
            # neither beyond where TTFT or TPOT, grown in step with the level, would pass its
            # objective (`steps.in_step`)
            grow = (steps.probe_step(self._limit, target, c) if self._probing
                    else steps.grow(self._limit, level, c, self._curve, self._room))
            self._set_limit(max(1.0, min(target, grow, steps.in_step(self._limit, w, read_at, c,
                                                                     self._curve))))
        else:
            # app-limited or queued: hold — no demand tests whether the engine takes more (a
            # knee the curve measured still cuts: a decrease needs no proof of load); where
            # the engine's room was measured, an app-limited limit waits at its target
            waits = idle and self._await(steady)
            self._set_limit(max(1.0, target if waits else min(self._limit, target)))
        if not bad and steady and w.saturated >= c.saturation:
            self._set_limit(max(1.0, min(self._limit, steps.to_aim(self._limit, w, level, c,
                                                                  self._curve))))
        self._before = w.engine_last  # the level this window left, read at its last scrape
        self._moved = abs(self._limit - before) > c.bin_ratio * before
        self._moved_up = self._moved and self._limit > before
        if self._limit < before:
            self._last_cut = w.end  # later samples admitted before this measure a level left

    def _await(self, steady: bool) -> bool:
        """An app-limited window sets the limit to its target, up as well as down (else it
        only cuts to it): where the engine's room was measured (`Room.grounded`: a queue, or
        a KV cache 1/4 full) and the window read a level (`steady`: not the one after a move,
        nor the first, the start, nor one the engine ramped through). (A probe's target is
        the probe's level: an idle probe waits there for one window, as a probe.)
        One gateway's grounded room is at most 4 x what runs, so within two climb steps of
        its limit, where `steps.grow` too lets a saturated window's limit double unmeasured.
        Why: a limit held under its target through idle time met the next burst short of it,
        and rose only once a window saw it saturated. Measured: docs/design/knee.md,
        "Regions" (Idle)."""
        return steady and self._room.grounded

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
        near = probe <= (1 + self.cfg.climb) * self._curve.top()
        if self._since_probe >= self.cfg.probe_every and self._room.value > knee and near:
            self._since_probe = 0  # one cheap window above a throughput knee: it may have moved
            self._probing = True
            return min(probe, self.ceiling())
        return min(self.cfg.headroom * knee, self.ceiling())

    def _published(self, knee: float) -> bool:
        """An estimate worth showing: within a climb step of the levels measured, or a room
        reading that was measured (an idle engine's extrapolated room is no knee)."""
        return knee <= (1 + self.cfg.climb) * self._curve.top() or (
            knee >= self._room.value and self._room.grounded
        )

    def _knee_now(self) -> float | None:
        fit, _ = self.knee()
        knee = min(fit or math.inf, self._room.value)
        return knee if math.isfinite(knee) else None

    def ceiling(self) -> float:
        """Highest level measured below the lowest level that broke an objective."""
        return self._curve.ceiling()

    def knee(self) -> tuple[float | None, bool]:
        """(knee level of the throughput curve, still rising at the top); None: none seen yet.

        The lowest of the fitted saturating curve's knee, the plateau's measured start and
        the last level kept before a decline (`Curve.knee`)."""
        return self._curve.knee()

    def fit(self) -> dict[str, Any]:
        """The learned curve as the live page draws it; reads, never changes, the state.

        `kept`: the levels the knee is read from (steady, before any decline); `decline_from`:
        the first steady level past the decline (null: none); `intercept`, `slope`: the fitted
        line c / tput = intercept + slope x c, i.e. tput = c / (intercept + slope x c), null
        when the kept levels do not bend it; `curve_knee`: the knee of the throughput curve
        (fit, plateau, decline), `room`: the engine's (null: not measured); the lower of the
        two is the knee estimate while it is published. `over_objective`: levels marked."""
        return self._curve.view(self._room.value)

    def state(self) -> dict[str, Any]:
        return {
            **super().state(),
            "curve": self._curve.as_list(),
            "fit": self.fit(),
            "curve_of": "engine" if self._curve.engine_mode else "gateway",
            "kv_capacity_tokens": self._kv.reported,
            "token_budget": self._kv.token_budget(self._burst()),
        }

