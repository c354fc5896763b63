"""One run: arrivals, the gateways' admission queues and controllers, one engine, one
virtual clock, in one deterministic loop (`run`; the loop itself is `_Sim`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import yaml

from kneegate.admission.queue import AdmissionQueue
from kneegate.admission.types import (
    ANONYMOUS,
    Admitted,
    ClassPolicy,
    Queued,
    TenantPolicy,
    Ticket,
    UpstreamState,
)
from kneegate.controllers.base import (
    EngineStats,
    LimitController,
    Outcome,
    Sample,
    engine_ttft_objective,
)
from kneegate.controllers.registry import build_controller
from kneegate.emulator.core import EngineCore, EngineRequest
from kneegate.emulator.profiles import load_profile
from kneegate.sim.arrivals import Arrival, _arrivals
from kneegate.sim.scenarios import Scenario
from kneegate.sim.true_knee import scenario_knee

__all__ = ["Move", "Result", "demand_ratio", "run"]


@dataclass(slots=True, eq=False)
class _Req:
    id: str
    cls: str
    gateway: int
    arrived: float
    prompt: int
    out: int
    dispatched: float = math.nan
    inflight_at_admit: int = 0
    first: float = math.nan
    done: float = math.nan
    tokens: int = 0
    last: float = math.nan  # when its last token came
    fate: str = "pending"  # pending | done | shed | timeout
    ticket: Ticket | None = None  # its place in the gateway's queue
    tenant: str = ""


@dataclass
class Result:
    """One controller over one scenario, with its time series for the plots."""

    scenario: str
    controller: str
    requests: list[_Req]
    times: list[float] = field(default_factory=list)
    limits: list[int] = field(default_factory=list)  # summed over gateways
    inflight: list[int] = field(default_factory=list)
    knee: list[float] = field(default_factory=list)
    demand: list[float] = field(default_factory=list)  # offered / capacity, NaN before known


Move = tuple[float, int, float | None]  # (at, total limit, wait cap): the switching oracle's


def _policies(sc: Scenario, wait: float | None) -> dict[str, ClassPolicy]:
    """Each class's policy; `wait` (a fraction of its TTFT objective) replaces its max_wait."""
    return {
        c.name: ClassPolicy(
            c.name, c.priority, c.max_wait if wait is None else wait * (c.ttft or sc.ttft),
            ttft_objective=c.ttft or sc.ttft,  # the gateway's time-bounded queue (issue 12)
        )
        for c in sc.classes
    }


def _fixed_name(limit: int, wait: float | None) -> str:
    return f"{limit}" if wait is None else f"{limit}/{wait:g}T"


def _controller(sc: Scenario, spec: str, limit: int | None) -> LimitController:
    """`spec` is a registry name, optionally with overrides: `knee:headroom=0.95:window=10`."""
    name, *pairs = spec.split(":")
    params: dict[str, Any] = {
        "ttft_objective": engine_ttft_objective(c.ttft or sc.ttft for c in sc.classes),
        "tpot_objective": min(c.tpot or sc.tpot for c in sc.classes),
    }
    if name == "fixed":
        assert limit is not None
        params.update(initial=limit, max_limit=max(limit, 1024))
    params.update(sc.controller_params.get(name, {}))
    params.update({k: yaml.safe_load(v) for k, v in (p.split("=", 1) for p in pairs)})
    return build_controller(name, params)


