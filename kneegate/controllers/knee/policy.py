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
             target = limit, so the regions below hold it (`_unconfirmed`)
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
             standard deviation of the curve's noise (`_in_step`, `_aim_level`; a window
             no answer ended in reads them at the curve's point at its level, `_latency`)
    low      the engine queued, or app-limited: limit = min(limit, target) (never grows);
             app-limited where the room was measured (grounded) and the window read a level
             (no move, no ramp): limit = target, the level the next demand meets (`_await`)

Then, after a saturated window that read a level (no move, no ramp) and broke no objective,
with TPOT p50 over aim x `tpot_objective`: limit = min(limit, max(backoff x limit,
level x aim x tpot_objective / TPOT p50)) (`_to_aim`): TPOT's aim holds both ways.

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
no I/O. Why each rule is as it is: docs/design/knee.md.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from kneegate.controllers.base import EngineStats, Sample
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
        ramped = self._ramped(w)
        bad = w.drops > 0 or self._over_objective(w, ramped)
        level, _ = self._curve.level(w)
        read_at = level  # the window's mean level, where its answers ended: `_in_step`
        full = queued(w, c.queue_jitter)
        # the window after a move measures the move (a burst of prefills), not the level
        # a full engine's level counts its queue: its throughput is the plateau's, at no level
        measured = w.samples or w.engine_throughput is not None
        steady = not (self._moved or ramped)  # the window read a level, not a move
        climbed = self._climbed(w)
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
        if not bad and self._unconfirmed(w, target):
            target = self._limit  # the cut rests on one window at the top: a second confirms
        if bad:
            # decrease needs no proof of load: cut below what was actually in flight while
            # any was (`Summary.busy_inflight`): a burst's mean over its gaps is no level
            cut = min(self._limit, max(w.busy_inflight, 1.0)) * c.backoff
            self._set_limit(max(1.0, min(target, cut)))
        elif (w.saturated >= c.saturation and not full and not self._stalled(w)
              and not self._unproven(w)):
            # demand exceeds the limit and the engine keeps up: grow, at most one climb step
            # a probe goes to its level at once (up to one climb step, `_probe_step`): on a
            # flat plateau the fit's elasticity is ~0 and a climb step would never leave the knee
            # neither beyond where TTFT or TPOT, grown in step with the level, would pass its
            # objective (`_in_step`)
            grow = self._probe_step(target) if self._probing else self._grow(level)
            self._set_limit(max(1.0, min(target, grow, self._in_step(w, read_at))))
        else:
            # app-limited or queued: hold — no demand tests whether the engine takes more (a
            # knee the curve measured still cuts: a decrease needs no proof of load); where
            # the engine's room was measured, an app-limited limit waits at its target
            waits = idle and self._await(steady)
            self._set_limit(max(1.0, target if waits else min(self._limit, target)))
        if not bad and steady and w.saturated >= c.saturation:
            self._set_limit(max(1.0, min(self._limit, self._to_aim(w, level))))
        self._before = w.engine_last  # the level this window left, read at its last scrape
        self._moved = abs(self._limit - before) > c.bin_ratio * before
        self._moved_up = self._moved and self._limit > before
        if self._limit < before:
            self._last_cut = w.end  # later samples admitted before this measure a level left

    def _unconfirmed(self, w: Summary, target: float) -> bool:
        """The target would cut the limit by more than a bin, and the curve's verdict that
        puts it there rests on its top point, learnt in this window at the limit's level
        (within `pair`) from one window's reading (`Point.windows` 1). A verdict of the
        curve (a plateau, a decline, a fit) that no objective's breach backs holds the limit
        one window more, so that a second window at the level joins the first before the
        limit leaves it: nothing measures a level above the knee again for the point's
        `memory` (300 s). Measured: docs/design/knee.md, "Regions" (Confirm)."""
        top = self._curve.highest()
        return (target < self._limit / (1 + self.cfg.bin_ratio) and top is not None
                and top.at == w.end and top.windows == 1 and not top.scrape
                and top.concurrency * self.cfg.pair >= self._limit)

    def _in_step(self, w: Summary, level: float) -> float:
        """How far a saturated window's limit may grow for latency: to where its TTFT p90,
        grown in proportion to the limit, would meet `ttft_objective`, and its TPOT p50,
        grown in proportion to the level, would reach its aim (`_aim_level`). Never a cut
        (a breach cuts).

        TTFT: where every prefill queues behind the others (vLLM's CPU build) TTFT grows in
        step with the limit, and a doubling past the objective took the users' tail past it
        for the time the cuts took; where TTFT is far under its objective it never binds.
        TPOT: on the plateau a step's time grows with the batch it decodes, so TPOT grows
        with the level; under the knee it grows slower, and the bound is loose. Aimed under
        the objective, not at it: every request's TPOT is judged, and at a p50 on the
        objective half of them miss it.

        `level` is where the window's latencies were read: its mean level, also for the
        window after a rise that `_climbed` reads at its last scrape (its answers ended
        while it held less). Measured: docs/design/knee.md, "Regions" (TPOT stops the
        climb); on real vLLM, docs/history/benchmarks.md, "kneegate's limit at 3x on real
        vLLM"."""
        c = self.cfg
        bound = math.inf
        ttft, tpot = self._latency(w, level)
        if ttft:
            bound = self._limit * c.ttft_objective / ttft
        if tpot:
            bound = min(bound, self._aim_level(level, tpot))
        return max(self._limit, bound)

    def _aim_level(self, level: float, tpot: float) -> float:
        """The level at which TPOT, read at `level` and grown in step with it, meets
        `tpot_aim` x `tpot_objective`, lowered by one standard deviation of the host's
        measured noise (`Curve.noise`, one window's variance of ln throughput): where
        `_in_step` stops the climb and `_to_aim` brings the limit back.

        Why lowered: one window's TPOT is read in one spell of the host's speed, and every
        answer is judged: a limit set to the aim in a fast spell breaks the objective in the
        next slow one. Measured: docs/design/knee.md, "Regions" (The aim sits under the
        noise)."""
        aim = self.cfg.tpot_aim * math.exp(-math.sqrt(self._curve.noise()))
        return level * aim * self.cfg.tpot_objective / tpot

    def _latency(self, w: Summary, level: float) -> tuple[float | None, float | None]:
        """The window's (TTFT p90, TPOT p50); in a window no answer ended in (closed on the
        engine's counters), those of the curve's point at its level, if any: unbounded, a
        probe from such a window leapt past the level where TPOT meets its aim.
        Measured: docs/design/knee.md, "Regions"."""
        if w.ttft_p90 is not None or w.tpot_p50 is not None:
            return w.ttft_p90, w.tpot_p50
        near = self._curve.nearest(level)
        return (near.ttft_p90, near.tpot_p50) if near is not None else (None, None)

    def _to_aim(self, w: Summary, level: float) -> float:
        """Where TPOT's aim puts the limit after a saturated window that read a level: the
        level at which its TPOT p50, in step with the level, meets its aim (`_aim_level`),
        no lower than a `backoff` cut (one window's p50 is noisy); no bound where it is
        under the aim. `_in_step` stops the climb there; this brings the
        limit back when the engine slows under it (a breach of the objective itself cuts).
        Only saturated windows: in a draining one the level is under the limit and scales
        nothing. Measured: docs/design/knee.md, "Regions" (TPOT's aim holds both ways)."""
        if not w.tpot_p50:
            return math.inf
        return max(self.cfg.backoff * self._limit, self._aim_level(level, w.tpot_p50))

    def _over_objective(self, w: Summary, ramped: bool) -> bool:
        """TTFT p90 or TPOT p50 over its objective. A window held at the limit with no
        answer in it, not after a rise nor through the engine's own (`ramped`), is judged by
        the engine's TPOT (`Summary.engine_tpot`): once each step is slower a request
        outlasts a window, and windows closed on the engine's scrapes alone would hold the
        limit the windows with answers cut. Not in the other windows, where requests still
        prefilling read it high. Measured: docs/design/knee.md, "Windows"
        (tests/benchmarks/test_knee_slowdown_sim.py)."""
        c = self.cfg
        tpot = w.tpot_p50
        if tpot is None and w.saturated >= c.saturation and not (self._moved_up or ramped):
            tpot = w.engine_tpot
        return (w.ttft_p90 is not None and w.ttft_p90 > c.ttft_objective) or (
            tpot is not None and tpot > c.tpot_objective
        )

    def _climbed(self, w: Summary) -> Summary | None:
        """The window after a rise, read at its last scrape, when that shows the rise kept
        pace: the engine filled the level and throughput grew with elasticity of at least 1/2
        from the highest level measured, or, before any, from the last scrape of the window
        the rise left (the first window measures the start, no level). The window's means
        mix the scrapes from before the rise (they come 1.5 s late) and its burst of
        prefills; one that reads flat even at its last scrape may still be prefilling, and
        the next window decides, as for any move. None: not such a window."""
        top = self._curve.highest()
        ref = (top.concurrency, top.throughput) if top else self._before
        if not (self._moved_up and self._curve.engine_mode and w.engine_last and ref):
            return None
        level, tput = w.engine_last
        if level < 0.8 * w.max_inflight or w.saturated < self.cfg.saturation:
            return None
        if level < self.cfg.pair * ref[0] or tput <= 0 or ref[1] <= 0:
            return None  # a counter that stood still or was reset
        if math.log(tput / ref[1]) < 0.5 * math.log(level / ref[0]):
            return None
        return replace(w, engine_inflight=level, engine_throughput=tput)

    def _stalled(self, w: Summary) -> bool:
        """The window's last scrape reads a level measured before at a throughput fallen by
        more than `change`: the engine changed within the window, whose means still read it
        as it was. No growth on them: a limit doubled into a slowdown admits requests whose
        samples, admitted before the cuts that follow, measure nothing for a while
        (tests/benchmarks/test_knee_slowdown_sim.py). Measured: docs/design/knee.md, "Regions"
        (Linear)."""
        if self._moved or w.engine_last is None:
            return False
        level, tput = w.engine_last
        near = self._curve.nearest(level)
        return near is not None and tput < (1 - self.cfg.change) * near.throughput

    def _unproven(self, w: Summary) -> bool:
        """No answer ended in the window and the engine's own TPOT is over its objective:
        nothing shows the engine keeps up, so the limit holds (a cut still needs a window
        `_over_objective` judges). Neither `_over_objective` (the engine's in-flight rose
        through it) nor `_stalled` (the window after a move) reads such a window, and one
        after a slowdown's cut doubled the limit (tests/benchmarks/test_knee_slowdown_sim.py)."""
        return (w.samples == 0 and w.engine_tpot is not None
                and w.engine_tpot > self.cfg.tpot_objective)

    def _ramped(self, w: Summary) -> bool:
        """The engine's in-flight rose by more than a bin across the window: it measured a
        move, not a level. The KV edge lifts the limit between windows without moving the
        window's, and the mean of such a window reads its prefills as a plateau below it (a
        false knee). Measured: docs/design/knee.md, "Regions" (Linear)."""
        if w.engine_first is None or w.engine_last is None:
            return False
        return w.engine_last[0] > (1 + self.cfg.bin_ratio) * w.engine_first

    def _await(self, steady: bool) -> bool:
        """An app-limited window sets the limit to its target, up as well as down (else it
        only cuts to it): where the engine's room was measured (`Room.grounded`: a queue, or
        a KV cache 1/4 full) and the window read a level (`steady`: not the one after a move,
        nor the first, the start, nor one the engine ramped through). (A probe's target is
        the probe's level: an idle probe waits there for one window, as a probe.)
        One gateway's grounded room is at most 4 x what runs, so within two climb steps of
        its limit, where `_grow` too lets a saturated window's limit double unmeasured.
        Why: a limit held under its target through idle time met the next burst short of it,
        and rose only once a window saw it saturated. Measured: docs/design/knee.md,
        "Regions" (Idle)."""
        return steady and self._room.grounded

    def _probe_step(self, target: float) -> float:
        """A probe's move: to its target at once, but no more than one climb step above the
        limit. The target is read from the knee of this window's curve, and on a host whose
        speed wanders one window can move that far: a probe straight there put a queue of
        prefills in the engine. Measured: docs/design/knee.md, "Regions" (Plateau and
        probes)."""
        return min(target, (1 + self.cfg.climb) * self._limit)

    def _grow(self, level: float) -> float:
        """How far a saturated window may raise the limit: one climb step, weighed by the
        fitted curve's elasticity at `level` (a step that adds little throughput is a small
        one), within two steps of the engine's room or one step past the highest level
        measured.

        A full step where the engine's measured room (`Room.grounded`) is near and the
        fitted curve still rises through it (its knee is at or past the room): the room,
        not the curve, stops the climb (the target caps it), and the elasticity at levels
        under the room only slowed the approach. Measured: docs/design/knee.md, "Regions"
        (Linear)."""
        step = 1 + self.cfg.climb
        grow = self._limit * (1 + self.cfg.climb * self._curve.elasticity(level))
        if self._room.value <= step * step * self._limit:
            fit, _ = self._curve.knee()
            if self._room.grounded and (fit is None or fit >= self._room.value):
                return step * self._limit  # the curve rises through the room: the target stops it
            return grow  # the engine's room is within two steps: it stops the climb
        # else at most one step past the highest level measured (the initial limit before
        # any): doublings never measured overshoot a flat plateau
        return max(self._limit, min(grow, step * self._curve.top()))

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

