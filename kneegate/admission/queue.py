"""Admission: admit now, queue, or shed. A pure state machine — no asyncio, no clock.

Time comes in as `now` on every call, so the gateway (real time, through the thin
async layer in `gateway.gate`) and `kneegate.sim` (virtual time) run this
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

`AdmissionQueue` is built in three layers, a module each, each using only those under it:

    queue.py    AdmissionQueue: the decisions on one ticket: offer (admit now, queue or
                shed), release, charge, first_token, free, requeue
    classes.py  ClassQueues: a queue per priority class: pump, expire, tick, withdraw,
                close, reconfigure
    slots.py    Slots: the upstreams: where a ticket runs (and reroute), what is in flight
                and when a slot frees, what each controller hears

The queue is bounded by time as well as by count. Each class has a TTFT objective, seconds
from a request's arrival to its first token (a request may carry a tighter one). On offer, a
request that cannot be admitted at once is refused (429 `over_objective`) when its predicted
wait in the queue, (queued ahead + 1) / the measured completion rate, or the queue's own
drain rate where that is slower, but no less than the oldest answer in flight has left to
run (`_first_free`; before four answers have ended, (ahead + 1) x the oldest's age / in
flight: `_cold_wait`), is more than its class's `queue_budget` (0.25) of the objective less
the engine's recent TTFT: told at once, not after waiting (the prediction, and why a
quarter: `admission.wait`). The quarter rations an excess, and holds only where there is one
(`Demand.excess`: arrivals outnumber completions); without one the budget is the whole
objective less the engine's TTFT, and a request that only the engines' prefill backlog holds
back (an upstream with a free slot at its `prefill_cap`) is queued unpredicted: there it
waits for the prefills ahead of it as it would in the engine's own queue, and leaves at its
deadline if they outlast it. Under an excess, the budget rations the excess of tenants over
their share: a tenant holding fewer requests here than its weighted share of the slots
(`FairQueue.under_share`; never a tenant alone) may be predicted to wait the whole objective
less the engine's TTFT for its place, and is then queued even where the last place is late
by that budget: where slots free in waves (answers of one length), the next one is often
further than a quarter of the objective, and with every tenant held to it fair shares had
nothing queued to order (docs/experiments/2026-12-07-trace-scale.md). A queued request
leaves the queue (503 `queue_timeout`) once its class's `max_wait` or its objective less the
engine's TTFT has passed, and is never dispatched after that: the engine does no work for a
user who will see a miss or has left.

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

from collections.abc import Callable
from dataclasses import dataclass, field

from kneegate.admission.classes import ClassQueues
from kneegate.admission.quota import TokenBuckets
from kneegate.admission.types import (
    Admitted,
    Queued,
    Rejected,
    RejectReason,
    Ticket,
    UpstreamState,
    least_full,
    no_upstream,
    over_objective,
    queue_full,
    tenant_quota,
)
from kneegate.controllers.base import Sample

__all__ = ["AdmissionQueue"]


@dataclass
class AdmissionQueue(ClassQueues):
    """Bounded priority queue in front of a pool of upstreams."""

    # every queue of this gateway, where pools share its tenants (`share_tenants`)
    _peers: Callable[[], list[AdmissionQueue]] | None = field(default=None, init=False)

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
        # the budget rations an excess of arrivals over what the engines serve; with none,
        # a refused request is goodput lost, not one that the next arrival replaces, and
        # one that only an engine's prefill backlog holds back waits here as it would there
        rationed = self.demand.excess()
        held = not rationed and self._prefill_held(ticket.model)
        budget = self._wait.budget(policy.queue_budget if rationed else 1.0, objective)
        # the budget rations the excess of tenants over their share: one under its share
        # may wait for its place as long as its objective allows
        under = q.under_share(ticket, self._slots())
        own = self._wait.budget(1.0, objective) if under else budget
        ahead = higher + q.position(ticket)
        wait = None if held else self._predict(ahead, now)
        if wait is not None and wait > own:  # even its fair place is too late
            return over_objective(objective, ahead, wait + self.engine_ttft,
                                  self._clamp(wait - own))
        # someone's place is too late (the last's), or the queue is at its count: the
        # request to shed is the newest of the tenant furthest over its share
        last = None if held else self._predict(higher + len(q), now)
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

    def share_tenants(self, buckets: TokenBuckets,
                      peers: Callable[[], list[AdmissionQueue]]) -> None:
        """Several queues serve one gateway (`admission.pools`): tenants' caps count across
        them all, `buckets` being their shared tokens-a-minute and `peers` every queue."""
        self._buckets, self._peers = buckets, peers

    # --- a ticket dispatched -------------------------------------------------------

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

    def first_token(self, ticket: Ticket, now: float) -> list[Ticket]:
        """A dispatched ticket's first token came: its engine's prefill backlog is one
        shorter. The upstream's TTFT line learns of it (the backlog it found, its TTFT) and
        its `prefill_cap` is recomputed; what now fits is dispatched. A later call for it
        does nothing."""
        return self.pump(now) if self._first_token(ticket, now) else []

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
