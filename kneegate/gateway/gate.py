"""The thin async layer over the pure admission core (`Pools`, one `AdmissionQueue` a pool).

    permit = await gate.acquire("batch", 700) # raises a Rejection (429 / 503)
    try:
        ...relay...
    finally:
        permit.finish(outcome, sample)          # sync, idempotent: the slot is free now

A queued request waits on a future that the gate resolves when `release`, `pump` or
`expire` decides its fate; queue timeouts are found by the tick (`tick_interval`
granularity), so a waiter needs no timer of its own. Every counter in `GatewayMetrics`
moves in the same synchronous step as the queue state it counts.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any, NamedTuple

from kneegate.admission.pools import Pools
from kneegate.admission.types import (
    ANONYMOUS,
    Admitted,
    Queued,
    Rejected,
    RejectReason,
    TenantPolicy,
    Ticket,
    UpstreamState,
)
from kneegate.controllers.base import EngineStats, Outcome, Sample
from kneegate.gateway.errors import (
    NoUpstream,
    OverObjective,
    QueueFull,
    QueueTimeout,
    Rejection,
    ShuttingDown,
    TenantQuota,
)
from kneegate.gateway.observability.metrics import GatewayMetrics
from kneegate.gateway.types import Clock
from kneegate.gateway.upstream.state import Upstream

__all__ = ["Gate", "Permit"]

log = logging.getLogger("kneegate")

_REJECTIONS: dict[RejectReason, type[Rejection]] = {
    RejectReason.QUEUE_FULL: QueueFull,
    RejectReason.OVER_OBJECTIVE: OverObjective,
    RejectReason.QUEUE_TIMEOUT: QueueTimeout,
    RejectReason.NO_UPSTREAM: NoUpstream,
    RejectReason.SHUTTING_DOWN: ShuttingDown,
    RejectReason.TENANT_QUOTA: TenantQuota,
}


class _Lane(NamedTuple):
    """The counters one (upstream, class, tenant) moves on the hot path, resolved once."""

    admitted: Any
    tenant_admitted: Any
    queue_wait: Any
    output_tokens: Any


def rejection(r: Rejected) -> Rejection:
    return _REJECTIONS[r.reason](r.message, r.retry_after)


class Permit:
    """A held slot on one upstream. Ends in exactly one outcome."""

    __slots__ = ("_done", "_gate", "lane", "ticket", "upstream")

    def __init__(self, gate: Gate, ticket: Ticket, upstream: Upstream, lane: _Lane) -> None:
        self._gate, self.ticket, self.upstream = gate, ticket, upstream
        self.lane = lane  # its counters (`output_tokens` is the tenant's, whatever upstream)
        self._done = False

    @property
    def admitted_at(self) -> float:
        at = self.ticket.dispatched_at
        assert at is not None, "a permit exists only for a dispatched ticket"
        return at

    @property
    def done(self) -> bool:
        return self._done

    def finish(self, outcome: Outcome, sample: Sample | None = None) -> bool:
        """Free the slot, count the outcome, feed the controller. Later calls do nothing."""
        if self._done:
            return False
        self._done = True
        self._gate.finish(self, outcome, sample)
        return True


class Gate:
    """Admission for one gateway process.

    A ticket the queue dispatches while its caller waits is *handed over* until the
    caller's task resumes: it is counted admitted only then, and until then it shows as
    queued (its class's depth) and not in flight, so the identities hold at every scrape
    and a caller that leaves in that moment is shed `client_gone`, not admitted and
    cancelled (the engine never saw it).

    Controllers are called by the queue (it owns their lifecycle); what they raise comes
    back to `_controller_error`, which logs it once and counts it: a controller bug costs
    its own update, never a slot or a request.
    """

    def __init__(
        self, queue: Pools, metrics: GatewayMetrics, clock: Clock = time.monotonic
    ) -> None:
        self.queue, self.metrics, self.clock = queue, metrics, clock
        self.handing: dict[str, int] = {}  # class -> tickets dispatched, caller not resumed
        self._logged: set[tuple[str, str]] = set()  # (upstream, hook) whose error was logged
        queue.on_error = self._controller_error
        # what the hot path moves, resolved once per class, tenant and upstream (a dict
        # lookup a request instead of a child's for each counter): `_lane`, `_received`
        self._lanes: dict[tuple[str, str, str], _Lane] = {}
        self._received: dict[str, Any] = {}

    def depth(self, cls: str) -> int:
        """Requests of `cls` waiting for a slot, as counted: queued or being handed one."""
        return self.queue.depth(cls) + self.handing.get(cls, 0)

    async def acquire(self, cls: str, tokens: int = 0, objective: float = math.inf,
                      tenant: TenantPolicy = ANONYMOUS, streamed: bool = False,
                      generation: bool = True, model: str | None = None,
                      prefix: tuple[int, ...] = ()) -> Permit:
        """A permit now, a permit after waiting in the queue, or a Rejection raised.
        `tokens`: the prompt's size estimate, for controllers with a token budget;
        `objective`: the request's own TTFT objective, seconds (tightens its class's);
        `tenant`: whom it is for (fair shares within the class, the tenant's caps);
        `streamed`: its answer streams, and `first_token` will be told of its first token;
        `generation`: False for a request that is no evidence (it passes with no slot);
        `model`: the model it names (only an upstream serving it takes it); `prefix`: its
        prompt's prefix keys, for affinity (admission/affinity.py)."""
        now = self.clock()
        ticket = Ticket(cls, now, tokens=tokens, ttft_objective=objective, tenant=tenant,
                        streamed=streamed, generation=generation, model=model, prefix=prefix)
        received = self._received.get(cls)
        if received is None:
            m = self.metrics
            received = self._received[cls] = m.child(m.received, cls)
        received.inc()
        decision = self.queue.offer(ticket, now)
        if type(decision) is Admitted:
            return self._admit(ticket)
        if isinstance(decision, Rejected):
            self._shed(ticket, decision.reason.value)
            raise rejection(decision)
        assert isinstance(decision, Queued)
        if decision.evicted is not None:  # another tenant's, over its share, told now
            victim, answer = decision.evicted
            self._shed(victim, answer.reason.value)
            fut: asyncio.Future[Rejected | None] = victim.payload
            if not fut.done():
                fut.set_result(answer)
        return await self._wait(ticket)

    def _shed(self, ticket: Ticket, reason: str) -> None:
        m = self.metrics
        m.child(m.shed, ticket.cls, reason).inc()
        if reason != "client_gone":
            m.child(m.tenant_rejected, ticket.tenant.label, ticket.cls, reason).inc()

    def charge(self, permit: Permit, tokens: int, now: float) -> None:
        """`tokens` more output tokens of `permit`'s request streamed by `now`: its tenant's
        share and token quota."""
        if tokens > 0 and not permit.done:
            self.queue.charge(permit.ticket, tokens, now)

    def fairness(self) -> None:
        """Set each class's fairness gauge from a reading of its queue (once a second)."""
        for cls, jain in self.queue.fairness().items():
            self.metrics.fairness.labels(cls).set(1.0 if jain is None else jain)

    async def _wait(self, ticket: Ticket) -> Permit:
        fut: asyncio.Future[Rejected | None] = asyncio.get_running_loop().create_future()
        ticket.payload = fut
        return await self._slot(ticket, fut)

    async def _slot(self, ticket: Ticket, fut: asyncio.Future[Rejected | None]) -> Permit:
        """Wait for queued `ticket`'s slot (its payload is `fut`)."""
        try:
            result = await fut
        except asyncio.CancelledError:
            self._abandon(ticket)
            raise
        if result is not None:
            raise rejection(result)
        self._handed(ticket)
        return self._admit(ticket)

    def _abandon(self, ticket: Ticket) -> None:
        # the caller went away while queued, or before it resumed with its slot
        if ticket.dispatched_at is not None:
            self._handed(ticket)
            self.queue.free(ticket)
            self._shed(ticket, "client_gone")
            self._pump(self.clock())
        elif self.queue.withdraw(ticket):
            self._shed(ticket, "client_gone")

    def _handed(self, ticket: Ticket) -> None:
        self.handing[ticket.cls] -= 1
        self._upstream(ticket).handing -= 1

    @staticmethod
    def _upstream(ticket: Ticket) -> Upstream:
        up = ticket.upstream
        assert isinstance(up, Upstream), "admission dispatched to a foreign upstream"
        return up

    def _admit(self, ticket: Ticket) -> Permit:
        """Count the admission, hand out the permit (the queue told the controller)."""
        up = self._upstream(ticket)
        assert ticket.dispatched_at is not None
        lane = self._lane(up.name, ticket.cls, ticket.tenant.label)
        lane.admitted.inc()
        lane.tenant_admitted.inc()
        lane.queue_wait.observe(ticket.dispatched_at - ticket.arrived_at)
        return Permit(self, ticket, up, lane)

    def _lane(self, upstream: str, cls: str, tenant: str) -> _Lane:
        lane = self._lanes.get((upstream, cls, tenant))
        if lane is None:
            m = self.metrics
            lane = self._lanes[upstream, cls, tenant] = _Lane(
                m.child(m.admitted, upstream, cls), m.child(m.tenant_admitted, tenant, cls),
                m.child(m.queue_wait, cls), m.child(m.tenant_output_tokens, tenant, cls))
        return lane

    def _wake(self, tickets: list[Ticket]) -> None:
        for t in tickets:
            self.handing[t.cls] = self.handing.get(t.cls, 0) + 1
            self._upstream(t).handing += 1
            fut: asyncio.Future[Rejected | None] = t.payload
            # A done future here was cancelled with its waiter, whose _abandon (still to run)
            # gives the slot back.
            if not fut.done():
                fut.set_result(None)

    def finish(self, permit: Permit, outcome: Outcome, sample: Sample | None) -> None:
        """`permit`'s request ended in `outcome` (call `Permit.finish`: it ends once)."""
        # the queue frees the slot first, then feeds the controller (guarded), then
        # dispatches: a controller that raises cannot keep the slot
        up, t = permit.upstream, permit.ticket
        now = self.clock()
        dispatched = self.queue.release(t, now, sample)
        ttft = tpot = None
        tokens = 0
        if sample is not None and not outcome.is_client:
            ttft, tpot, tokens = sample.ttft, sample.tpot, sample.output_tokens
            if ttft is not None:  # the user's clock: from arrival, not dispatch
                at = t.dispatched_at
                assert at is not None, "a permit's ticket was dispatched"
                user = ttft + at - t.arrived_at
                self.metrics.count_user_ttft(t.cls, user, tokens,
                                             user <= self.queue.objective(t))
        self.metrics.count_finished(up.name, outcome, ttft, tpot, tokens)
        if tokens:
            permit.lane.output_tokens.inc(tokens)
        self._woken(dispatched)

    def _controller_error(self, up: UpstreamState, hook: str, exc: Exception) -> None:
        """What a controller raised in `hook`: logged once per (upstream, hook), counted."""
        self.metrics.child(self.metrics.controller_errors, up.name, hook).inc()
        if (up.name, hook) not in self._logged:
            self._logged.add((up.name, hook))
            log.error("controller %s of upstream %s raised in %s (logged once; counted in "
                      "kneegate_controller_errors_total)", type(up.controller).__name__,
                      up.name, hook, exc_info=exc)

    def reroute(self, permit: Permit) -> bool:
        """Move `permit` to another upstream with room after its own could not be reached
        (the engine never saw the request). False, the permit unchanged, when none has room.

        Counted once: the request stays admitted once (under the upstream first chosen)
        and finishes once, on the upstream that serves it; the move is counted in
        `kneegate_upstream_reroutes_total` by the upstream it left."""
        old = permit.upstream
        up = self.queue.reroute(permit.ticket, self.clock())
        if up is None:
            return False
        assert isinstance(up, Upstream), "admission rerouted to a foreign upstream"
        permit.upstream = up
        self.metrics.child(self.metrics.reroutes, old.name).inc()
        self.pump()
        return True

    async def retry_refused(self, permit: Permit, sample: Sample | None) -> bool:
        """The engine refused `permit`'s request before starting it (vLLM's own valve is
        full): send it elsewhere rather than pass the 503 on. Another upstream with room
        takes it (`reroute`); else it goes back to the head of its class's queue while its
        objective allows and waits for a slot like any queued request, the refusing
        upstream having no room until one of its requests ends. Its controller hears the
        refusal as a drop (`sample`) either way.

        True: `permit` now holds the new slot. False: nothing changed, the refusal stands
        (relay it; finishing the permit feeds the drop). Raises Rejection when the requeued
        request times out in the queue or the gateway shuts down, CancelledError when its
        caller leaves (counted like any queued request's).

        Counted: a requeue ends the first admission as `finished{outcome="engine_refused"}`
        and counts `requeued`; the next slot is admitted again, so
        received + requeued = admitted + shed + queue_timeout + queue_depth."""
        old, t = permit.upstream, permit.ticket
        if self.reroute(permit):
            old.refusing = True  # after `reroute` freed its slot
            self.queue.engine_refused(old)
            if sample is not None:
                self.queue.note_sample(old, sample)
            return True
        now = self.clock()
        if not self.queue.requeue(t, now):
            return False
        m = self.metrics
        permit._done = True  # its slot is free; a later `finish` must not free another
        m.child(m.finished, old.name, "engine_refused").inc()
        m.child(m.requeued, t.cls).inc()
        if sample is not None:
            self.queue.note_sample(old, sample)
        fut: asyncio.Future[Rejected | None] = asyncio.get_running_loop().create_future()
        t.payload = fut
        self._pump(now)  # the head may go at once to an upstream with room
        again = await self._slot(t, fut)
        permit.upstream, permit._done = again.upstream, False
        return True

    def tick(self, upstreams: list[Upstream]) -> None:
        """Advance controllers, dispatch what fits, time out what waited too long."""
        dispatched, expired = self.queue.tick(self.clock(), upstreams)
        self._woken(dispatched)
        self._time_out(expired)

    def engine_stats(self, up: Upstream, stats: EngineStats) -> None:
        """One good scrape of `up`'s engine, for its controller (through the queue)."""
        self.queue.engine_stats(up, stats)

    def first_token(self, permit: Permit) -> None:
        """`permit`'s streamed answer sent its first token: its engine's prefill backlog
        is one shorter, and what now fits there is dispatched (nothing, once it ended)."""
        self._woken(self.queue.first_token(permit.ticket, self.clock()))

    def _pump(self, now: float) -> None:
        self._woken(self.queue.pump(now))

    def _woken(self, dispatched: list[Ticket]) -> None:
        """Hand slots to the dispatched; answer at once the heads `pump` set aside."""
        if dispatched:
            self._wake(dispatched)
        if self.queue.has_late:
            self._time_out(self.queue.take_late())

    def _time_out(self, tickets: list[Ticket]) -> None:
        m = self.metrics
        for t in tickets:
            m.child(m.queue_timeout, t.cls).inc()
            m.child(m.tenant_rejected, t.tenant.label, t.cls, "queue_timeout").inc()
            fut: asyncio.Future[Rejected | None] = t.payload
            if not fut.done():
                fut.set_result(self.queue.timeout_rejection(t))

    def close(self) -> int:
        """Shutting down: refuse every queued request (503 shutting_down, counted as shed)
        and every later one. Returns how many were queued."""
        tickets = self.queue.close()
        for t in tickets:
            self._shed(t, RejectReason.SHUTTING_DOWN.value)
            fut: asyncio.Future[Rejected | None] = t.payload
            # a done future: its waiter was cancelled, and its _abandon finds nothing to
            # withdraw, so this count is the only one
            if not fut.done():
                fut.set_result(self.queue.shutdown_rejection())
        return len(tickets)

    def pump(self) -> None:
        """Dispatch queued tickets after limits or upstream health changed."""
        self._pump(self.clock())
