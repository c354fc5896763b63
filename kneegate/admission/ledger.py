"""What each tenant of one priority class has been served, counted in tokens: the counters
its fair shares order by (`admission.fairness`). Pure, like the queue that holds it: no
clock, no I/O.

The accounts of the Virtual Token Counter (Sheng et al., "Fairness in Serving Large Language
Models", OSDI 2024):

- every tenant has a counter of the service it has had, in weighted tokens: its prompt
  estimate (weight `PROMPT_WEIGHT`) when a request is dispatched, its output tokens
  (weight `OUTPUT_WEIGHT`) as they stream, each divided by the tenant's own `weight`; a
  request that comes back unserved is refunded (`refund`);
- a tenant coming back to the queue (nothing of it queued) starts level with the least
  served backlogged tenant (the class's `floor`, the counter of the last one dispatched,
  when none waits), so idle time is not banked as credit. Two departures from the paper:
  a tenant with answers still streaming starts up to `CREDIT` (3) of its requests short of
  that, and one that left owing (its counter above the floor) starts at its debt;
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
simulator (kneegate/sim/scenarios/tenants-heavy-light.yaml, one tenant at 10x the rate of five
others, 3x capacity) the plain rule left the lowest light tenant well under its fair share
(each step: docs/history/benchmarks.md, "In the simulator (issue 15), 2026-12-01").
Only a tenant with requests in flight gets it, so a flood of new API keys gets none.

Why counters and not round robin by requests: a tenant whose requests are ten times longer
takes ten times the engine per request; the counter charges it so.

State is bounded: a tenant with nothing queued or in flight is forgotten once its counter
is at or under the floor (it would be lifted there anyway); one idle above the floor keeps
its debt in `_idle`, at most `IDLE_MAX` of them (the oldest forgotten first), so a flood of
random API keys can neither grow memory nor bank credit. The tenants that left the pool are
remembered as served, at most `GRADUATED_MAX` (the least recently seen forgotten, and pooled
again): a key minted per request takes one slot there per request the pool served, so the
churn it makes is the pool's share, not its rate.

The queue that holds a ledger (`FairQueue`) orders its tenants by these counters: the
ledger tells it when a queued tenant's counter moved (`touch`), and asks it for the least
counter of a tenant with something queued (`least`).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kneegate.admission.types import TenantPolicy, Ticket

__all__ = ["OUTPUT_WEIGHT", "PROMPT_WEIGHT", "Account", "Ledger"]

# VTC's service function, w_p x prompt + w_q x output tokens, with the paper's weights: an
# output token costs a decode step of the whole sequence, a prompt token a share of one
# prefill pass.
PROMPT_WEIGHT = 1.0
OUTPUT_WEIGHT = 2.0


@dataclass(slots=True, eq=False)
class Account:
    """One tenant within one class: its counter, its queued requests, those in flight."""

    policy: TenantPolicy
    counter: float
    queued: deque[Ticket] = field(default_factory=deque)
    queued_tokens: int = 0  # the queued requests' prompt estimates, summed
    inflight: int = 0
    mark: float | None = None  # counter at the last `jain` reading, while backlogged
    last_tag: float = 0.0  # the largest tag of its queued requests, while it has some
    entry: int = -1  # the sequence number of its live entry in the order heap


class Ledger:
    """The tenants' accounts in one class's queue: charged, refunded, started, forgotten."""

    IDLE_MAX = 1024  # idle tenants whose debt is remembered
    CREDIT = 3.0  # requests' worth a tenant still streaming comes back ahead of the least served
    GRADUATED_MAX = 4096  # unlisted tenants served here, remembered as no longer pooled
    # the one account of the unlisted tenants not yet served here (no tenant name has a NUL)
    POOL = TenantPolicy("\0pool", label="pool")

    def __init__(self, touch: Callable[[Account], None], least: Callable[[], float]) -> None:
        """`touch(account)`: a queued tenant's counter moved; `least()`: the least counter
        of a tenant with something queued, the floor when none has (the queue's)."""
        self._touch, self._least = touch, least
        self.floor = 0.0  # the least backlogged counter at the last dispatch
        # a request's expected output charge, for estimating queued work (an EWMA)
        self.mean_output = 0.0
        self._accounts: dict[str, Account] = {}
        self._weights = 0.0  # the accounts' weights, summed (`under_share`)
        self._idle: OrderedDict[str, float] = OrderedDict()  # name -> counter
        # unlisted tenants served from the pool: name -> the pool's counter then (an LRU)
        self._graduated: OrderedDict[str, float] = OrderedDict()

    # --- charging ------------------------------------------------------------------

    def dispatched(self, ticket: Ticket, queued: bool = True) -> None:
        """`ticket` goes to an engine: charge its prompt estimate. `queued`: it was taken
        from this queue (its tenant was the least served backlogged one); else it went
        straight through an empty queue, and its tenant starts as `append` would have it.
        Its counter is the class's floor from now on. A pooled ticket's tenant has been
        served: its next requests are its own (until a `refund` says it was not)."""
        policy = self.owner(ticket)
        a = self._accounts.get(policy.name)
        if a is None or not queued:
            ticket.pooled = policy is self.POOL
            a = self.account(policy, self.start(ticket))
        self.floor = max(self.floor, a.counter)
        a.inflight += 1
        self._charge(a, ticket, PROMPT_WEIGHT * ticket.tokens)
        if ticket.pooled:
            self._remember(ticket.tenant.name, a.counter)


    def charge_output(self, ticket: Ticket, tokens: int) -> None:
        """`tokens` more output tokens of `ticket` (in flight) streamed."""
        a = self._accounts.get(self.owner(ticket).name)
        if a is not None and tokens > 0:
            ticket.output_charged += tokens
            self._charge(a, ticket, OUTPUT_WEIGHT * tokens)


    def released(self, ticket: Ticket, output_tokens: int | None) -> None:
        """`ticket`'s request ended; `output_tokens`: all it produced (None: unknown).
        The output not yet charged is charged now; an engine's refusal is `refund`."""
        a = self._accounts.get(self.owner(ticket).name)
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
            self.settle(a)


    def refund(self, ticket: Ticket) -> None:
        """`ticket` comes back unserved (its engine refused it, its caller left before
        the engine saw it): what it was charged is given back, its slot too."""
        a = self._accounts.get(self.owner(ticket).name)
        if a is None:
            return
        a.counter -= ticket.charged
        ticket.charged, ticket.output_charged = 0.0, 0
        if ticket.pooled and ticket.tenant.name not in self._accounts:
            self._graduated.pop(ticket.tenant.name, None)  # unserved: still unproven
        a.inflight -= 1
        if a.queued:
            self._touch(a)
        self.settle(a)


    # --- reading -------------------------------------------------------------------

    def counter(self, name: str) -> float | None:
        """Tenant `name`'s counter (None: not known here)."""
        a = self._accounts.get(name)
        return a.counter if a is not None else self._idle.get(name)


    def held(self, name: str) -> int:
        """Tenant `name`'s requests here, queued or in flight."""
        a = self._accounts.get(name)
        return len(a.queued) + a.inflight if a is not None else 0


    def under_share(self, ticket: Ticket, slots: float) -> bool:
        """Whether `ticket`'s tenant (its pool, while pooled) holds fewer requests, queued
        and in flight here, than its weighted share of `slots` among the tenants holding
        some here, itself included. A tenant alone is never under it: its excess is the
        only excess there is."""
        policy = self.owner(ticket)
        a = self._accounts.get(policy.name)
        held = a.inflight + len(a.queued) if a is not None else 0
        others = self._weights - (a.policy.weight if a is not None else 0.0)
        if others <= 1e-9:
            return False
        return held < slots * policy.weight / (policy.weight + others)


    # --- the accounts -------------------------------------------------------------

    def owner(self, ticket: Ticket) -> TenantPolicy:
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


    def start(self, ticket: Ticket) -> float:
        """Where `ticket`'s tenant starts as it comes back to the queue: at the least
        backlogged counter (the floor when none is), no credit for the time it sent nothing;
        a tenant with requests still in flight up to `CREDIT` requests short of it; one
        that left owing (`_idle`), where its debt puts it; one that left the pool, no lower
        than the pool then, plus its bill (`_graduated`)."""
        least = self._least()
        policy = self.owner(ticket)
        a = self._accounts.get(policy.name)
        if a is not None:
            cost = self.cost(ticket.tokens, 1) / policy.weight
            return max(a.counter, least - self.CREDIT * cost)
        start = max(self._idle.get(policy.name, least), least)
        return max(self._graduated.get(policy.name, start), start)


    def cost(self, tokens: int, n: int) -> float:
        """The expected charge of `n` requests of `tokens` prompt tokens in all (at least
        one token each, so every request moves its tenant's tags on)."""
        return max(PROMPT_WEIGHT * tokens + n * self.mean_output, float(n))


    def account(self, policy: TenantPolicy, start: float) -> Account:
        """Tenant `policy`'s account, made at `start` when it has none; at `start` too when
        it has nothing queued (`start` is never below its counter: `start`)."""
        a = self._accounts.get(policy.name)
        if a is None:
            self._idle.pop(policy.name, None)
            a = self._accounts[policy.name] = Account(policy, start)
            self._weights += policy.weight
        else:
            self._weights += policy.weight - a.policy.weight
            a.policy = policy  # a reload may have changed its weight
            if not a.queued:
                a.counter = start
        return a


    def settle(self, a: Account) -> None:
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


    def _remember(self, name: str, counter: float) -> None:
        """Unlisted tenant `name` has been served from the pool, whose counter is now
        `counter`: no longer pooled while remembered (the least recently seen of
        `GRADUATED_MAX` forgotten first), and never placed ahead of the pool it left."""
        self._graduated[name] = max(counter, self._graduated.get(name, counter))
        self._graduated.move_to_end(name)
        while len(self._graduated) > self.GRADUATED_MAX:
            self._graduated.popitem(last=False)


    def _charge(self, a: Account, ticket: Ticket, amount: float) -> None:
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

