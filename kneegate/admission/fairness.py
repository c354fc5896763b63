"""Fair shares between tenants inside one priority class, counted in tokens.

Pure, like the queue that holds it (`admission.queue`): no clock, no I/O.

One class's queue is a FIFO per tenant. The Virtual Token Counter (Sheng et al., "Fairness
in Serving Large Language Models", OSDI 2024) decides which tenant's head goes next:

- every tenant has a counter of the service it has had, in weighted tokens: its prompt
  estimate (weight `PROMPT_WEIGHT`) when a request is dispatched, its output tokens
  (weight `OUTPUT_WEIGHT`) as they stream, each divided by the tenant's own `weight`;
- the head of the backlogged tenant with the smallest counter is dispatched first (on a
  tie, the one with less queued, then the one whose head came first);
- a tenant coming back to the queue (nothing of it queued) starts level with the least
  served backlogged tenant (the class's `floor`, the counter of the last one dispatched,
  when none waits), so idle time is not banked as credit. Two departures from the paper:
  a tenant with answers still streaming starts up to `CREDIT` (3) of its requests short of
  that, and one that left owing (its counter above the floor) starts at its debt;
- work-conserving: a lone tenant is always the least served, and gets the whole engine;
- a tenant any client can mint (`TenantPolicy.unlisted`: a key no config lists, a header's
  name) is pooled until it has been served: every unlisted tenant the class has not served
  yet queues in one account, `POOL` (FIFO within it, as within a tenant). When one of its
  requests is dispatched the tenant graduates: its next requests are its own, starting no
  lower than the pool's counter then, plus that request's charges (the pool pays them, and
  the tenant carries its bill out). A `refund` undoes the graduation. Configured tenants
  never pool.

Why the pool (issue 44): level with the least served, every fresh key started at the floor,
and a client minting a key per request had one share per request. Pooled, all the keys it
mints have one share between them; an honest user's new key is served from the pool at
once when nobody mints (it is the pool's only request), and as often as a minted key when
someone does (nothing tells the two apart before a key has been served). The other rule
the issue named, a new tenant level with the *most* served backlogged one, was measured and
left (one shared account is O(1), that rule needs a max-heap, and it kept a third of the
light tenants' share). In the simulator the light tenants kept 0.95-1.04x their good share
against a minting client, from 0.01-0.06x (docs/experiments/2026-12-07-minted-keys.md).

Why the credit: a tenant asking for about its share, in random arrivals, empties its queue
often, and the plain rule gives each such moment to whoever is always backlogged. In the
simulator (benchmarks/scenarios/tenants-heavy-light.yaml, one tenant at 10x the rate of five
others, 3x capacity) the plain rule left the lowest light tenant well under its fair share
(each step: docs/history/benchmarks.md, "In the simulator (issue 15), 2026-12-01").
Only a tenant with requests in flight gets it, so a flood of new API keys gets none.

Why counters and not round robin by requests: a tenant whose requests are ten times longer
takes ten times the engine per request; the counter charges it so.

The bound (VTC's Theorem, in the form this queue keeps it): while two tenants stay
backlogged, their counters differ by at most one prompt charge plus the output charges of
the requests in flight (`limit` x the largest output charge). The last time the tenant now
ahead was dispatched it was the least served; since then only that request's prompt and
the output of its requests in flight were added. tests/admission/test_fairness.py checks it
with hypothesis over random traffic. (A tenant coming back may start up to `CREDIT`
requests below the least served: the bound holds again once it has been served that much.)

Where a new request would go (`position`, for the wait the admission queue predicts) and
which request to shed (`victim`) read each queued request's tag: where its tenant's share
put it when it was queued, the tenant's counter plus its work queued ahead and its own, per
unit of weight, less the class's `floor` then (never below the tenant's previous tag, so a
tenant's own requests always count ahead of its next). Less the floor, because every counter
moves on while a request waits (its tenant's answers stream): taken whole, the tags of a
tenant with 30 answers streaming went stale within a queue's wait, and a light tenant
arriving behind them was counted behind all of them and refused (measured: the same
section). Rejection falls on the tenant furthest over its
share: when the queue must shed one request (its wait bound or its count bound), it is the
queued request with the largest tag (the newest of the tenant whose work would be served
last), not the newest arrival; the arrival itself when its own tag would be the largest, as
in a plain FIFO with one tenant.

State is bounded: a tenant with nothing queued or in flight is forgotten once its counter
is at or under the floor (it would be lifted there anyway); one idle above the floor keeps
its debt in `_idle`, at most `IDLE_MAX` of them (the oldest forgotten first), so a flood of
random API keys can neither grow memory nor bank credit. The tenants that left the pool are
remembered as served, at most `GRADUATED_MAX` (the least recently seen forgotten, and pooled
again): a key minted per request takes one slot there per request the pool served, so the
churn it makes is the pool's share, not its rate.

Fairness in numbers: `jain()` is Jain's index over the service the tenants backlogged at two
readings got between them, (sum x)^2 / (n sum x^2): 1 when equal, 1/n when one got it all.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from kneegate.admission.types import TenantPolicy, Ticket

__all__ = ["OUTPUT_WEIGHT", "PROMPT_WEIGHT", "FairQueue", "TokenBuckets", "jain_index"]

# VTC's service function, w_p x prompt + w_q x output tokens, with the paper's weights: an
# output token costs a decode step of the whole sequence, a prompt token a share of one
# prefill pass.
PROMPT_WEIGHT = 1.0
OUTPUT_WEIGHT = 2.0


def jain_index(xs: Sequence[float]) -> float:
    """Jain's index, (sum x)^2 / (n sum x^2): 1 when all are equal, 1/n when one has all
    (1 for nothing to compare)."""
    squares = sum(x * x for x in xs)
    return sum(xs) ** 2 / (len(xs) * squares) if squares > 0 else 1.0


@dataclass(slots=True, eq=False)
class _Account:
    """One tenant within one class: its counter, its queued requests, those in flight."""

    policy: TenantPolicy
    counter: float
    queued: deque[Ticket] = field(default_factory=deque)
    queued_tokens: int = 0  # the queued requests' prompt estimates, summed
    inflight: int = 0
    mark: float | None = None  # counter at the last `jain` reading, while backlogged
    last_tag: float = 0.0  # the largest tag of its queued requests, while it has some
    entry: int = -1  # the sequence number of its live entry in the order heap


# (counter, queued, head's arrival, sequence number, account): the order heap's entries
_Entry = tuple[float, int, float, int, _Account]
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
    request (`python -m kneegate.benchmarks.admission_cost`).
    """

    IDLE_MAX = 1024  # idle tenants whose debt is remembered
    CREDIT = 3.0  # requests' worth a tenant still streaming comes back ahead of the least served
    GRADUATED_MAX = 4096  # unlisted tenants served here, remembered as no longer pooled
    # the one account of the unlisted tenants not yet served here (no tenant name has a NUL)
    POOL = TenantPolicy("\0pool", label="pool")

    floor: float = 0.0  # the least backlogged counter at the last dispatch
    # a request's expected output charge, for estimating queued work (an EWMA)
    mean_output: float = 0.0
    _accounts: dict[str, _Account] = field(default_factory=dict)
    _weights: float = 0.0  # the accounts' weights, summed (`under_share`)
    _backlogged: dict[str, _Account] = field(default_factory=dict)  # those with a queue
    _idle: OrderedDict[str, float] = field(default_factory=OrderedDict)  # name -> counter
    # unlisted tenants served from the pool: name -> the pool's counter then (an LRU)
    _graduated: OrderedDict[str, float] = field(default_factory=OrderedDict)
    _heap: list[_Entry] = field(default_factory=list)
    _tags: list[_Tag] = field(default_factory=list)  # sorted
    _tag_of: dict[Ticket, tuple[float, int]] = field(default_factory=dict)
    _seq: Iterator[int] = field(default_factory=itertools.count)

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
        a = self._backlogged[self._owner(ticket).name]
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
            self._settle(a)
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

    # --- charging ------------------------------------------------------------------

    def dispatched(self, ticket: Ticket, queued: bool = True) -> None:
        """`ticket` goes to an engine: charge its prompt estimate. `queued`: it was taken
        from this queue (its tenant was the least served backlogged one); else it went
        straight through an empty queue, and its tenant starts as `append` would have it.
        Its counter is the class's floor from now on. A pooled ticket's tenant has been
        served: its next requests are its own (until a `refund` says it was not)."""
        policy = self._owner(ticket)
        a = self._accounts.get(policy.name)
        if a is None or not queued:
            ticket.pooled = policy is self.POOL
            a = self._account(policy, self._start(ticket))
        self.floor = max(self.floor, a.counter)
        a.inflight += 1
        self._charge(a, ticket, PROMPT_WEIGHT * ticket.tokens)
        if ticket.pooled:
            self._remember(ticket.tenant.name, a.counter)

    def charge_output(self, ticket: Ticket, tokens: int) -> None:
        """`tokens` more output tokens of `ticket` (in flight) streamed."""
        a = self._accounts.get(self._owner(ticket).name)
        if a is not None and tokens > 0:
            ticket.output_charged += tokens
            self._charge(a, ticket, OUTPUT_WEIGHT * tokens)

    def released(self, ticket: Ticket, output_tokens: int | None) -> None:
        """`ticket`'s request ended; `output_tokens`: all it produced (None: unknown).
        The output not yet charged is charged now; an engine's refusal is `refund`."""
        a = self._accounts.get(self._owner(ticket).name)
        if a is None:
            return
        if output_tokens is not None:
            rest = output_tokens - ticket.output_charged
            if rest > 0:  # `charge_output`, inline
                ticket.output_charged = output_tokens
                self._charge(a, ticket, OUTPUT_WEIGHT * rest)
            self.mean_output += 0.05 * (OUTPUT_WEIGHT * output_tokens - self.mean_output)
        a.inflight -= 1
        if a.inflight <= 0 and not a.queued:
            self._settle(a)

    def refund(self, ticket: Ticket) -> None:
        """`ticket` comes back unserved (its engine refused it, its caller left before
        the engine saw it): what it was charged is given back, its slot too."""
        a = self._accounts.get(self._owner(ticket).name)
        if a is None:
            return
        a.counter -= ticket.charged
        ticket.charged, ticket.output_charged = 0.0, 0
        if ticket.pooled and ticket.tenant.name not in self._accounts:
            self._graduated.pop(ticket.tenant.name, None)  # unserved: still unproven
        a.inflight -= 1
        if a.queued:
            self._touch(a)
        self._settle(a)

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
        a = self._accounts.get(name)
        return a.counter if a is not None else self._idle.get(name)

    def queued(self, name: str) -> int:
        """Tenant `name`'s requests queued here."""
        a = self._backlogged.get(name)
        return len(a.queued) if a is not None else 0

    def held(self, name: str) -> int:
        """Tenant `name`'s requests here, queued or in flight."""
        a = self._accounts.get(name)
        return len(a.queued) + a.inflight if a is not None else 0

    # --- internals -------------------------------------------------------------------

    def _end(self, ticket: Ticket) -> float:
        """Where `ticket` would finish in its tenant's share, queued now behind its own
        (in counter units: its tenant's counter, or where it would start, plus the work
        queued and its own, per unit of weight)."""
        policy = self._owner(ticket)
        own = self._cost(ticket.tokens, 1) / policy.weight
        a = self._backlogged.get(policy.name)
        if a is None:  # lifted as `append` would
            return self._start(ticket) - self.floor + own
        # past its own queued requests' tags (so they all count before it), and past its
        # counter plus the work queued (those tags were taken when its counter was lower)
        ahead = a.counter - self.floor + self._cost(a.queued_tokens, len(a.queued)) / policy.weight
        return max(a.last_tag, ahead) + own

    def _cost(self, tokens: int, n: int) -> float:
        """The expected charge of `n` requests of `tokens` prompt tokens in all (at least
        one token each, so every request moves its tenant's tags on)."""
        return max(PROMPT_WEIGHT * tokens + n * self.mean_output, float(n))

    def _start(self, ticket: Ticket) -> float:
        """Where `ticket`'s tenant starts as it comes back to the queue: at the least
        backlogged counter (the floor when none is), no credit for the time it sent nothing;
        a tenant with requests still in flight up to `CREDIT` requests short of it; one
        that left owing (`_idle`), where its debt puts it; one that left the pool, no lower
        than the pool then, plus its bill (`_graduated`)."""
        least = self._least_backlogged() if self._backlogged else self.floor
        policy = self._owner(ticket)
        a = self._accounts.get(policy.name)
        if a is not None:
            cost = self._cost(ticket.tokens, 1) / policy.weight
            return max(a.counter, least - self.CREDIT * cost)
        start = max(self._idle.get(policy.name, least), least)
        return max(self._graduated.get(policy.name, start), start)

    def under_share(self, ticket: Ticket, slots: float) -> bool:
        """Whether `ticket`'s tenant (its pool, while pooled) holds fewer requests, queued
        and in flight here, than its weighted share of `slots` among the tenants holding
        some here, itself included. A tenant alone is never under it: its excess is the
        only excess there is."""
        policy = self._owner(ticket)
        a = self._accounts.get(policy.name)
        held = a.inflight + len(a.queued) if a is not None else 0
        others = self._weights - (a.policy.weight if a is not None else 0.0)
        if others <= 1e-9:
            return False
        return held < slots * policy.weight / (policy.weight + others)

    def _owner(self, ticket: Ticket) -> TenantPolicy:
        """Whose account `ticket` is queued and charged under: the pool's while its tenant
        is unlisted and has not been served here (and for good once it was placed so), its
        tenant's own otherwise. A tenant with an account here has been served, or was
        placed under its own name: it keeps it while it has requests here."""
        t = ticket.tenant
        if ticket.pooled or (t.unlisted and t.name not in self._accounts
                             and t.name not in self._graduated):
            return self.POOL
        if t.unlisted and t.name in self._graduated:
            self._graduated.move_to_end(t.name)
        return t

    def _remember(self, name: str, counter: float) -> None:
        """Unlisted tenant `name` has been served from the pool, whose counter is now
        `counter`: no longer pooled while remembered (the least recently seen of
        `GRADUATED_MAX` forgotten first), and never placed ahead of the pool it left."""
        self._graduated[name] = max(counter, self._graduated.get(name, counter))
        self._graduated.move_to_end(name)
        while len(self._graduated) > self.GRADUATED_MAX:
            self._graduated.popitem(last=False)

    def _account(self, policy: TenantPolicy, start: float) -> _Account:
        """Tenant `policy`'s account, made at `start` when it has none; at `start` too when
        it has nothing queued (`start` is never below its counter: `_start`)."""
        a = self._accounts.get(policy.name)
        if a is None:
            self._idle.pop(policy.name, None)
            a = self._accounts[policy.name] = _Account(policy, start)
            self._weights += policy.weight
        else:
            self._weights += policy.weight - a.policy.weight
            a.policy = policy  # a reload may have changed its weight
            if not a.queued:
                a.counter = start
        return a

    def _enqueue(self, ticket: Ticket, left: bool) -> None:
        policy = self._owner(ticket)
        ticket.pooled = policy is self.POOL
        end = self._end(ticket)  # before its tenant is lifted: `_end` lifts as this does
        a = self._backlogged.get(policy.name)
        if a is None:  # arriving, or back after a while
            a = self._account(policy, self._start(ticket))
            self._backlogged[a.policy.name] = a
            if len(self._backlogged) == 2:  # the heap is kept only while two or more wait
                self._heap = []
                for b in self._backlogged.values():
                    if b is not a:
                        self._touch(b)  # (a's own entry: below, once its ticket is in)
        if left:  # at its tenant's head: its tag, where its share puts that
            a.queued.appendleft(ticket)
            tag = a.counter - self.floor + self._cost(ticket.tokens, 1) / a.policy.weight
            a.last_tag = tag if len(a.queued) == 1 else max(a.last_tag, tag)
        else:
            a.queued.append(ticket)
            tag = a.last_tag = end
        a.queued_tokens += ticket.tokens
        key = (tag, next(self._seq))
        self._tag_of[ticket] = key
        bisect.insort(self._tags, (*key, ticket))
        self._touch(a)

    def _least(self) -> _Account | None:
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
        return self.floor if a is None else a.counter

    def _touch(self, a: _Account) -> None:
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

    def _charge(self, a: _Account, ticket: Ticket, amount: float) -> None:
        share = amount / a.policy.weight
        a.counter += share
        ticket.charged += share
        if a.queued:
            self._touch(a)
        if ticket.pooled:  # the pool pays; its tenant carries its own bill out of it too
            own = self._accounts.get(ticket.tenant.name)
            if own is not None:
                own.counter += share
                if own.queued:
                    self._touch(own)
            elif ticket.tenant.name in self._graduated:
                self._graduated[ticket.tenant.name] += share

    def _settle(self, a: _Account) -> None:
        """Forget an account with nothing queued or in flight (its debt, if any, kept)."""
        if a.queued or a.inflight > 0:
            return
        del self._accounts[a.policy.name]
        self._weights -= a.policy.weight
        if a.counter > self.floor:
            self._idle[a.policy.name] = a.counter
            self._idle.move_to_end(a.policy.name)
            while len(self._idle) > self.IDLE_MAX:
                self._idle.popitem(last=False)


@dataclass
class TokenBuckets:
    """Tenants' `tokens_per_minute` quotas: a bucket each, refilled continuously, that
    prompt estimates (at dispatch) and output tokens (as they stream) drain. A request is
    refused while its tenant's bucket is empty; a request in flight may overdraw it (its
    output is not known in advance), and the tenant then waits the overdraft out."""

    _level: dict[str, tuple[float, float]] = field(default_factory=dict)  # name -> (level, at)

    def wait(self, policy: TenantPolicy, now: float) -> float:
        """Seconds until `policy`'s bucket has tokens again (0: it has some now)."""
        if policy.tokens_per_minute is None:
            return 0.0
        level = self._refill(policy, now)
        return 0.0 if level > 0 else max(1e-3, -level / (policy.tokens_per_minute / 60))

    def take(self, policy: TenantPolicy, tokens: int, now: float) -> None:
        if policy.tokens_per_minute is None or tokens <= 0:
            return
        self._level[policy.name] = (self._refill(policy, now) - tokens, now)

    def _refill(self, policy: TenantPolicy, now: float) -> float:
        cap = policy.tokens_per_minute
        assert cap is not None
        level, at = self._level.get(policy.name, (cap, now))
        return min(cap, level + (now - at) * cap / 60)
