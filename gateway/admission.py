"""Admission: admit now, queue, or shed. A pure state machine — no asyncio, no clock.

Time comes in as `now` on every call, so the gateway (real time, through the thin
async layer in `gateway.gate`) and `benchmarks.simulate` (virtual time) run this
very code.

    offer(ticket, now)  -> Admitted(upstream) | Queued | Rejected(reason, retry_after)
    release(up, now, t, sample)
                        -> tickets newly dispatched because a slot (and t tokens) freed
                           (= free(up, t) + note_completion(now) + the sample + pump(now))
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
predicted wait in the queue, (queued ahead + 1) / the measured completion rate, is more than
its class's `queue_budget` (0.25) of the objective less the engine's recent TTFT: told at
once, not after waiting (the prediction, and why a quarter: `gateway.admission_wait`). A
queued request leaves the queue (503 `queue_timeout`) once its class's `max_wait` or its
objective less the engine's TTFT has passed, and is never dispatched after that: the engine
does no work for a user who will see a miss or has left.

The safety net, for when the prediction is wrong (capacity fell, prompts grew, other
gateways share the engine): while a class's queue stands (`StandingQueue`: every head has
waited longer than its target, the wait `offer` admits against, for 4 targets in a row), a
head over target is answered 503 instead of dispatched: CoDel's test with its drop replaced
by an answer (chosen over newest-first by measurement: `gateway.admission_wait`).

The queue owns each controller's lifecycle, so the gateway and the simulator feed it alike:
`offer` tells every usable upstream's controller of the arrival (`on_arrival`), a dispatch
tells the chosen one (`on_admit`), `release` frees the slot first, then feeds the sample
(`on_sample`), then dispatches; ticks (`on_tick`) and engine scrapes (`on_engine_stats`)
come in through `tick` and `engine_stats`, and `has_room_for` asks `fits`. Every call is
guarded: what a controller raises goes to `on_error` (the gate logs and counts it) and
costs that update only, never a slot or a request.

Dispatch order: higher `priority` classes first, FIFO within a class. A request goes to the
usable upstream with room for it (`UpstreamState`: its limit, and its controller's token
budget) that is least full, in-flight / limit (`least_full`). A head that does not fit
waits, and what is queued behind it waits too: FIFO, so a large request is never starved by
smaller ones that slip past it.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from kneegate.controllers.base import EngineStats, Outcome, Sample
from kneegate.gateway.admission_types import (
    Admitted,
    ClassPolicy,
    Queued,
    Rejected,
    Ticket,
    UpstreamState,
    least_full,
    no_upstream,
    over_objective,
    queue_full,
    queue_timeout,
    shutting_down,
)
from kneegate.gateway.admission_wait import StandingQueue, WaitEstimate
from kneegate.gateway.demand import Demand

__all__ = ["AdmissionQueue"]

_DRAINING = -(10**9)  # the rank of a class a reload removed: after every configured class


@dataclass
class AdmissionQueue:
    """Bounded priority queue in front of a pool of upstreams."""

    upstreams: list[UpstreamState]
    classes: dict[str, ClassPolicy]
    max_queue: int = 256
    retry_after_min: int = 1
    retry_after_max: int = 60
    _queues: dict[str, deque[Ticket]] = field(default_factory=dict, init=False)
    _order: list[str] = field(default_factory=list, init=False)
    _wait: WaitEstimate = field(default_factory=WaitEstimate, init=False)  # rate, engine TTFT
    _late: list[Ticket] = field(default_factory=list, init=False)  # set aside by `pump`
    closed: bool = field(default=False, init=False)  # shutting down: every offer is refused
    # what a controller raised: (upstream, hook, exception); None re-raises it
    on_error: Callable[[UpstreamState, str, Exception], None] | None = None
    _net: StandingQueue = field(default_factory=StandingQueue, init=False)  # the safety net
    demand: Demand = field(default_factory=Demand, init=False)  # the scale-out signal's sums

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
            self._queues.setdefault(name, deque())
        rank = {n: self.classes[n].priority if n in self.classes else _DRAINING
                for n in self._queues}
        self._order = sorted(self._queues, key=lambda n: -rank[n])

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
            wait = (ahead + 1) / (sum(u.controller.limit for u in self.upstreams if u.usable) or 1)
        return self._clamp(wait)

    # --- the decisions -------------------------------------------------------------

    def offer(self, ticket: Ticket, now: float) -> Admitted | Queued | Rejected:
        cls = ticket.cls
        if cls not in self.classes:
            raise KeyError(f"unknown priority class {cls!r}")
        self.demand.arrive(now)  # offered load: counted whatever is decided below
        # every upstream that may serve it hears of it as it arrives, queued or shed: under
        # overload the queue delays admissions by seconds
        for u in self.upstreams:
            if u.usable:
                self._call(u, "on_arrival", ticket.tokens)
        if self.closed:
            return self.shutdown_rejection()
        if not any(u.usable for u in self.upstreams):
            return no_upstream(self.retry_after_min)
        ahead = self._ahead_of(cls)
        if ahead == 0:
            up = least_full(self.upstreams, ticket.tokens)
            if up is not None:
                self._dispatch(ticket, up, now)
                return Admitted(up)
        policy = self.classes[cls]
        objective = self.objective(ticket)
        wait = self._wait.queue_wait(ahead)
        budget = self._wait.budget(policy.queue_budget, objective)
        if wait is not None and wait > budget:
            ra = self._clamp(wait - budget)
            return over_objective(objective, ahead, wait + self.engine_ttft, ra)
        if len(self._queues[cls]) >= self.capacity(cls) or self.depth() >= self.max_queue:
            ra = self.retry_after(self.depth())
            return queue_full(cls, len(self._queues[cls]), self.capacity(cls), ra)
        ticket.due, ticket.deadline = self._due(ticket, policy, now)
        self._queues[cls].append(ticket)
        return Queued(ahead)

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

    def release(self, upstream: UpstreamState, now: float, tokens: int = 0,
                sample: Sample | None = None) -> list[Ticket]:
        """A request on `upstream` ended: free its slot (and its ticket's `tokens`) first,
        then feed its `sample` to the controller (none for a client's doing), then dispatch
        what now fits (Netflix decrements before onSample: a controller that raises cannot
        keep the slot)."""
        self.free(upstream, tokens)
        self.note_completion(now)
        if sample is not None:
            self.note_sample(upstream, sample)
        return self.pump(now)

    def note_sample(self, upstream: UpstreamState, sample: Sample) -> None:
        """One request's outcome for `upstream`'s controller (a client's is never a sample);
        a first token also feeds the engine's TTFT, the engine's part of a predicted wait."""
        if sample.outcome.is_client:
            return
        self._call(upstream, "on_sample", sample)
        if sample.ttft is not None and sample.outcome is Outcome.OK:
            self.note_ttft(sample.ttft)

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
        """One good scrape of `upstream`'s engine metrics, for its controller."""
        self._call(upstream, "on_engine_stats", stats)

    def _call(self, up: UpstreamState, hook: str, *args: object) -> None:
        try:
            getattr(up.controller, hook)(*args)
        except Exception as exc:
            if self.on_error is None:
                raise
            self.on_error(up, hook, exc)

    def free(self, upstream: UpstreamState, tokens: int = 0) -> None:
        """Give back one slot and its `tokens`; dispatches nothing (`pump` does)."""
        upstream.free(tokens)

    def note_completion(self, now: float) -> None:
        """A request finished on an engine: the completion rate's evidence."""
        self._wait.completions.note(now)
        self.demand.complete(now, sum(u.inflight for u in self.upstreams))

    def pump(self, now: float) -> list[Ticket]:
        """Dispatch queued tickets while some upstream has room. A head past its objective
        (`due`) is never dispatched: it is set aside for `take_late` / `expire`. (`max_wait`
        alone is enforced by `expire`, at the tick, as a cap on waiting.)"""
        out: list[Ticket] = []
        for name in self._order:
            q = self._queues[name]
            target = self._target(name)
            standing = self._net.standing(name, q[0].arrived_at if q else None, target, now)
            while q:
                head = q[0]
                if head.due <= now or (standing and now - head.arrived_at > target):
                    self._late.append(q.popleft())
                    continue
                up = least_full(self.upstreams, head.tokens)
                if up is None:
                    return out
                q.popleft()
                self._dispatch(head, up, now)
                out.append(head)
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
        for name, q in self._queues.items():
            if any(t.deadline <= now for t in q):
                late = [t for t in q if t.deadline <= now]
                self._queues[name] = deque(t for t in q if t.deadline > now)
                out.extend(late)
        return out

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
        try:
            q.remove(ticket)
        except ValueError:
            return False
        return True

    def close(self) -> list[Ticket]:
        """Shutting down: remove and return every queued ticket; refuse every later offer."""
        self.closed = True
        out: list[Ticket] = []
        for q in self._queues.values():
            out.extend(q)
            q.clear()
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
        best = least_full(self.upstreams, ticket.tokens, skip=old)
        if best is None:
            return None
        self.free(old, ticket.tokens)
        self._dispatch(ticket, best, now)
        return best

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
        if policy is None or self.closed:
            return False
        due, deadline = self._due(ticket, policy, ticket.arrived_at)
        if now >= due:
            return False
        self.free(up, ticket.tokens)
        up.refusing = True
        ticket.upstream, ticket.dispatched_at = None, None
        ticket.due, ticket.deadline = due, deadline
        self._queues[ticket.cls].appendleft(ticket)
        return True

    def timeout_rejection(self, ticket: Ticket) -> Rejected:
        policy = self.classes.get(ticket.cls)
        cap = policy.max_wait if policy else 0.0
        waited = ticket.deadline - ticket.arrived_at
        return queue_timeout(ticket.cls, cap, waited, self.retry_after(self.depth()))

    # --- internals -----------------------------------------------------------------

    def _ahead_of(self, cls: str) -> int:
        # on every offer: skip empty queues first, build nothing
        rank = self.classes[cls].priority
        ahead = 0
        for name, q in self._queues.items():
            if q:
                policy = self.classes.get(name)
                if (policy.priority if policy is not None else _DRAINING) >= rank:
                    ahead += len(q)
        return ahead

    def _dispatch(self, ticket: Ticket, up: UpstreamState, now: float) -> None:
        if up.inflight == 0 and not any(u.inflight for u in self.upstreams):
            self._wait.completions.resume(now)  # busy again after idle
        up.take(ticket.tokens)
        ticket.upstream = up
        ticket.dispatched_at = now
        ticket.inflight_at_admit = up.inflight
        self._call(up, "on_admit", ticket.tokens)
        self.demand.occupy(now, sum(u.inflight for u in self.upstreams))