class _Sim:
    """The loop's state. `run()` is the only entry point."""

    TICK = 0.5
    SCRAPE = 1.0
    SCRAPE_LAG = 1.5

    DRAIN = 300.0  # at most this long past `duration` for the engine to finish its requests

    def __init__(
        self,
        sc: Scenario,
        ctl: str,
        seed: int,
        limit: int | None,
        then: Sequence[Move] = (),
        wait: float | None = None,
        arrivals: Sequence[Arrival] | None = None,
        fair: bool = True,
    ) -> None:
        self.sc = sc
        # each tenant's policy, once (fair=False: every request one tenant, plain FIFO)
        self.tenants = {t.name: TenantPolicy(t.name, t.weight, label=t.name,
                                             unlisted=not t.listed)
                        for t in sc.tenants} if fair else {}
        self.minting = {t.name for t in sc.tenants if t.mint} if fair else set()
        self.profile = load_profile(sc.profile, **sc.profile_overrides)
        self.core = EngineCore(self.profile, seed=seed)
        if arrivals is None:
            _knee, tput, mean_out = scenario_knee(sc, self.profile)
            arrivals = _arrivals(sc, tput / mean_out, seed, self.profile.max_model_len)
        self.arrivals = list(arrivals)
        each = None if limit is None else max(1, round(limit / sc.gateways))
        self.ctls = [_controller(sc, ctl, each) for _ in range(sc.gateways)]
        self.then = sorted(then, key=lambda m: m[0])  # a fixed pair that switches at `at`
        self.wait = wait
        policies = _policies(sc, wait)
        self.ups = [UpstreamState(f"gw{i}", c) for i, c in enumerate(self.ctls)]
        self.queues = [AdmissionQueue([u], policies, sc.max_queue) for u in self.ups]
        self.reqs: dict[str, _Req] = {}
        self.all: list[_Req] = []
        name = ctl
        if limit is not None:
            name = "fixed@" + _fixed_name(limit, wait)
            name += "".join(f">{_fixed_name(x, w)}" for _, x, w in then)
        self.result = Result(sc.name, name, self.all)
        self.scrapes: list[tuple[float, EngineStats]] = []
        self.itl_sum, self.itl_count = 0.0, 0  # the engine's inter-token latency histogram

    def run(self) -> Result:
        sc, now, i = self.sc, 0.0, 0
        next_tick, next_scrape = 0.0, 0.0
        phases = sorted(sc.phases, key=lambda p: p.at)
        drained = sc.duration + self.DRAIN
        while now < sc.duration or (self.core.has_unfinished() and now < drained):
            for p in phases:
                if p.at <= now and p.slowdown is not None:
                    self.core.slowdown = p.slowdown
            while self.then and self.then[0][0] <= now:
                _, total, wait = self.then.pop(0)
                self._switch(total, wait)
            # what happened during the last step, in time order
            while True:
                t_arr = self.arrivals[i][0] if i < len(self.arrivals) else math.inf
                t_stat = self.scrapes[0][0] if self.scrapes else math.inf
                t = min(t_arr, next_tick, t_stat)
                if t > now:
                    break
                if t == t_arr:
                    self._arrive(self.arrivals[i], i)
                    i += 1
                elif t == next_tick:
                    if t >= sc.duration:
                        next_tick = math.inf  # draining: the gateway admits no more
                        continue
                    self._tick(t)
                    next_tick += self.TICK
                else:
                    _, st = self.scrapes.pop(0)
                    for q, up in zip(self.queues, self.ups, strict=True):
                        q.engine_stats(up, st)
            if next_scrape <= now < sc.duration:
                self._scrape(now)
                next_scrape += self.SCRAPE
            if self.core.has_unfinished():
                step = self.core.step()
                now += step.duration
                self._events(step.events, now)
            else:  # idle: jump to the next thing that happens
                nxt = self.arrivals[i][0] if i < len(self.arrivals) else sc.duration
                now = max(now, min(nxt, next_tick, next_scrape, sc.duration))
        return self.result

    def _switch(self, total: int, wait: float | None) -> None:
        """A fixed limit moves to `total` (over the gateways) and the wait caps to `wait`:
        the switching oracle. Tickets already queued keep the deadline they were given."""
        each = max(1, round(total / self.sc.gateways))
        for i, up in enumerate(self.ups):
            up.controller = self.ctls[i] = _controller(self.sc, "fixed", each)
        if wait != self.wait:
            self.wait, policies = wait, _policies(self.sc, wait)
            for q, up in zip(self.queues, self.ups, strict=True):
                q.reconfigure(policies, self.sc.max_queue, [up])

    def _scrape(self, now: float) -> None:
        s = self.core.stats()
        st = EngineStats(
            now,
            s.running,
            s.waiting,
            s.kv_cache_usage,
            s.num_preemptions_total,
            s.generation_tokens_total,
            self.profile.usable_kv_tokens,
            itl_sum=self.itl_sum,
            itl_count=self.itl_count,
        )
        self.scrapes.append((now + self.SCRAPE_LAG, st))

    def _arrive(self, a: Arrival, n: int) -> None:
        t, cls, prompt, out, tenant = a
        gw = n % self.sc.gateways
        r = _Req(f"r{n}", cls, gw, t, prompt, out, tenant=tenant)
        self.all.append(r)
        # the true prompt size: the gateway's bytes / 4 differs by a constant factor, and
        # knee uses ratios of sizes only (the queue tells the controller, as in the gateway)
        policy = self.tenants.get(tenant, ANONYMOUS)
        if tenant in self.minting:  # a key of its own, as the gateway names an unlisted one
            policy = TenantPolicy(f"{tenant}#{n}", policy.weight, label=tenant, unlisted=True)
        ticket = r.ticket = Ticket(cls, t, payload=r, tokens=prompt, streamed=True,
                                   tenant=policy)
        verdict = self.queues[gw].offer(ticket, t)
        if isinstance(verdict, Admitted):
            self._dispatch(ticket, t)
        elif not isinstance(verdict, Queued):
            r.fate = "shed"
        elif verdict.evicted is not None:  # another tenant's, over its share
            verdict.evicted[0].payload.fate = "shed"

    def _dispatch(self, ticket: Ticket, now: float) -> None:
        r: _Req = ticket.payload
        r.dispatched = now
        r.inflight_at_admit = ticket.inflight_at_admit
        self.reqs[r.id] = r
        self.core.add_request(EngineRequest(r.id, r.prompt, r.out, ignore_eos=True))

    def _tick(self, now: float) -> None:
        if self.tenants:  # the output streamed since the last tick, charged as the gateway does
            for r in self.reqs.values():
                assert r.ticket is not None
                self.queues[r.gateway].charge(r.ticket, r.tokens - r.ticket.output_charged, now)
        knee = 0.0
        for q, up in zip(self.queues, self.ups, strict=True):
            dispatched, expired = q.tick(now)
            for ticket in expired + q.take_late():
                ticket.payload.fate = "timeout"
            for ticket in dispatched:
                self._dispatch(ticket, now)
            knee += up.controller.knee_estimate or 0.0
        res = self.result
        res.times.append(now)
        res.limits.append(sum(u.controller.limit for u in self.ups))
        res.inflight.append(sum(u.inflight for u in self.ups))
        res.knee.append(knee / len(self.ups))
        res.demand.append(demand_ratio(self.queues, now))

    def _events(self, events: Sequence[Any], now: float) -> None:
        for ev in events:
            r = self.reqs[ev.request_id]
            r.tokens += ev.new_tokens
            if not ev.first:  # vLLM's inter_token_latency_seconds, one gap per step
                self.itl_sum += now - r.last
                self.itl_count += 1
            r.last = now
            if ev.first:
                r.first = now
                assert r.ticket is not None
                # as the gateway's tap: the engine's prefill backlog is one shorter
                q = self.queues[r.gateway]
                self._pumped(q, q.first_token(r.ticket, now), now)
            if ev.finished is None:
                continue
            del self.reqs[r.id]
            r.done, r.fate = now, "done"
            q = self.queues[r.gateway]
            sample = Sample(r.dispatched, now - r.dispatched, r.first - r.dispatched, r.prompt,
                            r.tokens, r.inflight_at_admit, Outcome.OK)
            assert r.ticket is not None
            self._pumped(q, q.release(r.ticket, now, sample), now)

    def _pumped(self, q: AdmissionQueue, dispatched: list[Ticket], now: float) -> None:
        """What a pump of `q` decided, outside the tick: the heads it set aside past their
        objective time out, and `dispatched` go to the engine (draining: what was queued
        stays undispatched)."""
        for ticket in q.take_late():
            ticket.payload.fate = "timeout"
        if now < self.sc.duration:
            for ticket in dispatched:
                self._dispatch(ticket, now)


