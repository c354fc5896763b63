"""The admission queue's own CPU per request, without sockets: offer, then release.

    python -m kneegate_bench.admission_cost              # 1, 10 and 100 tenants
    python -m kneegate_bench.admission_cost --tenants 1 --requests 20000

Two shapes, each the best of `--repeat` runs of `--requests` requests (process CPU time,
so a busy machine inflates it less than wall time would):

  through   one request at a time, the queue empty: offer dispatches it at once and
            release frees it (the common path while the engine has room)
  queued    the upstream full and `--tenants` tenants backlogged (4 queued each): each
            request is offered, queued and, as one in flight ends, dispatched by the fair
            queue (the path under overload)
  gate      `through`, as the proxy pays it: `Gate.acquire` and `Permit.finish` with a
            sample, the gateway's own metrics included, on an asyncio loop (a gateway
            built from the config `kneegate serve --controller fixed` makes)

Prints microseconds per request for each shape and tenant count.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

from kneegate.admission.queue import AdmissionQueue
from kneegate.admission.types import (
    ANONYMOUS,
    Admitted,
    ClassPolicy,
    TenantPolicy,
    Ticket,
    UpstreamState,
)
from kneegate.controllers.base import Outcome, Sample
from kneegate.controllers.registry import build_controller

__all__ = ["main", "per_request"]

_SAMPLE = Sample(0.0, 1.0, 0.1, 100, 10, 1, Outcome.OK)


def _queue(limit: int) -> AdmissionQueue:
    up = UpstreamState("u", build_controller("fixed", {"initial": limit}))
    return AdmissionQueue([up], {"default": ClassPolicy("default", ttft_objective=60.0)},
                          max_queue=100_000)


def _through(n: int, tenants: list[TenantPolicy]) -> float:
    q = _queue(64)
    t0 = time.process_time()
    for i in range(n):
        now = i * 1e-3
        t = Ticket("default", now, tokens=100, tenant=tenants[i % len(tenants)])
        q.offer(t, now)
        q.release(t, now, _SAMPLE)
    return (time.process_time() - t0) / n


def _queued(n: int, tenants: list[TenantPolicy]) -> float:
    q = _queue(8)
    inflight: list[Ticket] = []
    for i in range(8 + 4 * len(tenants)):  # the engine full, every tenant 4 deep
        t = Ticket("default", 0.0, tokens=100, tenant=tenants[i % len(tenants)])
        if isinstance(q.offer(t, 0.0), Admitted):
            inflight.append(t)
    t0 = time.process_time()
    for i in range(n):
        now = 1.0 + i * 1e-3
        q.offer(Ticket("default", now, tokens=100, tenant=tenants[i % len(tenants)]), now)
        inflight += q.release(inflight.pop(0), now, _SAMPLE)
    return (time.process_time() - t0) / n


def _gate(n: int, tenants: list[TenantPolicy]) -> float:
    from kneegate.gateway.config.gateway import parse_config
    from kneegate.gateway.runtime import Gateway

    gw = Gateway(parse_config({"upstreams": [{
        "name": "u", "url": "http://127.0.0.1:9", "controller": "fixed",
        "params": {"initial": 100_000, "max_limit": 100_000}}]}, "admission_cost"))
    gate = gw.gate

    async def cycles() -> float:
        t0 = time.process_time()
        for i in range(n):
            permit = await gate.acquire("default", 100, tenant=tenants[i % len(tenants)])
            permit.finish(Outcome.OK, Sample(permit.admitted_at, 1.0, 0.1, 100, 10,
                                             permit.ticket.inflight_at_admit, Outcome.OK))
        return (time.process_time() - t0) / n

    return asyncio.run(cycles())


_SHAPES = {"through": _through, "queued": _queued, "gate": _gate}


def per_request(shape: str, tenants: int, requests: int, repeat: int) -> float:
    """Best of `repeat` runs: CPU seconds per request."""
    policies = [ANONYMOUS] if tenants == 1 else [
        TenantPolicy(f"t{i}", label=f"t{i}") for i in range(tenants)]
    return min(_SHAPES[shape](requests, policies) for _ in range(repeat))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kneegate_bench.admission_cost",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--tenants", default="1,10,100")
    ap.add_argument("--requests", type=int, default=50_000)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)
    print(f"{'tenants':>8}" + "".join(f"{s + ' us/req':>15}" for s in _SHAPES))
    for n in (int(x) for x in args.tenants.split(",")):
        cost = [per_request(s, n, args.requests, args.repeat) for s in _SHAPES]
        print(f"{n:>8}" + "".join(f"{c * 1e6:>15.2f}" for c in cost), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
