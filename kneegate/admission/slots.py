"""The upstreams' side of the admission queue: where a ticket runs, what is in flight, and
what each upstream's controller hears. Pure, like the queue built on it (`admission.queue`,
whose bottom layer this is): no asyncio, no clock.

A ticket dispatched to an upstream takes a slot there (`_place`: its limit's, and its
prompt estimate in the controller's token budget) until it ends (`_unplace`); one that is
not generation passes with no slot (`UpstreamState.passing`). The tickets in flight, oldest
first, say when the next slot is likely to free, and with the completion rate make the
wait a queued request is predicted to have (`_predict`; the rules: `admission.wait`).

The engine's prefill backlog is bounded too. On an engine whose prefill costs as much as the
decode that follows it (vLLM's CPU build: ~0.12 s a 128-token prompt), requests dispatched
together are prefilled one after another: the last of a wave of 16 got its first token ~2 s
after dispatch, on every wave, since answers of one length started together end together.
So an upstream takes another request only while fewer of its streamed requests await their
first token than `prefill_cap`. Each first token tells the upstream's `PrefillLine` the
backlog its request found at dispatch and its TTFT; the line fitted through them gives the
backlog whose TTFT stays within the tightest class's queue budget (a quarter of its
objective, 0.5 s by default). No cap until 8 first tokens, while the backlog has not varied,
or where the TTFT does not grow with it (a GPU prefilling a batch in one step); and never
below what frees of the limit while one request awaits its first token (`_refill`). The
queue, not the engine, then holds what the engine cannot yet prefill, where its wait is
predicted and bounded. A non-streamed request (no `"stream": true`) shows no first token
and is not counted. Measured in docs/history/benchmarks.md ("The prefill backlog").

The queue owns each controller's lifecycle, so the gateway and the simulator feed it alike:
`offer` tells every usable upstream's controller of a generation request's arrival
(`on_arrival`, queued or shed: the leading signal of the mix), a dispatch tells the chosen
one (`on_admit`), `release` frees the slot first, then feeds the sample
(`on_sample`), then dispatches; ticks (`on_tick`) and engine scrapes (`on_engine_stats`)
come in through `tick` and `engine_stats`, and `has_room_for` asks `fits`. Every call is
guarded: what a controller raises goes to `on_error` (the gate logs and counts it) and
costs that update only, never a slot or a request.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from kneegate.admission.affinity import PrefixMap
from kneegate.admission.demand import Demand
from kneegate.admission.types import Ticket, UpstreamState, least_full
from kneegate.admission.wait import WaitEstimate
from kneegate.controllers.base import EngineStats, Outcome, Sample

__all__ = ["Slots"]


def _inflight(upstreams: list[UpstreamState]) -> int:
    """Requests in flight over `upstreams` (a loop: no generator per request)."""
    n = 0
    for u in upstreams:
        n += u.inflight
    return n


@dataclass
class Slots:
    """The upstreams a queue dispatches to: the tickets in flight there, oldest first, and
    their controllers' feed. `AdmissionQueue`'s bottom layer (`ClassQueues` is built on it)."""

    upstreams: list[UpstreamState]
    # what a controller raised: (upstream, hook, exception); None re-raises it
    on_error: Callable[[UpstreamState, str, Exception], None] | None = field(
        default=None, kw_only=True)
    # prefix affinity (`admission.affinity`): where each prompt went; None: off
    affinity: PrefixMap | None = field(default=None, kw_only=True)
    demand: Demand = field(default_factory=Demand, init=False)  # the scale-out signal's sums
    _wait: WaitEstimate = field(default_factory=WaitEstimate, init=False)  # rate, engine TTFT
    # dispatched tickets, oldest first (a dict keeps order): the next to end is among the
    # first, and the first's age says when the next slot can free (`_first_free`)
    _flying: dict[Ticket, None] = field(default_factory=dict, init=False)
    # seconds of prefill an upstream may be handed: the tightest class's queue budget
    _prefill_horizon: float = field(default=0.0, init=False)
    # a first token later than this after dispatch ends a slow start: the tightest objective
    _slow_start_ttft: float = field(default=math.inf, init=False)

    # --- observation ---------------------------------------------------------------

    @property
    def completion_rate(self) -> float:
        return self._wait.completions.per_second

    @property
    def engine_ttft(self) -> float:
        """The engine's recent TTFT, dispatch to first token: its part of a predicted wait."""
        return self._wait.engine_ttft

    @property
    def flying(self) -> int:
        """Dispatched tickets not yet released, freed or rerouted (= the upstreams' in-flight)."""
        return len(self._flying)

    def _predict(self, ahead: int, now: float) -> float | None:
        """The wait predicted for a request with `ahead` before it: at the completion rate,
        but not before the oldest request in flight is likely to end (`_first_free`). None
        (nothing is refused for its objective) while some usable upstream's slow start is
        open: no refusal without evidence that the engine saturates."""
        if self._unproven():
            return None
        wait = self._wait.queue_wait(ahead)
        if wait is None:
            return self._cold_wait(ahead, now)
        return max(wait, self._first_free(now))

    def _prefill_held(self, model: str | None) -> bool:
        """Some usable upstream serving `model` has a free slot, and only its prefill
        backlog (`prefill_cap`) keeps it from taking another request."""
        for u in self.upstreams:
            if (u.prefill_cap and u.prefilling >= u.prefill_cap and u.usable
                    and not u.refusing and u.inflight < u.limit and u.serves(model)):
                return True
        return False

    def _unproven(self) -> bool:
        """Some usable upstream has shown no saturation yet (its slow start is open)."""
        for u in self.upstreams:
            if u.usable and u.slow_start is not None and u.slow_start.open:
                return True
        return False

    def _cold_wait(self, ahead: int, now: float) -> float | None:
        """The wait predicted once the engine showed saturation but before the completion
        rate is measured: the requests in flight free their slots no faster than one each
        for as long as the oldest has run without an answer ending, `ahead + 1` x that age
        / in flight. None with nothing in flight. A guess on the short side (a younger
        request may end sooner), starting at 0: only time that passes with no answer
        ending refuses."""
        at = self._oldest_dispatch()
        return None if at is None else (ahead + 1) * (now - at) / len(self._flying)

    def _first_free(self, now: float) -> float:
        """Seconds until the oldest request in flight has run the mean duration (0 when it
        has, or nothing is known). Answers of one length, started together, end together:
        on the emulator at 3x, 48-64 ended in one second and none in the next one or two,
        and requests queued after such a wave left waited it out past their objective
        (answered 503 after 1.4-1.5 s) where the rate, 18 a second, promised 0.2 s."""
        d, at = self._wait.duration, self._oldest_dispatch()
        return 0.0 if d is None or at is None else max(0.0, at + d - now)

    def _oldest_dispatch(self) -> float | None:
        """When the oldest request in flight was dispatched; None with nothing in flight."""
        return next(iter(self._flying)).dispatched_at if self._flying else None

    # --- placing -------------------------------------------------------------------

    def _place(self, ticket: Ticket, up: UpstreamState, now: float) -> None:
        if self.affinity is not None and ticket.prefix:
            self.affinity.record(ticket.prefix, up.name)
        if up.inflight == 0 and not any(u.inflight for u in self.upstreams):
            self._wait.completions.resume(now)  # busy again after idle
        up.inflight += 1  # `up.take`, inline
        up.inflight_tokens += ticket.tokens
        if ticket.streamed:
            ticket.backlog_at_dispatch = up.prefilling
            up.prefilling += 1
            ticket.awaiting_first = True
        ticket.upstream = up
        ticket.dispatched_at = now
        ticket.inflight_at_admit = up.inflight
        self._flying[ticket] = None
        try:
            up.controller.on_admit(ticket.tokens)
        except Exception as exc:
            self._failed(up, "on_admit", exc)
        self.demand.occupy(now, _inflight(self.upstreams))

    def _unplace(self, ticket: Ticket, up: UpstreamState) -> None:
        """Give back the slot and tokens `_place` took on `up` (nothing else: no completion,
        no charge)."""
        up.free(ticket.tokens)
        self._flying.pop(ticket, None)
        if ticket.awaiting_first:
            ticket.awaiting_first = False
            up.prefilling -= 1

    def _preferred(self, ticket: Ticket) -> str | None:
        """The upstream holding `ticket`'s longest known prompt prefix (affinity on)."""
        if self.affinity is None or not ticket.prefix:
            return None
        return self.affinity.lookup(ticket.prefix)

    def reroute(self, ticket: Ticket, now: float) -> UpstreamState | None:
        """Move a dispatched ticket whose upstream could not be reached to another upstream
        with room, or return None (the ticket keeps its slot, released as usual).

        The failed upstream's slot is freed without counting a completion (nothing was
        served); the ticket is dispatched afresh (`dispatched_at`, `inflight_at_admit`).
        Call it after marking the failed upstream unusable, then `pump`: its freed slot
        may let a queued ticket go elsewhere only through another upstream's room."""
        old = ticket.upstream
        assert old is not None, "only a dispatched ticket can be rerouted"
        if not ticket.generation:
            return self._repass(ticket, old, now)
        best = least_full(self.upstreams, ticket.tokens, skip=old, model=ticket.model,
                          prefer=self._preferred(ticket))
        if best is None:
            return None
        self._unplace(ticket, old)
        self._place(ticket, best, now)  # the same request: its tenant is not charged again
        return best

    def _repass(self, ticket: Ticket, old: UpstreamState, now: float) -> UpstreamState | None:
        """`reroute` for a request that is not generation: any other usable upstream."""
        for u in self.upstreams:
            if u is not old and u.usable:
                old.passing -= 1
                u.passing += 1
                ticket.upstream, ticket.dispatched_at = u, now
                return u
        return None

    # --- what the controllers hear --------------------------------------------------

    def _arrived(self, ticket: Ticket) -> bool:
        """Every usable upstream hears of a generation request as it arrives, queued or
        shed: under overload the queue delays admissions by seconds, and the shed are most
        of what tells a change in the mix early (its size is read from the content, so no
        padding moves it). Whether any upstream is usable (one loop a request)."""
        usable = False
        for u in self.upstreams:
            if u.usable:
                usable = True
                try:  # `_call`, inline: this runs on every request
                    u.controller.on_arrival(ticket.tokens)
                except Exception as exc:
                    self._failed(u, "on_arrival", exc)
        return usable

    def note_sample(self, upstream: UpstreamState, sample: Sample) -> None:
        """One request's outcome for `upstream`'s controller (a client's is never a sample);
        a first token also feeds the engine's TTFT, the engine's part of a predicted wait."""
        outcome = sample.outcome
        if outcome is Outcome.CLIENT_CANCELLED or outcome is Outcome.CLIENT_STALLED:
            return  # `outcome.is_client`, without the property's call
        try:
            upstream.controller.on_sample(sample)
        except Exception as exc:
            self._failed(upstream, "on_sample", exc)
        if outcome is Outcome.OK:
            self._wait.note_duration(sample.duration)
            if sample.ttft is not None:
                self._wait.note_ttft(sample.ttft)
        ss = upstream.slow_start
        if ss is not None and ss.open:
            if outcome is Outcome.UPSTREAM_OVERLOADED:
                ss.end(upstream.inflight + 1, "upstream_overloaded")
            elif outcome is Outcome.OK and sample.ttft is None:  # no first token: its end
                ss.acked(upstream.inflight + 1, upstream.controller.limit)

    def note_ttft(self, seconds: float) -> None:
        """A first token came `seconds` after dispatch: the engine's part of the wait."""
        self._wait.note_ttft(seconds)

    def note_completion(self, now: float) -> None:
        """A request finished on an engine: the completion rate's evidence."""
        self._wait.completions.note(now)
        self.demand.complete(now, _inflight(self.upstreams))

    def _first_token(self, ticket: Ticket, now: float) -> bool:
        """A dispatched ticket's first token came: its engine's prefill backlog is one
        shorter. The upstream's TTFT line learns of it (the backlog it found, its TTFT) and
        its `prefill_cap` is recomputed (and its slow start hears of it). False, and nothing
        done, for a later call."""
        up = ticket.upstream
        if not ticket.awaiting_first or up is None:
            return False
        ticket.awaiting_first = False
        up.prefilling -= 1
        assert ticket.dispatched_at is not None, "a dispatched ticket has its time"
        ttft = now - ticket.dispatched_at
        up.prefill_line.note(ticket.backlog_at_dispatch, ttft)
        if up.slow_start is not None:
            up.slow_start.first_token(ttft, self._slow_start_ttft, up.inflight,
                                      up.controller.limit)
        cap = up.prefill_line.cap(self._prefill_horizon) if self._prefill_horizon > 0 else 0
        up.prefill_cap = max(cap, self._refill(up)) if cap else 0
        return True

    def _refill(self, up: UpstreamState) -> int:
        """The slots of `up`'s limit that free while one request awaits its first token:
        its limit x the engine's TTFT / the mean answer's duration, rounded up. The cap is
        never below it, or the cap itself would keep the limit unfilled: where the TTFT is
        long for another reason than the backlog (a full KV cache), the line's base alone
        can be over the horizon."""
        duration = self._wait.duration
        if not duration:
            return 1
        return math.ceil(up.limit * self._wait.engine_ttft / duration)

    def engine_stats(self, upstream: UpstreamState, stats: EngineStats) -> None:
        """One good scrape of `upstream`'s engine metrics, for its controller (and its slow
        start: the engine's own queue standing is saturation)."""
        self._call(upstream, "on_engine_stats", stats)
        if upstream.slow_start is not None:
            upstream.slow_start.engine_stats(stats, upstream.inflight, self._slow_start_ttft)

    def engine_refused(self, up: UpstreamState) -> None:
        """`up`'s engine refused a request unstarted (its own queue caps): saturation."""
        if up.slow_start is not None:
            up.slow_start.end(up.inflight + 1, "engine_refused")

    def _stood(self) -> None:
        """A queued request waited past its objective (or its class's wait cap): a slow
        start judged by the engine's queue time (`SlowStart.timed`) that has grown to its
        reach ends there. Those counters tell a burst from saturation, so an engine that
        holds everything it is sent in time may never show saturation itself; without this
        the queue's predictions stay off for good, and under sustained overload every
        request past the reach waits to its due before it is answered. Below its reach the
        slow start may still grow: a queue standing there is a limit's doing (a controller
        that cut), not the engine's. (Judged by the waiting gauge, the engine shows a
        standing queue first.)"""
        for u in self.upstreams:
            ss = u.slow_start
            if ss is not None and ss.open and ss.timed and ss.at_reach:
                ss.end(u.inflight, "queued_past_objective")

    def _call(self, up: UpstreamState, hook: str, *args: object) -> None:
        try:
            getattr(up.controller, hook)(*args)
        except Exception as exc:
            self._failed(up, hook, exc)

    def _failed(self, up: UpstreamState, hook: str, exc: Exception) -> None:
        """`up`'s controller raised `exc` in `hook`: to `on_error` (re-raised without one)."""
        if self.on_error is None:
            raise exc
        self.on_error(up, hook, exc)
