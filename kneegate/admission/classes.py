"""The priority classes' queues of the admission queue: what waits, in what order it is
dispatched, and when it stops waiting. Pure, like the queue built on them
(`admission.queue`, whose middle layer this is, over `admission.slots`): no asyncio, no
clock.

Each class has its own queue (`FairQueue`), bounded by count (`max_queue`, the class's
`queue_share` of it) and by time: a queued request is `due` when its objective less the
engine's recent TTFT has passed, and its deadline is the earlier of that and its class's
`max_wait` (`_due`). `pump` dispatches while some upstream has room and sets a head past
its due aside (`take_late`); `expire`, at the tick, removes what passed its deadline; a
reload keeps what is queued, a removed class draining after every configured one.

Dispatch order: higher `priority` classes first; within a class, fair shares between
tenants counted in tokens (`admission.fairness`: the least-served tenant's head first, FIFO
within a tenant; with one tenant, plain FIFO). A request goes to the usable upstream with
room for it (`UpstreamState`: its limit, and its controller's token budget) that is least
full, in-flight / limit (`least_full`), and that serves the model it names (`admission.pools`);
with `affinity` on, to the one that served its prompt's longest known prefix while that one
has room (`admission.affinity`). A head that does not fit waits, and what is queued
behind it waits too, so a large request is never starved by smaller ones that slip past it.

The safety net, for when the prediction is wrong (capacity fell, prompts grew, other
gateways share the engine): while a class's queue stands (`StandingQueue`: every head has
waited longer than its target, the wait `offer` admits against, for 4 targets in a row), a
head over target is answered 503 instead of dispatched: CoDel's test with its drop replaced
by an answer (chosen over newest-first by measurement: `admission.wait`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from kneegate.admission.fairness import FairQueue
from kneegate.admission.quota import TokenBuckets
from kneegate.admission.slots import Slots
from kneegate.admission.types import (
    ClassPolicy,
    Rejected,
    Ticket,
    UpstreamState,
    least_full,
    queue_timeout,
    shutting_down,
)
from kneegate.admission.wait import StandingQueue

__all__ = ["ClassQueues"]

_DRAINING = -(10**9)  # the rank of a class a reload removed: after every configured class


@dataclass
class ClassQueues(Slots):
    """A bounded queue per priority class in front of the upstreams' slots. The middle
    layer of `AdmissionQueue` (over `Slots`)."""

    classes: dict[str, ClassPolicy]
    max_queue: int = 256
    retry_after_min: int = 1
    retry_after_max: int = 60
    closed: bool = field(default=False, init=False)  # shutting down: every offer is refused
    _queues: dict[str, FairQueue] = field(default_factory=dict, init=False)
    _order: list[str] = field(default_factory=list, init=False)
    _late: list[Ticket] = field(default_factory=list, init=False)  # set aside by `pump`
    _net: StandingQueue = field(default_factory=StandingQueue, init=False)  # the safety net
    _buckets: TokenBuckets = field(default_factory=TokenBuckets, init=False)  # tokens a minute

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

    def fairness(self) -> dict[str, float | None]:
        """Each class's Jain's index since the last call (`FairQueue.jain`); None where
        fewer than two tenants stayed backlogged."""
        return {name: q.jain() for name, q in self._queues.items() if name in self.classes}

    def tenant_held(self, name: str) -> int:
        """Requests of tenant `name` queued or in flight here."""
        return sum(q.held(name) for q in self._queues.values())

    def objective(self, ticket: Ticket) -> float:
        """Seconds from arrival to the first token that `ticket` must meet: its class's
        objective, tightened by the request's own."""
        return min(self.classes[ticket.cls].ttft_objective, ticket.ttft_objective)

    # --- over time -----------------------------------------------------------------

    def tick(self, now: float, upstreams: Iterable[UpstreamState] | None = None
             ) -> tuple[list[Ticket], list[Ticket]]:
        """The controllers' tick (`upstreams`: those with requests, the queue's own by
        default), then dispatch what fits, then time out what waited too long: (dispatched,
        expired). The dispatched were called `on_admit` already."""
        for u in self.upstreams if upstreams is None else upstreams:
            self._call(u, "on_tick", now, u.inflight)
        dispatched = self.pump(now)
        return dispatched, self.expire(now)

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

    @property
    def has_late(self) -> bool:
        """Heads `pump` set aside, not yet taken (`take_late`)."""
        return bool(self._late)

    def take_late(self) -> list[Ticket]:
        """The heads `pump` set aside past their objective (cheap: no scan), removed."""
        late, self._late = self._late, []
        return late

    def timeout_rejection(self, ticket: Ticket) -> Rejected:
        policy = self.classes.get(ticket.cls)
        cap = policy.max_wait if policy else 0.0
        waited = ticket.deadline - ticket.arrived_at
        return queue_timeout(ticket.cls, cap, waited, self.retry_after(self.depth()))

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
