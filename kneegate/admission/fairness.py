"""Fair shares between tenants inside one priority class, counted in tokens.

Pure, like the queue that holds it (`admission.queue`): no clock, no I/O.

One class's queue is a FIFO per tenant. The Virtual Token Counter (Sheng et al., "Fairness
in Serving Large Language Models", OSDI 2024) decides which tenant's head goes next: every
tenant has a counter of the service it has had, in weighted tokens (`admission.ledger`
keeps them: the charges as requests are dispatched and stream, where a tenant coming back
to the queue starts, the one pooled account of the tenants any client can mint), and

- the head of the backlogged tenant with the smallest counter is dispatched first (on a
  tie, the one with less queued, then the one whose head came first);
- work-conserving: a lone tenant is always the least served, and gets the whole engine.

The bound (VTC's Theorem, in the form this queue keeps it): while two tenants stay
backlogged, their counters differ by at most one prompt charge plus the output charges of
the requests in flight (`limit` x the largest output charge). The last time the tenant now
ahead was dispatched it was the least served; since then only that request's prompt and
the output of its requests in flight were added. tests/admission/test_fairness.py checks it
with hypothesis over random traffic. (A tenant coming back may start up to
`Ledger.CREDIT` requests below the least served: the bound holds again once it has been
served that much.)

Where a new request would go (`position`, for the wait the admission queue predicts) and
which request to shed (`victim`) read each queued request's tag: where its tenant's share
put it when it was queued, the tenant's counter plus its work queued ahead and its own, per
unit of weight, less the class's `floor` then (never below the tenant's previous tag, so a
tenant's own requests always count ahead of its next). Less the floor, because every counter
moves on while a request waits (its tenant's answers stream): taken whole, the tags of a
tenant with 30 answers streaming went stale within a queue's wait, and a light tenant
arriving behind them was counted behind all of them and refused (measured:
docs/history/benchmarks.md, "In the simulator (issue 15), 2026-12-01"). Rejection falls on
the tenant furthest over its share: when the queue must shed one request (its wait bound or
its count bound), it is the queued request with the largest tag (the newest of the tenant
whose work would be served last), not the newest arrival; the arrival itself when its own
tag would be the largest, as in a plain FIFO with one tenant.

Fairness in numbers: `jain()` is Jain's index over the service the tenants backlogged at two
readings got between them, (sum x)^2 / (n sum x^2): 1 when equal, 1/n when one got it all.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from kneegate.admission.ledger import Account, Ledger
from kneegate.admission.types import Ticket

__all__ = ["FairQueue", "jain_index"]


def jain_index(xs: Sequence[float]) -> float:
    """Jain's index, (sum x)^2 / (n sum x^2): 1 when all are equal, 1/n when one has all
    (1 for nothing to compare)."""
    squares = sum(x * x for x in xs)
    return sum(xs) ** 2 / (len(xs) * squares) if squares > 0 else 1.0


# (counter, queued, head's arrival, sequence number, account): the order heap's entries
_Entry = tuple[float, int, float, int, Account]
# (tag, sequence number, ticket): a queued ticket by where its tenant's share puts it
_Tag = tuple[float, int, Ticket]


@dataclass
class FairQueue:
    """One class's queue: a FIFO per tenant, the least-served tenant's head first.

    Cost per request is logarithmic in the tenants waiting, not linear: the order is a heap
    of the backlogged tenants' (counter, queued, head's arrival), entries made stale by a
    charge or a change of queue left in it and skipped (compacted when stale ones outnumber
    the live); where a new request would go (`position`) and whom to shed (`victim`) read a
    sorted list of the queued requests' tags, each its tenant's counter plus the work queued
    before it and its own when it was queued (an estimate: charges since then move the true
    order, the heap has it exact). With 100 tenants waiting a linear scan cost ~100 us a
    request (`python -m kneegate_bench.admission_cost`).
    """

    ledger: Ledger = field(init=False)  # the tenants' counters (`admission.ledger`)
    _backlogged: dict[str, Account] = field(default_factory=dict)  # those with a queue
    _heap: list[_Entry] = field(default_factory=list)
    _tags: list[_Tag] = field(default_factory=list)  # sorted
    _tag_of: dict[Ticket, tuple[float, int]] = field(default_factory=dict)
    _seq: Iterator[int] = field(default_factory=itertools.count)

    def __post_init__(self) -> None:
        self.ledger = Ledger(self._touch, self._least_backlogged)

    # --- the queue -------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._tags)

    def __bool__(self) -> bool:
        return bool(self._tags)

    def __iter__(self) -> Iterator[Ticket]:
        for a in self._backlogged.values():
            yield from a.queued

    @property
    def tenants(self) -> int:
        """Tenants with something queued."""
        return len(self._backlogged)

    def head(self) -> Ticket | None:
        """The next to dispatch: the head of the least-served backlogged tenant (on a tie,
        the one with less queued, then the one whose head came first)."""
        a = self._least()
        return None if a is None else a.queued[0]

    def append(self, ticket: Ticket) -> None:
        """Queue `ticket` behind its tenant's; a tenant not backlogged is lifted first."""
        self._enqueue(ticket, left=False)

    def appendleft(self, ticket: Ticket) -> None:
        """Queue `ticket` ahead of its tenant's (an engine refused it unstarted)."""
        self._enqueue(ticket, left=True)

    def remove(self, ticket: Ticket) -> bool:
        """Take a queued `ticket` out (dispatched, timed out, withdrawn, evicted)."""
        key = self._tag_of.pop(ticket, None)
        if key is None:
            return False
        del self._tags[bisect.bisect_left(self._tags, key)]
        a = self._backlogged[self.ledger.owner(ticket).name]
        if a.queued[0] is ticket:
            a.queued.popleft()
        else:
            a.queued.remove(ticket)
        a.queued_tokens -= ticket.tokens
        if a.queued:
            self._touch(a)
        else:
            del self._backlogged[a.policy.name]
            a.mark = None
            self.ledger.settle(a)
        return True

    def remove_if(self, late: Callable[[Ticket], bool]) -> list[Ticket]:
        """Take out and return every queued ticket `late` says."""
        out = [t for t in self if late(t)]
        for t in out:
            self.remove(t)
        return out

    def clear(self) -> list[Ticket]:
        out = list(self)
        for t in out:
            self.remove(t)
        return out

    # --- charging (the ledger's) ------------------------------------------------------

    def dispatched(self, ticket: Ticket, queued: bool = True) -> None:
        """`ticket` goes to an engine: its tenant is charged its prompt estimate
        (`Ledger.dispatched`; `queued`: it was taken from this queue)."""
        self.ledger.dispatched(ticket, queued)

    def charge_output(self, ticket: Ticket, tokens: int) -> None:
        """`tokens` more output tokens of `ticket` (in flight) streamed."""
        self.ledger.charge_output(ticket, tokens)

    def released(self, ticket: Ticket, output_tokens: int | None) -> None:
        """`ticket`'s request ended; `output_tokens`: all it produced (None: unknown).
        The output not yet charged is charged now; an engine's refusal is `refund`."""
        self.ledger.released(ticket, output_tokens)

    def refund(self, ticket: Ticket) -> None:
        """`ticket` comes back unserved (its engine refused it, its caller left before
        the engine saw it): what it was charged is given back, its slot too."""
        self.ledger.refund(ticket)

    # --- choosing ------------------------------------------------------------------

    def position(self, ticket: Ticket) -> int:
        """How many queued tickets of this class would be dispatched before `ticket`, were
        it queued now: those whose tag is below where its tenant's share puts it."""
        return bisect.bisect_left(self._tags, (self._end(ticket),))

    def victim(self, arrival: Ticket) -> Ticket:
        """Which request to shed when one must go: the queued request whose tenant's share
        puts it last (the newest of the tenant furthest over its share), `arrival` counted
        as queued behind its own tenant's; `arrival` itself when it would be last."""
        if self._tags and self._tags[-1][0] > self._end(arrival):
            return self._tags[-1][2]
        return arrival

    def jain(self) -> float | None:
        """Jain's index over the service (counter growth) of the tenants backlogged at
        this reading and the last; None with fewer than two such tenants. Takes a reading."""
        xs = []
        for a in self._backlogged.values():
            if a.mark is not None:
                xs.append(max(0.0, a.counter - a.mark))
            a.mark = a.counter
        if len(xs) < 2 or not any(xs):
            return None
        return jain_index(xs)

    def counter(self, name: str) -> float | None:
        """Tenant `name`'s counter (None: not known here)."""
        return self.ledger.counter(name)

    def queued(self, name: str) -> int:
        """Tenant `name`'s requests queued here."""
        a = self._backlogged.get(name)
        return len(a.queued) if a is not None else 0

    def held(self, name: str) -> int:
        """Tenant `name`'s requests here, queued or in flight."""
        return self.ledger.held(name)

    def under_share(self, ticket: Ticket, slots: float) -> bool:
        """Whether `ticket`'s tenant holds fewer requests here than its weighted share
        of `slots` (`Ledger.under_share`)."""
        return self.ledger.under_share(ticket, slots)

    # --- internals -------------------------------------------------------------------

    def _end(self, ticket: Ticket) -> float:
        """Where `ticket` would finish in its tenant's share, queued now behind its own
        (in counter units: its tenant's counter, or where it would start, plus the work
        queued and its own, per unit of weight)."""
        policy = self.ledger.owner(ticket)
        own = self.ledger.cost(ticket.tokens, 1) / policy.weight
        a = self._backlogged.get(policy.name)
        if a is None:  # lifted as `append` would
            return self.ledger.start(ticket) - self.ledger.floor + own
        # past its own queued requests' tags (so they all count before it), and past its
        # counter plus the work queued (those tags were taken when its counter was lower)
        ahead = (a.counter - self.ledger.floor
                 + self.ledger.cost(a.queued_tokens, len(a.queued)) / policy.weight)
        return max(a.last_tag, ahead) + own

    def _enqueue(self, ticket: Ticket, left: bool) -> None:
        policy = self.ledger.owner(ticket)
        ticket.pooled = policy is self.ledger.POOL
        end = self._end(ticket)  # before its tenant is lifted: `_end` lifts as this does
        a = self._backlogged.get(policy.name)
        if a is None:  # arriving, or back after a while
            a = self.ledger.account(policy, self.ledger.start(ticket))
            self._backlogged[a.policy.name] = a
            if len(self._backlogged) == 2:  # the heap is kept only while two or more wait
                self._heap = []
                for b in self._backlogged.values():
                    if b is not a:
                        self._touch(b)  # (a's own entry: below, once its ticket is in)
        if left:  # at its tenant's head: its tag, where its share puts that
            a.queued.appendleft(ticket)
            tag = (a.counter - self.ledger.floor
                   + self.ledger.cost(ticket.tokens, 1) / a.policy.weight)
            a.last_tag = tag if len(a.queued) == 1 else max(a.last_tag, tag)
        else:
            a.queued.append(ticket)
            tag = a.last_tag = end
        a.queued_tokens += ticket.tokens
        key = (tag, next(self._seq))
        self._tag_of[ticket] = key
        bisect.insort(self._tags, (*key, ticket))
        self._touch(a)

    def _least(self) -> Account | None:
        """The least-served backlogged tenant (stale heap entries dropped on the way)."""
        if len(self._backlogged) < 2:  # none, or one tenant waiting (no heap kept)
            return next(iter(self._backlogged.values()), None)
        heap = self._heap
        while heap:
            a = heap[0][4]
            if a.entry == heap[0][3] and a.queued:
                return a
            heapq.heappop(heap)
        return None

    def _least_backlogged(self) -> float:
        """The least counter of a tenant with something queued; the floor when none has."""
        a = self._least()
        return self.ledger.floor if a is None else a.counter

    def _touch(self, a: Account) -> None:
        """`a`'s place in the order changed (a charge, a request in or out): a new entry;
        the old one goes stale. Stale entries are compacted once they outnumber the live.
        With one tenant waiting there is no order to keep: nothing."""
        if len(self._backlogged) < 2:
            return
        a.entry = seq = next(self._seq)
        heapq.heappush(self._heap, (a.counter, len(a.queued), a.queued[0].arrived_at, seq, a))
        if len(self._heap) > 2 * len(self._backlogged) + 64:
            self._heap = [(b.counter, len(b.queued), b.queued[0].arrived_at, b.entry, b)
                          for b in self._backlogged.values()]
            heapq.heapify(self._heap)

