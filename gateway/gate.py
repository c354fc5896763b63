"""The thin async layer over the pure `AdmissionQueue`: futures, permits and the tick.

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
import time

from controllers.base import Outcome, Sample
from gateway.admission import (
    AdmissionQueue,
    Admitted,
    Queued,
    Rejected,
    RejectReason,
    Ticket,
)
from gateway.errors import NoUpstream, QueueFull, QueueTimeout, Rejection
from gateway.metrics import GatewayMetrics
from gateway.types import Clock
from gateway.upstreams import Upstream

__all__ = ["Gate", "Permit"]

_REJECTIONS: dict[RejectReason, type[Rejection]] = {
    RejectReason.QUEUE_FULL: QueueFull,
    RejectReason.QUEUE_TIMEOUT: QueueTimeout,
    RejectReason.NO_UPSTREAM: NoUpstream,
}


def rejection(r: Rejected) -> Rejection:
    return _REJECTIONS[r.reason](r.message, r.retry_after)


class Permit:
    """A held slot on one upstream. Ends in exactly one outcome."""

    __slots__ = ("_done", "_gate", "ticket", "upstream")

    def __init__(self, gate: Gate, ticket: Ticket, upstream: Upstream) -> None:
        self._gate, self.ticket, self.upstream = gate, ticket, upstream
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
        self._gate._finish(self, outcome, sample)
        return True


class Gate:
    """Admission for one gateway process."""

    def __init__(
        self, queue: AdmissionQueue, metrics: GatewayMetrics, clock: Clock = time.monotonic
    ) -> None:
        self.queue, self.metrics, self.clock = queue, metrics, clock

    async def acquire(self, cls: str, tokens: int = 0) -> Permit:
        """A permit now, a permit after waiting in the queue, or a Rejection raised.
        `tokens`: the prompt's size estimate, for controllers with a token budget."""
        now = self.clock()
        ticket = Ticket(cls, now, tokens=tokens)
        m = self.metrics
        m.child(m.received, cls).inc()
        decision = self.queue.offer(ticket, now)
        if isinstance(decision, Admitted):
            self._count_admitted(ticket)
            return self._permit(ticket)
        if isinstance(decision, Rejected):
            self.metrics.shed.labels(cls, decision.reason.value).inc()
            raise rejection(decision)
        assert isinstance(decision, Queued)
        return await self._wait(ticket)

    async def _wait(self, ticket: Ticket) -> Permit:
        fut: asyncio.Future[Rejected | None] = asyncio.get_running_loop().create_future()
        ticket.payload = fut
        try:
            result = await fut
        except asyncio.CancelledError:
            self._abandon(ticket)
            raise
        if result is not None:
            raise rejection(result)
        return self._permit(ticket)

    def _abandon(self, ticket: Ticket) -> None:
        # the caller went away while queued, or just after its slot came
        if ticket.dispatched_at is not None:
            self._permit(ticket).finish(Outcome.CLIENT_CANCELLED)
        elif self.queue.withdraw(ticket):
            self.metrics.shed.labels(ticket.cls, "client_gone").inc()

    def _permit(self, ticket: Ticket) -> Permit:
        up = ticket.upstream
        assert isinstance(up, Upstream), "admission dispatched to a foreign upstream"
        return Permit(self, ticket, up)

    def _count_admitted(self, ticket: Ticket) -> None:
        assert ticket.upstream is not None and ticket.dispatched_at is not None
        m = self.metrics
        m.child(m.admitted, ticket.upstream.name, ticket.cls).inc()
        m.child(m.queue_wait, ticket.cls).observe(ticket.dispatched_at - ticket.arrived_at)

    def _wake(self, tickets: list[Ticket]) -> None:
        for t in tickets:
            self._count_admitted(t)
            fut: asyncio.Future[Rejected | None] = t.payload
            # A done future here was cancelled with its waiter, whose _abandon (still to run)
            # gives the slot back; doing it here too would release it twice.
            if not fut.done():
                fut.set_result(None)

    def _finish(self, permit: Permit, outcome: Outcome, sample: Sample | None) -> None:
        up = permit.upstream
        ttft = tpot = None
        tokens = 0
        if sample is not None and outcome is not Outcome.CLIENT_CANCELLED:
            up.controller.on_sample(sample)
            ttft, tpot, tokens = sample.ttft, sample.tpot, sample.output_tokens
        self.metrics.count_finished(up.name, outcome, ttft, tpot, tokens)
        self._wake(self.queue.release(up, self.clock(), permit.ticket.tokens))

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

    def tick(self, upstreams: list[Upstream]) -> None:
        """Advance controllers, dispatch what fits, time out what waited too long."""
        now = self.clock()
        for up in upstreams:
            up.controller.on_tick(now, up.inflight)
        self._wake(self.queue.pump(now))
        for t in self.queue.expire(now):
            self.metrics.queue_timeout.labels(t.cls).inc()
            fut: asyncio.Future[Rejected | None] = t.payload
            if not fut.done():
                fut.set_result(self.queue.timeout_rejection(t))

    def pump(self) -> None:
        """Dispatch queued tickets after limits or upstream health changed."""
        self._wake(self.queue.pump(self.clock()))
