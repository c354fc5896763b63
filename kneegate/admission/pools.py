"""Pools: admission for engines that serve different models. Pure: time comes in.

Engines serving different models share nothing: one's queue must never hold the other's
requests back, and each is held at its own knee. So the upstreams are grouped into *pools*,
and every pool has its own `AdmissionQueue` (its queue, its wait prediction, its demand);
a request joins the pool serving the model it names.

Grouping: two upstreams are in one pool when the models they list overlap (a base model
and its LoRA adapters on the same engines are one pool: they share those engines' batches),
and an upstream whose models are not known (not read yet, or its list unreadable) may serve any,
so it joins every pool into one: until the engines have said what they serve, admission is
what it is with one model. Within a pool a request goes only to an upstream that lists its
model (`least_full`), so adapters loaded on some replicas only are routed right too.

`Pools` answers the queue's questions (`offer`, `release`, `tick`, ...) by sending each to
the pool it concerns: the ticket's (`Ticket.pool`, set on offer) or the upstream's. Classes
and tenants apply across pools: every pool applies the same classes, and a tenant's caps
(`max_inflight`, `tokens_per_minute`) count its requests in every pool.

`regroup` (after a reload, or when an upstream's models are read) hands each new pool the
queue of the old pool it shares the most upstreams with (a reload that adds a replica keeps
its pool's queue, rates and demand); an old pool none takes drains: its requests in flight
end there, and it is dropped once empty.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kneegate.admission.queue import AdmissionQueue
from kneegate.admission.quota import TokenBuckets
from kneegate.admission.types import (
    Admitted,
    ClassPolicy,
    Queued,
    Rejected,
    Ticket,
    UpstreamState,
    no_upstream,
)
from kneegate.controllers.base import EngineStats, Sample

__all__ = ["Pool", "Pools", "group"]


@dataclass(eq=False)
class Pool:
    """The upstreams that serve one set of models, and their queue."""

    upstreams: list[UpstreamState]
    queue: AdmissionQueue

    @property
    def models(self) -> list[str]:
        """The models its upstreams list, sorted (none while any is unknown)."""
        if any(not u.models for u in self.upstreams):
            return []
        return sorted({m for u in self.upstreams for m in (u.models or {})})

    @property
    def names(self) -> frozenset[str]:
        return frozenset(u.name for u in self.upstreams)


def group(upstreams: list[UpstreamState]) -> list[list[UpstreamState]]:
    """Upstreams in pools: connected by a model both list, or by one whose models are
    unknown (it joins every pool). In the order of their first upstream."""
    if any(not u.models for u in upstreams):
        return [list(upstreams)] if upstreams else []
    parent = list(range(len(upstreams)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    first: dict[str, int] = {}  # model -> the first upstream listing it
    for i, u in enumerate(upstreams):
        for model in u.models or {}:
            j = first.setdefault(model, i)
            parent[root(i)] = root(j)
    groups: dict[int, list[UpstreamState]] = {}
    for i, u in enumerate(upstreams):
        groups.setdefault(root(i), []).append(u)
    return list(groups.values())


class Pools:
    """One `AdmissionQueue` per pool of upstreams, behind the queue's own interface."""

    def __init__(self, upstreams: list[UpstreamState], classes: dict[str, ClassPolicy],
                 max_queue: int = 256, retry_after: tuple[int, int] = (1, 60),
                 configure: Callable[[AdmissionQueue], None] | None = None) -> None:
        """`configure`: called on every pool's new queue (the gateway sets its demand's
        half-life there)."""
        self.classes = dict(classes)
        self.max_queue = max_queue
        self.retry_after_min, self.retry_after_max = retry_after
        self.upstreams: list[UpstreamState] = []
        self.pools: list[Pool] = []
        self._draining: list[AdmissionQueue] = []
        self._by_model: dict[str, Pool] = {}
        self._by_upstream: dict[int, AdmissionQueue] = {}  # id(upstream) -> its pool's queue
        self._buckets = TokenBuckets()  # tenants' tokens a minute, across pools
        self._on_error: Callable[[UpstreamState, str, Exception], None] | None = None
        self.closed = False
        self.configure_queue: Callable[[AdmissionQueue], None] = configure or (lambda q: None)
        # some pool routes by prefix affinity: requests should carry their prefix keys (kept
        # here, read on every request, set whenever the queues are configured)
        self.affinity_on = False
        self.regroup(upstreams)

    # --- configuration -------------------------------------------------------------

    @property
    def on_error(self) -> Callable[[UpstreamState, str, Exception], None] | None:
        return self._on_error

    @on_error.setter
    def on_error(self, handler: Callable[[UpstreamState, str, Exception], None] | None
                 ) -> None:
        self._on_error = handler
        for q in self.queues():
            q.on_error = handler

    def reconfigure(self, classes: dict[str, ClassPolicy], max_queue: int,
                    upstreams: list[UpstreamState],
                    retry_after: tuple[int, int] | None = None) -> None:
        """A reload: the new policy for every pool, the upstreams regrouped."""
        self.classes, self.max_queue = dict(classes), max_queue
        if retry_after is not None:
            self.retry_after_min, self.retry_after_max = retry_after
        self.regroup(upstreams)
        for q in self.queues():
            q.reconfigure(self.classes, max_queue, q.upstreams,
                          (self.retry_after_min, self.retry_after_max))
        self.configure()

    def regroup(self, upstreams: list[UpstreamState] | None = None) -> None:
        """Group the upstreams (those given, else the same ones, their models read again)
        into pools. A new pool takes over the queue (its queued requests, rates and demand)
        of the old pool it shares the most upstreams with, so a reload that adds or drops a
        replica keeps its pool's state; a pool sharing none gets a new queue."""
        if upstreams is not None:
            self.upstreams = list(upstreams)
        old_pools = list(self.pools)
        pools: list[Pool] = []
        for members in group(self.upstreams):
            names = frozenset(u.name for u in members)
            old = max(old_pools, key=lambda p: len(p.names & names), default=None)
            if old is not None and old.names & names:
                old_pools.remove(old)
                old.upstreams = members
                old.queue.upstreams = list(members)
                pools.append(old)
            else:
                pools.append(Pool(members, self._queue(members)))
        self._draining += [p.queue for p in old_pools if _busy(p.queue)]
        self.pools = pools
        self._by_model = {m: p for p in pools for m in p.models}
        self._by_upstream = {id(u): p.queue for p in pools for u in p.upstreams}
        self.affinity_on = any(p.queue.affinity is not None for p in pools)

    def configure(self) -> None:
        """Apply `configure_queue` to every queue again (the config changed)."""
        for q in self.queues():
            self.configure_queue(q)
        self.affinity_on = any(p.queue.affinity is not None for p in self.pools)

    def _queue(self, upstreams: list[UpstreamState]) -> AdmissionQueue:
        q = AdmissionQueue(list(upstreams), self.classes, self.max_queue,
                           self.retry_after_min, self.retry_after_max)
        q.on_error = self._on_error
        q.closed = self.closed
        q.share_tenants(self._buckets, self.queues)
        self.configure_queue(q)
        return q

    def queues(self) -> list[AdmissionQueue]:
        """Every pool's queue, then those draining."""
        self._draining = [q for q in self._draining if _busy(q)]
        return [p.queue for p in self.pools] + self._draining

    # --- routing -------------------------------------------------------------------

    def pool_of(self, model: str | None) -> Pool | None:
        """The pool serving `model`: the one listing it; the only pool where its models
        are not known (it may serve any) or no model is named; None when no pool lists
        `model`, or none is named and there are several."""
        pools = self.pools
        if len(pools) == 1 and (model is None or not pools[0].models):
            return pools[0]
        return None if model is None else self._by_model.get(model)



    @property
    def models(self) -> list[str]:
        """Every model a pool lists, sorted."""
        return sorted(self._by_model)

    def _of(self, ticket: Ticket) -> AdmissionQueue:
        q = ticket.pool
        assert isinstance(q, AdmissionQueue), "the ticket was offered to these pools"
        return q

    def _up(self, upstream: UpstreamState) -> AdmissionQueue:
        return self._by_upstream.get(id(upstream)) or self.queues()[0]

    # --- the queue's interface -----------------------------------------------------

    def offer(self, ticket: Ticket, now: float) -> Admitted | Queued | Rejected:
        pool = self.pool_of(ticket.model)
        if pool is None:  # a model no pool serves (the gateway answers 404 before this)
            if ticket.cls not in self.classes:
                raise KeyError(f"unknown priority class {ticket.cls!r}")
            return no_upstream(self.retry_after_min)
        ticket.pool = pool.queue
        return pool.queue.offer(ticket, now)

    def release(self, ticket: Ticket, now: float, sample: Sample | None = None
                ) -> list[Ticket]:
        return self._of(ticket).release(ticket, now, sample)

    def charge(self, ticket: Ticket, tokens: int, now: float) -> None:
        self._of(ticket).charge(ticket, tokens, now)

    def first_token(self, ticket: Ticket, now: float) -> list[Ticket]:
        return self._of(ticket).first_token(ticket, now)

    def free(self, ticket: Ticket) -> None:
        self._of(ticket).free(ticket)

    def withdraw(self, ticket: Ticket) -> bool:
        return self._of(ticket).withdraw(ticket)

    def reroute(self, ticket: Ticket, now: float) -> UpstreamState | None:
        return self._of(ticket).reroute(ticket, now)

    def requeue(self, ticket: Ticket, now: float) -> bool:
        return self._of(ticket).requeue(ticket, now)

    def objective(self, ticket: Ticket) -> float:
        return self._of(ticket).objective(ticket)

    def timeout_rejection(self, ticket: Ticket) -> Rejected:
        return self._of(ticket).timeout_rejection(ticket)

    def engine_refused(self, upstream: UpstreamState) -> None:
        self._up(upstream).engine_refused(upstream)

    def note_sample(self, upstream: UpstreamState, sample: Sample) -> None:
        self._up(upstream).note_sample(upstream, sample)

    def engine_stats(self, upstream: UpstreamState, stats: EngineStats) -> None:
        self._up(upstream).engine_stats(upstream, stats)

    def tick(self, now: float, upstreams: Iterable[UpstreamState] | None = None
             ) -> tuple[list[Ticket], list[Ticket]]:
        """Every pool's tick; `upstreams` (those with requests) each ticked by its pool."""
        by_queue: dict[int, list[UpstreamState]] | None = None
        if upstreams is not None:
            by_queue = {}
            for u in upstreams:
                by_queue.setdefault(id(self._up(u)), []).append(u)
        dispatched: list[Ticket] = []
        expired: list[Ticket] = []
        for q in self.queues():
            ups = None if by_queue is None else by_queue.get(id(q), [])
            d, e = q.tick(now, ups)
            dispatched += d
            expired += e
        return dispatched, expired

    def pump(self, now: float) -> list[Ticket]:
        out: list[Ticket] = []
        for q in self.queues():
            out += q.pump(now)
        return out

    def expire(self, now: float) -> list[Ticket]:
        out: list[Ticket] = []
        for q in self.queues():
            out += q.expire(now)
        return out

    @property
    def has_late(self) -> bool:
        return any(q.has_late for q in self.queues())

    def take_late(self) -> list[Ticket]:
        out: list[Ticket] = []
        for q in self.queues():
            out += q.take_late()
        return out

    def close(self) -> list[Ticket]:
        self.closed = True
        out: list[Ticket] = []
        for q in self.queues():
            out += q.close()
        return out

    def shutdown_rejection(self) -> Rejected:
        return self.queues()[0].shutdown_rejection()

    def depth(self, cls: str | None = None) -> int:
        return sum(q.depth(cls) for q in self.queues())

    @property
    def flying(self) -> int:
        return sum(q.flying for q in self.queues())

    @property
    def completion_rate(self) -> float:
        return sum(q.completion_rate for q in self.queues())

    def fairness(self) -> dict[str, float | None]:
        """Each class's Jain's index: the least fair pool's (None where no pool has one)."""
        out: dict[str, float | None] = {}
        for q in self.queues():
            for cls, jain in q.fairness().items():
                known = out.get(cls)
                out[cls] = jain if known is None else (
                    known if jain is None else min(known, jain))
        return out

    def retry_after(self, ahead: int) -> int:
        return self.queues()[0].retry_after(ahead)


def _busy(q: AdmissionQueue) -> bool:
    """Still holds requests: queued or in flight."""
    return bool(q.depth() or q.flying)