def demand_ratio(queues: Sequence[AdmissionQueue], now: float) -> float:
    """The gateways' demand ratio as a pool (summed offered over summed capacity, as the
    ScaledObject's query reads it), NaN while any gateway has no estimate yet."""
    offered = capacity = 0.0
    for q in queues:
        e = q.demand.estimate(now, [u.controller.limit for u in q.upstreams if u.usable], 1.0)
        if e is None:
            return math.nan
        offered, capacity = offered + e.offered, capacity + e.capacity
    return offered / capacity


def run(
    sc: Scenario,
    controller: str,
    seed: int = 7,
    limit: int | None = None,
    then: Sequence[Move] = (),
    wait: float | None = None,
    arrivals: Sequence[Arrival] | None = None,
    fair: bool = True,
) -> Result:
    """One controller (or `fixed` at `limit`, total over the gateways) over one scenario.

    `wait`: every class's wait cap as this fraction of its TTFT objective (None: the
    scenario's `max_wait`); `then`: (at, limit, wait) moves of the fixed limit and the caps,
    for the switching oracle; `arrivals`: these instead of the scenario's seeded ones;
    `fair`: False serves the scenario's tenants as one (FIFO within a class).
    """
    return _Sim(sc, controller, seed, limit, then, wait, arrivals, fair).run()

