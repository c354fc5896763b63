"""Admission: admit now, queue, or shed. A pure state machine — no asyncio, no clock.

Time comes in as `now` on every call, so the gateway (real time, through the thin
async layer in `gateway.gate`) and `benchmarks.simulate` (virtual time) run this
very code.

    offer(ticket, now)  -> Admitted(upstream) | Queued | Rejected(reason, retry_after)
    release(ticket, now, sample)
                        -> tickets newly dispatched because its slot (and tokens) freed
                           (= free + note_completion(now) + the sample + pump(now))
    charge(ticket, n, now) -> n more output tokens of a ticket in flight, for fair shares
    first_token(ticket, now)
                        -> tickets newly dispatched because a streamed ticket's first token
                           came (its engine's prefill backlog shrank)
    tick(now, ups)      -> (dispatched, expired): the controllers' tick, pump, expire
    engine_stats(up, s) -> one scrape of the engine's own metrics, to its controller
    pump(now)           -> tickets dispatched because a limit grew
    expire(now)         -> tickets whose deadline passed (503 queue_timeout): the class's
                           wait cap, or its TTFT objective less the engine's expected TTFT
    take_late()         -> the heads `pump` skipped past their objective (answer them now)
    withdraw(ticket)    -> remove one queued ticket (its waiter timed out first)
    close()             -> shutting down: every queued ticket, removed; later offers refused
    reroute(ticket, now)-> another upstream for a dispatched ticket whose upstream could not
                           be reached (its slot freed, no completion counted), or None
    requeue(ticket, now)-> a dispatched ticket its engine refused unstarted (vLLM's valve),
                           back at the head of its queue while its objective allows

The queue is bounded by time as well as by count. Each class has a TTFT objective, seconds
from a request's arrival to its first token (a request may carry a tighter one). On offer,
a request that cannot be admitted at once is refused (429 `over_objective`) when its
predicted wait in the queue, (queued ahead + 1) / the measured completion rate, or the
queue's own drain rate where that is slower, but no less than the oldest answer in flight
has left to run (`_first_free`; before four answers have ended, (ahead + 1) x the oldest's
age / in flight: `_cold_wait`), is more than its class's
`queue_budget` (0.25) of the objective less the engine's recent TTFT: told at once, not
after waiting (the prediction, and why a quarter: `admission.wait`). The budget rations the
excess of tenants over their share: a tenant holding fewer requests here than its weighted
share of the slots (`FairQueue.under_share`; never a tenant alone) may be predicted to wait
the whole objective less the engine's TTFT for its place, and is then queued even where the
last place is late by that budget: where slots free in waves (answers of one length), the
next one is often further than a quarter of the objective, and with every tenant held to
it fair shares had nothing queued to order (docs/experiments/2026-12-07-trace-scale.md). A
queued request leaves the queue (503 `queue_timeout`) once its class's `max_wait` or its
objective less the engine's TTFT has passed, and is never dispatched after that: the engine
does no work for a user who will see a miss or has left.

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

The safety net, for when the prediction is wrong (capacity fell, prompts grew, other
gateways share the engine): while a class's queue stands (`StandingQueue`: every head has
waited longer than its target, the wait `offer` admits against, for 4 targets in a row), a
head over target is answered 503 instead of dispatched: CoDel's test with its drop replaced
by an answer (chosen over newest-first by measurement: `admission.wait`).

The queue owns each controller's lifecycle, so the gateway and the simulator feed it alike:
`offer` tells every usable upstream's controller of a generation request's arrival
(`on_arrival`, queued or shed: the leading signal of the mix), a dispatch tells the chosen
one (`on_admit`), `release` frees the slot first, then feeds the sample
(`on_sample`), then dispatches; ticks (`on_tick`) and engine scrapes (`on_engine_stats`)
come in through `tick` and `engine_stats`, and `has_room_for` asks `fits`. Every call is
guarded: what a controller raises goes to `on_error` (the gate logs and counts it) and
costs that update only, never a slot or a request.

Dispatch order: higher `priority` classes first; within a class, fair shares between
tenants counted in tokens (`admission.fairness`: the least-served tenant's head first, FIFO
within a tenant; with one tenant, plain FIFO). A request goes to the usable upstream with
room for it (`UpstreamState`: its limit, and its controller's token budget) that is least
full, in-flight / limit (`least_full`), and that serves the model it names (`admission.pools`);
with `affinity` on, to the one that served its prompt's longest known prefix while that one
has room (`admission.affinity`). A head that does not fit waits, and what is queued
behind it waits too, so a large request is never starved by smaller ones that slip past it.

Which request a full queue sheds: when a class's queue must lose one (the arrival's place
is within its objective but the last queued request's is not, or the class is at its
count), it is the newest of the tenant furthest over its share (`FairQueue.victim`), told
at once (429, returned in `Queued.evicted`); with one tenant that is the arrival, as ever.
A tenant's own caps (`TenantPolicy.max_inflight`, `tokens_per_minute`) refuse its requests
429 `tenant_quota` before anything else.

Only generation is evidence (`Ticket.generation`). A request that is not (`GET /v1/models`,
`/tokenize`, ...) passes at once to the usable upstream with the fewest requests, with no
slot (`UpstreamState.passing`), and no controller, rate, fair share or demand hears of it:
a flood of them moves neither the limit nor the scale-out signal. The demand counts every
generation arrival except those refused for a cap of their own (their tenant's quota, an
objective they tightened themselves).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from kneegate.admission.affinity import PrefixMap
from kneegate.admission.demand import Demand
from kneegate.admission.fairness import FairQueue
from kneegate.admission.quota import TokenBuckets
from kneegate.admission.types import (
    Admitted,
    ClassPolicy,
    Queued,
    Rejected,
    RejectReason,
    Ticket,
    UpstreamState,
    least_full,
    no_upstream,
    over_objective,
    queue_full,
    queue_timeout,
    shutting_down,
    tenant_quota,
)
from kneegate.admission.wait import StandingQueue, WaitEstimate
from kneegate.controllers.base import EngineStats, Outcome, Sample

__all__ = ["AdmissionQueue"]

_DRAINING = -(10**9)  # the rank of a class a reload removed: after every configured class


def _inflight(upstreams: list[UpstreamState]) -> int:
    """Requests in flight over `upstreams` (a loop: no generator per request)."""
    n = 0
    for u in upstreams:
        n += u.inflight
    return n


@dataclass
class AdmissionQueue:
    """Bounded priority queue in front of a pool of upstreams."""

    upstreams: list[UpstreamState]
    classes: dict[str, ClassPolicy]
    max_queue: int = 256
    retry_after_min: int = 1
    retry_after_max: int = 60
    _queues: dict[str, FairQueue] = field(default_factory=dict, init=False)
    _order: list[str] = field(default_factory=list, init=False)
    _wait: WaitEstimate = field(default_factory=WaitEstimate, init=False)  # rate, engine TTFT
    _late: list[Ticket] = field(default_factory=list, init=False)  # set aside by `pump`
    # dispatched tickets, oldest first (a dict keeps order): the next to end is among the
    # first, and the first's age says when the next slot can free (`_first_free`)
    _flying: dict[Ticket, None] = field(default_factory=dict, init=False)
    closed: bool = field(default=False, init=False)  # shutting down: every offer is refused
    # what a controller raised: (upstream, hook, exception); None re-raises it
    on_error: Callable[[UpstreamState, str, Exception], None] | None = None
    _net: StandingQueue = field(default_factory=StandingQueue, init=False)  # the safety net
    demand: Demand = field(default_factory=Demand, init=False)  # the scale-out signal's sums
    _buckets: TokenBuckets = field(default_factory=TokenBuckets, init=False)  # tokens a minute
    # prefix affinity (`admission.affinity`): where each prompt went; None: off
    affinity: PrefixMap | None = None
    # every queue of this gateway, where pools share its tenants (`share_tenants`)
    _peers: Callable[[], list[AdmissionQueue]] | None = field(default=None, init=False)
    # seconds of prefill an upstream may be handed: the tightest class's queue budget
    _prefill_horizon: float = field(default=0.0, init=False)
    # a first token later than this after dispatch ends a slow start: the tightest objective
    _slow_start_ttft: float = field(default=math.inf, init=False)

    def __post_init__(self) -> None:
        self.reconfigure(self.classes, self.max_queue, self.upstreams)

    # --- configuration -------------------------------------------------------------

    def reconfigure(
        self,
        classes: dict[str, ClassPolicy],
        max_queue: int,
        upstreams: list[UpstreamState],
        retry_after: tuple[int, int] | None = None,
    ) -> None:
        """Swap policy without losing queued tickets (a removed class keeps draining);
        `retry_after`: the (min, max) Retry-After clamp, kept when None."""
        if not classes:
            raise ValueError("at least one priority class is needed")
        self.classes = dict(classes)
        self.max_queue = max_queue
        if retry_after is not None:
            self.retry_after_min, self.retry_after_max = retry_after
        self.upstreams = list(upstreams)
        for name in classes:
            self._queues.setdefault(name, FairQueue())
        rank = {n: self.classes[n].priority if n in self.classes else _DRAINING
                for n in self._queues}
        self._order = sorted(self._queues, key=lambda n: -rank[n])
        budgets = [c.queue_budget * c.ttft_objective for c in self.classes.values()
                   if math.isfinite(c.ttft_objective)]
        self._prefill_horizon = min(budgets, default=0.0)
        self._slow_start_ttft = min((c.ttft_objective for c in self.classes.values()),
                                    default=math.inf)

    def capacity(self, cls: str) -> int:
        share = self.classes[cls].queue_share
        return max(1, min(self.max_queue, math.ceil(share * self.max_queue)))

    # --- observation ---------------------------------------------------------------

    def depth(self, cls: str | None = None) -> int:
        if cls is not None:
            return len(self._queues.get(cls, ()))
        return sum(len(q) for q in self._queues.values())

    @property
    def completion_rate(self) -> float:
        return self._wait.completions.per_second

    @property
    def engine_ttft(self) -> float:
        """The engine's recent TTFT, dispatch to first token: its part of a predicted wait."""
        return self._wait.engine_ttft

    def _clamp(self, seconds: float) -> int:
        return int(max(self.retry_after_min, min(self.retry_after_max, math.ceil(seconds))))

    def retry_after(self, ahead: int) -> int:
        """Seconds until `ahead` queued requests have likely been served, clamped.

        From the measured completion rate; until there is one (a cold start), from the
        usable upstreams' limits, each slot assumed to free once a second.
        """
        wait = self._wait.queue_wait(ahead)
        if wait is None:
            wait = (ahead + 1) / (sum(u.limit for u in self.upstreams if u.usable) or 1)
        return self._clamp(wait)

    # --- the decisions -------------------------------------------------------------

    def offer(self, ticket: Ticket, now: float) -> Admitted | Queued | Rejected:
        cls = ticket.cls
        if cls not in self.classes:
            raise KeyError(f"unknown priority class {cls!r}")
        if not ticket.generation:
            return self._pass(ticket, now)
        usable = self._arrived(ticket)
        decision = self._decide(ticket, now, usable)
        if not (type(decision) is Rejected and self._own_doing(ticket, decision)):
            self.demand.arrive(now)  # offered load the engines could have served
        return decision

    def _own_doing(self, ticket: Ticket, refused: Rejected) -> bool:
        """`ticket` was refused for a cap of its own, not for the engines' capacity: its
        tenant's quota, or an objective it tightened itself (`x-kneegate-ttft-ms`)."""
        reason = refused.reason
        return reason is RejectReason.TENANT_QUOTA or (
            reason is RejectReason.OVER_OBJECTIVE
            and ticket.ttft_objective < self.classes[ticket.cls].ttft_objective)

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

    def _pass(self, ticket: Ticket, now: float) -> Admitted | Rejected:
        """A request that is not generation (`GET /v1/models`, `/tokenize`, ...): sent at
        once to the usable upstream with the fewest requests, room or not. It takes no slot
        (`passing`, not `inflight`), and no controller, rate or demand hears of it."""
        if self.closed:
            return self.shutdown_rejection()
        best: UpstreamState | None = None
        model = ticket.model
        for u in self.upstreams:
            if u.usable and u.serves(model) and (
                    best is None or u.inflight + u.passing < best.inflight + best.passing):
                best = u
        if best is None:
            return no_upstream(self.retry_after_min)
        best.passing += 1
        ticket.upstream, ticket.dispatched_at = best, now
        return Admitted(best)

    def _decide(self, ticket: Ticket, now: float, usable: bool
                ) -> Admitted | Queued | Rejected:
        cls = ticket.cls
        if self.closed:
            return self.shutdown_rejection()
        if not usable:
            return no_upstream(self.retry_after_min)
        if ticket.tenant.capped:
            quota = self._over_quota(ticket, now)
            if quota is not None:
                return quota
        q = self._queues[cls]
        higher = self._ahead_of(cls, above=True)
        if higher == 0 and not q:
            up = least_full(self.upstreams, ticket.tokens, model=ticket.model,
                            prefer=self._preferred(ticket))
            if up is not None:
                self._dispatch(ticket, up, now, queued=False)
                return Admitted(up)
        policy = self.classes[cls]
        objective = self.objective(ticket)
        budget = self._wait.budget(policy.queue_budget, objective)
        # the budget rations the excess of tenants over their share: one under its share
        # may wait for its place as long as its objective allows
        under = q.under_share(ticket, self._slots())
        own = self._wait.budget(1.0, objective) if under else budget
        ahead = higher + q.position(ticket)
        wait = self._predict(ahead, now)
        if wait is not None and wait > own:  # even its fair place is too late
            return over_objective(objective, ahead, wait + self.engine_ttft,
                                  self._clamp(wait - own))
        # someone's place is too late (the last's), or the queue is at its count: the
        # request to shed is the newest of the tenant furthest over its share
        last = self._predict(higher + len(q), now)
        late = last is not None and last > budget
        full = len(q) >= self.capacity(cls) or self.depth() >= self.max_queue
        evicted: tuple[Ticket, Rejected] | None = None
        if late or full:
            victim = q.victim(ticket)
            if full:
                ra = self.retry_after(self.depth())
                answer = queue_full(cls, len(q), self.capacity(cls), ra)
            else:
                assert last is not None
                answer = over_objective(self.objective(victim), higher + len(q),
                                        last + self.engine_ttft, self._clamp(last - budget))
            if victim is not ticket:
                q.remove(victim)
                evicted = (victim, answer)
            elif full or not under:  # one under its share is late by no one's excess
                return answer
        ticket.due, ticket.deadline = self._due(ticket, policy, now)
        self._busy_queue(now)
        q.append(ticket)
        return Queued(ahead, evicted)

    def _slots(self) -> int:
        """The usable upstreams' limits, summed: the slots the tenants share."""
        return sum(u.controller.limit for u in self.upstreams if u.usable)

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

    def _unproven(self) -> bool:
        """Some usable upstream has shown no saturation yet (its slow start is open)."""
        for u in self.upstreams:
            if u.usable and u.slow_start is not None and u.slow_start.open:
                return True
        return False

    def engine_refused(self, up: UpstreamState) -> None:
        """`up`'s engine refused a request unstarted (its own queue caps): saturation."""
        if up.slow_start is not None:
            up.slow_start.end(up.inflight + 1, "engine_refused")

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

    @property
    def flying(self) -> int:
        """Dispatched tickets not yet released, freed or rerouted (= the upstreams' in-flight)."""
        return len(self._flying)

    def _over_quota(self, ticket: Ticket, now: float) -> Rejected | None:
        """429 `tenant_quota` when `ticket`'s tenant is at one of its own caps."""
        t = ticket.tenant
        if t.max_inflight is not None:
            peers = self._peers() if self._peers is not None else [self]
            held = sum(p.tenant_held(t.name) for p in peers)
            if held >= t.max_inflight:
                return tenant_quota(t.label, f"{t.max_inflight} requests in flight",
                                    self.retry_after(held - t.max_inflight))
        wait = self._buckets.wait(t, now)
        if wait > 0:
            return tenant_quota(t.label, f"{t.tokens_per_minute:g} tokens a minute",
                                self._clamp(wait))
        return None

    def tenant_held(self, name: str) -> int:
        """Requests of tenant `name` queued or in flight here."""
        return sum(q.held(name) for q in self._queues.values())

    def share_tenants(self, buckets: TokenBuckets,
                      peers: Callable[[], list[AdmissionQueue]]) -> None:
        """Several queues serve one gateway (`admission.pools`): tenants' caps count across
        them all, `buckets` being their shared tokens-a-minute and `peers` every queue."""
        self._buckets, self._peers = buckets, peers

    def _busy_queue(self, now: float) -> None:
        """A ticket is about to be queued: if none was, the queue's drain rate counts its
        busy time from `now` (time with nothing queued says nothing of how fast it drains)."""
        if not self.depth():
            self._wait.departures.resume(now)

    def _due(self, ticket: Ticket, policy: ClassPolicy, since: float) -> tuple[float, float]:
        """(due, deadline) of `ticket` queued at `since`. Past `due` a first token is a miss
        the user may not wait for: never sent on, it is answered then (the engine TTFT it
        would still need is left for it); `deadline` also holds the class's wait cap."""
        due = since + self.objective(ticket) - self.engine_ttft
        return due, min(since + policy.max_wait, due)

    def objective(self, ticket: Ticket) -> float:
        """Seconds from arrival to the first token that `ticket` must meet: its class's
        objective, tightened by the request's own."""
        return min(self.classes[ticket.cls].ttft_objective, ticket.ttft_objective)

    def release(self, ticket: Ticket, now: float, sample: Sample | None = None
                ) -> list[Ticket]:
        """`ticket`'s request on its upstream ended: free its slot (and its tokens) first,
        then feed its `sample` to the controller (none, or a client's outcome, feeds it
        nothing), then dispatch what now fits (Netflix decrements before onSample: a
        controller that raises cannot keep the slot). Its output tokens not yet charged
        to its tenant are charged now."""
        up = ticket.upstream
        assert up is not None, "only a dispatched ticket can be released"
        if not ticket.generation:
            up.passing -= 1  # no slot, no evidence: nothing else to do
            return []
        self._unplace(ticket, up)
        output = sample.output_tokens if sample is not None else None
        self._charge_tokens(ticket, (output or 0) - ticket.output_charged, now)
        self._queues[ticket.cls].released(ticket, output)
        self.note_completion(now)
        if sample is not None:
            self.note_sample(up, sample)
        return self.pump(now)

    def charge(self, ticket: Ticket, tokens: int, now: float) -> None:
        """`tokens` more output tokens of `ticket`, in flight, streamed: its tenant's fair
        share and token quota are charged as the engine serves, not only at the end."""
        self._charge_tokens(ticket, tokens, now)
        self._queues[ticket.cls].charge_output(ticket, tokens)

    def _charge_tokens(self, ticket: Ticket, tokens: int, now: float) -> None:
        if tokens > 0 and ticket.tenant.tokens_per_minute is not None:
            self._buckets.take(ticket.tenant, tokens, now)

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

    def tick(self, now: float, upstreams: Iterable[UpstreamState] | None = None
             ) -> tuple[list[Ticket], list[Ticket]]:
        """The controllers' tick (`upstreams`: those with requests, the queue's own by
        default), then dispatch what fits, then time out what waited too long: (dispatched,
        expired). The dispatched were called `on_admit` already."""
        for u in self.upstreams if upstreams is None else upstreams:
            self._call(u, "on_tick", now, u.inflight)
        dispatched = self.pump(now)
        return dispatched, self.expire(now)

    def engine_stats(self, upstream: UpstreamState, stats: EngineStats) -> None:
        """One good scrape of `upstream`'s engine metrics, for its controller (and its slow
        start: the engine's own queue standing is saturation)."""
        self._call(upstream, "on_engine_stats", stats)
        if upstream.slow_start is not None:
            upstream.slow_start.engine_stats(stats, upstream.inflight, self._slow_start_ttft)

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

    def free(self, ticket: Ticket) -> None:
        """Give back a dispatched ticket's slot and tokens, unserved (its caller left before
        the engine saw it): its tenant is refunded. Dispatches nothing (`pump` does)."""
        up = ticket.upstream
        assert up is not None, "only a dispatched ticket has a slot to free"
        if not ticket.generation:
            up.passing -= 1
            return
        self._unplace(ticket, up)
        self._queues[ticket.cls].refund(ticket)

    def first_token(self, ticket: Ticket, now: float) -> list[Ticket]:
        """A dispatched ticket's first token came: its engine's prefill backlog is one
        shorter. The upstream's TTFT line learns of it (the backlog it found, its TTFT) and
        its `prefill_cap` is recomputed; what now fits is dispatched. A later call for it
        does nothing."""
        up = ticket.upstream
        if not ticket.awaiting_first or up is None:
            return []
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
        return self.pump(now)

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

    def note_completion(self, now: float) -> None:
        """A request finished on an engine: the completion rate's evidence."""
        self._wait.completions.note(now)
        self.demand.complete(now, _inflight(self.upstreams))

    def pump(self, now: float) -> list[Ticket]:
        """Dispatch queued tickets while some upstream has room. A head past its objective
        (`due`) is never dispatched: it is set aside for `take_late` / `expire`. (`max_wait`
        alone is enforced by `expire`, at the tick, as a cap on waiting.)"""
        out: list[Ticket] = []
        for name in self._order:
            q = self._queues[name]
            if not q:  # nothing waits: no head to judge (the common case, every release)
                self._net.empty(name, now)
                continue
            target = self._target(name)
            head = q.head()
            standing = self._net.standing(name, head.arrived_at if head else None, target, now)
            while head is not None:
                if head.due <= now or (standing and now - head.arrived_at > target):
                    q.remove(head)
                    self._late.append(head)
                    self._stood()
                    head = q.head()
                    continue
                up = least_full(self.upstreams, head.tokens, model=head.model,
                                prefer=self._preferred(head))
                if up is None:
                    return out
                q.remove(head)
                self._dispatch(head, up, now)
                out.append(head)
                head = q.head()
        return out

    def _target(self, name: str) -> float:
        """The wait a class's queue should keep to: its `queue_budget` of the objective
        less the engine's TTFT (what `offer` predicts against)."""
        policy = self.classes.get(name)
        if policy is None:  # removed by a reload, draining
            return math.inf
        return self._wait.budget(policy.queue_budget, policy.ttft_objective)

    def expire(self, now: float) -> list[Ticket]:
        """Remove and return tickets whose deadline has passed (and those `pump` set aside).

        A request's own objective can make its deadline earlier than those ahead of it, so
        every queued ticket is looked at (the queue is bounded: `max_queue`)."""
        out, self._late = self._late, []
        for u in self.upstreams:  # refused with nothing of ours in it: others filled it
            if u.refusing and u.inflight == 0:
                u.refusing = False  # try again once a tick
        for q in self._queues.values():
            if any(t.deadline <= now for t in q):
                out.extend(q.remove_if(lambda t: t.deadline <= now))
                self._stood()
        return out

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

    def fairness(self) -> dict[str, float | None]:
        """Each class's Jain's index since the last call (`FairQueue.jain`); None where
        fewer than two tenants stayed backlogged."""
        return {name: q.jain() for name, q in self._queues.items() if name in self.classes}

    @property
    def has_late(self) -> bool:
        """Heads `pump` set aside, not yet taken (`take_late`)."""
        return bool(self._late)

    def take_late(self) -> list[Ticket]:
        """The heads `pump` set aside past their objective (cheap: no scan), removed."""
        late, self._late = self._late, []
        return late

    def note_ttft(self, seconds: float) -> None:
        """A first token came `seconds` after dispatch: the engine's part of the wait."""
        self._wait.note_ttft(seconds)

    def withdraw(self, ticket: Ticket) -> bool:
        """Remove a queued ticket; False when it was already dispatched or expired."""
        q = self._queues.get(ticket.cls)
        if q is None or ticket.dispatched_at is not None:
            return False
        return q.remove(ticket)

    def close(self) -> list[Ticket]:
        """Shutting down: remove and return every queued ticket; refuse every later offer."""
        self.closed = True
        out: list[Ticket] = []
        for q in self._queues.values():
            out.extend(q.clear())
        return out

    def shutdown_rejection(self) -> Rejected:
        return shutting_down(self.retry_after_min)

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

    def requeue(self, ticket: Ticket, now: float) -> bool:
        """A dispatched ticket's engine refused it before starting it (vLLM's own valve,
        `--max-num-queued-reqs` / `--max-num-queued-tokens`, is full) and no other upstream
        has room (`reroute` said None): free its slot, mark the upstream `refusing` (no room
        there until one of its requests ends, when the engine's own queue has room again),
        and put the ticket back at the head of its class's queue, due (and deadline) as if
        it had been queued on arrival. False, the ticket left as it was, when a first token
        can no longer come within its objective (or its class is gone): the refusal stands.
        Call `pump` after it."""
        up, policy = ticket.upstream, self.classes.get(ticket.cls)
        assert up is not None, "only a dispatched ticket can be requeued"
        if policy is None or self.closed or not ticket.generation:
            return False
        due, deadline = self._due(ticket, policy, ticket.arrived_at)
        if now >= due:
            return False
        self.free(ticket)  # unserved: its tenant is refunded
        up.refusing = True
        self.engine_refused(up)
        ticket.upstream, ticket.dispatched_at = None, None
        ticket.due, ticket.deadline = due, deadline
        self._busy_queue(now)
        self._queues[ticket.cls].appendleft(ticket)
        return True

    def timeout_rejection(self, ticket: Ticket) -> Rejected:
        policy = self.classes.get(ticket.cls)
        cap = policy.max_wait if policy else 0.0
        waited = ticket.deadline - ticket.arrived_at
        return queue_timeout(ticket.cls, cap, waited, self.retry_after(self.depth()))

    # --- internals -----------------------------------------------------------------

    def _ahead_of(self, cls: str, above: bool = False) -> int:
        """Queued tickets of classes ranked with `cls` or above it (`above`: only above)."""
        # on every offer: skip empty queues first, build nothing
        rank = self.classes[cls].priority
        ahead = 0
        for name, q in self._queues.items():
            if q and not (above and name == cls):
                policy = self.classes.get(name)
                if (policy.priority if policy is not None else _DRAINING) >= rank:
                    ahead += len(q)
        return ahead

    def _dispatch(self, ticket: Ticket, up: UpstreamState, now: float,
                  queued: bool = True) -> None:
        """Send `ticket` to `up` (`queued`: from its class's queue, else straight through):
        its slot, and its tenant's charge for its prompt."""
        self._place(ticket, up, now)
        self._queues[ticket.cls].dispatched(ticket, queued)
        if queued:
            self._wait.departures.note(now)
        if ticket.tenant.tokens_per_minute is not None:
            self._buckets.take(ticket.tenant, ticket.tokens, now)

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
