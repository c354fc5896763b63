"""The demand estimator: literal events in, exact readings out; then the admission queue
feeding it, and the gateway exporting it (/metrics and /kneegate/status)."""

from __future__ import annotations

import math

import pytest
from helpers.gateway import gw_config
from prometheus_client import CollectorRegistry

from kneegate.admission.demand import Demand, DemandEstimate, suggested_replicas
from kneegate.admission.queue import AdmissionQueue
from kneegate.admission.types import (
    Admitted,
    ClassPolicy,
    Rejected,
    Ticket,
    UpstreamState,
)
from kneegate.controllers.registry import build_controller
from kneegate.gateway.observability.metrics import GatewayMetrics
from kneegate.gateway.runtime import Gateway

LN2 = math.log(2.0)


def one_request() -> Demand:
    """h = 10 s: one arrival at 0, in flight alone until it completes at 10."""
    d = Demand(half_life=10.0, warm=1, settle=0.0)
    d.arrive(0.0)
    d.occupy(0.0, 1)
    d.complete(10.0, 0)
    return d


def test_one_request_reads_exactly() -> None:
    # at 10: A = 0.5, T = S = 5 / ln2 (the decay integrated over one half-life), C = 1
    e = one_request().estimate(10.0, [4], 0.9)
    assert e is not None
    assert e.offered == pytest.approx(LN2 / 10, rel=1e-12)  # A / T
    assert e.capacity == pytest.approx(4 * LN2 / 5, rel=1e-12)  # L x C / S
    assert e.ratio == pytest.approx(0.125, rel=1e-12)
    assert (e.engines, e.suggested_replicas) == (1, 1)


def test_idle_time_lowers_the_offered_load_and_keeps_the_capacity() -> None:
    # 10 s idle: A = 0.25, T = 7.5 / ln2; C and S decay alike, so C / S is unchanged
    e = one_request().estimate(20.0, [4], 0.9)
    assert e is not None
    assert e.offered == pytest.approx(LN2 / 30, rel=1e-12)
    assert e.capacity == pytest.approx(4 * LN2 / 5, rel=1e-12)
    assert e.ratio == pytest.approx(1 / 24, rel=1e-12)


def test_a_day_idle_keeps_the_capacity_without_underflow() -> None:
    e = one_request().estimate(86_400.0, [4], 0.9)
    assert e is not None and e.capacity == pytest.approx(4 * LN2 / 5, rel=1e-12)
    assert e.offered < 1e-200 and e.suggested_replicas == 1


def test_requests_held_without_completions_lower_the_capacity() -> None:
    # four in flight from 10 to 20, none ends: S = 2.5 / ln2 + 4 x 5 / ln2, C = 0.5
    d = one_request()
    d.occupy(10.0, 4)
    e = d.estimate(20.0, [4], 0.9)
    assert e is not None
    assert e.capacity == pytest.approx(4 * LN2 / 45, rel=1e-12)
    assert e.ratio == pytest.approx(0.375, rel=1e-12)


def test_steady_state_reads_the_closed_form() -> None:
    # 10 arrivals/s, 5 completions/s, 10 in flight of a limit of 10: capacity 5/s, ratio ~2;
    # read just after an arrival and a completion: A = 1 / (1 - Wa), C = 1 / (1 - Wc), S = N T
    d = Demand(half_life=10.0, warm=1, settle=0.0)
    d.occupy(0.0, 10)
    for i in range(1, 6001):  # 600 s: 60 half-lives, the start weighs 2**-60
        t = i / 10
        if i % 2 == 0:
            d.complete(t, 10)
        d.arrive(t)
    e = d.estimate(600.0, [10], 0.9)
    assert e is not None
    wa, wc = 0.5 ** (0.1 / 10), 0.5 ** (0.2 / 10)
    assert e.ratio == pytest.approx((1 - wc) / (1 - wa), rel=1e-9)  # 1.9931
    assert e.offered == pytest.approx(LN2 / 10 / (1 - wa), rel=1e-9)  # 10.03/s
    assert e.suggested_replicas == 3  # ceil(1 x 1.993 / 0.9)


def test_nothing_is_read_before_warm_or_without_a_usable_upstream() -> None:
    d = Demand(half_life=10.0, warm=3, settle=0.0)
    assert d.estimate(0.0, [4], 0.9) is None
    d.arrive(0.0)
    d.occupy(0.0, 1)
    for t in (1.0, 2.0):
        d.complete(t, 1)
    assert d.estimate(2.0, [4], 0.9) is None  # two of three completions
    d.complete(3.0, 1)
    assert d.estimate(3.0, [4], 0.9) is not None
    assert d.estimate(3.0, [], 0.9) is None  # no usable upstream: nothing to measure against
    assert d.estimate(3.0, [0], 0.9) is None


def test_nothing_is_read_until_two_request_lifetimes_have_passed() -> None:
    # one slot's requests last 2 s each: the first reading comes once 4 s have passed (two
    # lifetimes, S / C, at a completion), and stays, however long the lifetimes grow after
    d = Demand(half_life=10.0, warm=1)
    d.arrive(0.0)
    d.occupy(0.0, 1)
    d.complete(2.0, 1)
    assert d.estimate(3.9, [1], 0.9) is None
    d.complete(4.0, 1)
    assert d.estimate(4.0, [1], 0.9) is not None
    d.occupy(4.0, 1)  # then a request that runs for a minute
    assert d.estimate(64.0, [1], 0.9) is not None


def test_an_event_stamped_before_the_last_counts_at_the_last() -> None:
    a, b = one_request(), one_request()
    a.arrive(9.0)  # before the completion at 10 (the simulator's step order)
    b.arrive(10.0)
    assert a.estimate(12.0, [4], 0.9) == b.estimate(12.0, [4], 0.9)


@pytest.mark.parametrize(
    ("engines", "ratio", "target", "replicas"),
    [(1, 3.0, 0.9, 4), (2, 0.9, 0.9, 2), (2, 0.2, 0.9, 1), (3, 1.0, 1.0, 3), (1, 0.0, 0.9, 1),
     (4, 0.5, 0.9, 3), (1, 2.7, 0.9, 3)],
)
def test_suggested_replicas(engines: int, ratio: float, target: float, replicas: int) -> None:
    assert suggested_replicas(engines, ratio, target) == replicas


# --- fed by the admission queue ------------------------------------------------------------


def test_the_queue_counts_refused_arrivals_as_offered_load() -> None:
    # limit 1, no queue; a request of 1 s at every whole second, a second one at every half:
    # the half-second ones are refused, the engine serves exactly its capacity, and the
    # ratio reads 2, the load offered against it
    up = UpstreamState("u0", build_controller("fixed", {"initial": 1}))
    q = AdmissionQueue([up], {"c": ClassPolicy("c")}, max_queue=0)
    q.demand.half_life = 20.0
    refused = 0
    held: Ticket | None = None
    for i in range(2400):  # 1200 s: 60 half-lives
        t = i / 2
        if i % 2 == 0:
            if held is not None:
                q.release(held, t)
            held = Ticket("c", t)
            assert isinstance(q.offer(held, t), Admitted)
        else:
            refused += isinstance(q.offer(Ticket("c", t), t), Rejected)
    assert refused == 1200
    e = q.demand.estimate(1199.5, [up.controller.limit], 0.9)
    assert e is not None
    # read half a second after the last (refused) arrival: A = 1 / (1 - Wa), and the last
    # completion is half a second old, C = Wa / (1 - Wc); one in flight throughout, S = T
    wa, wc = 0.5 ** (0.5 / 20), 0.5 ** (1 / 20)
    assert e.ratio == pytest.approx((1 / (1 - wa)) / (wa / (1 - wc)), rel=1e-9)  # 2.0175


# --- exported by the gateway ---------------------------------------------------------------


def test_metrics_are_absent_until_known_then_read_at_scrape_time() -> None:
    registry = CollectorRegistry()
    metrics = GatewayMetrics(registry)
    reading: list[DemandEstimate | None] = [None]
    metrics.bind_live(lambda: [], lambda: [], lambda: 0.0,
                      lambda now: [("llama", reading[0]), ("qwen", None)])
    names = ("kneegate_demand_ratio", "kneegate_suggested_replicas",
             "kneegate_demand_offered_requests_per_second",
             "kneegate_demand_capacity_requests_per_second")
    llama, qwen = {"model": "llama"}, {"model": "qwen"}
    assert [registry.get_sample_value(n, llama) for n in names] == [None] * 4
    reading[0] = DemandEstimate(offered=9.0, capacity=3.0, ratio=3.0, engines=1,
                                suggested_replicas=4)
    assert [registry.get_sample_value(n, llama) for n in names] == [3.0, 4.0, 9.0, 3.0]
    assert [registry.get_sample_value(n, qwen) for n in names] == [None] * 4  # each its own


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_gateway_exports_its_pools_demand_on_metrics_and_status() -> None:
    cfg = gw_config("http://127.0.0.1:9", limit=2,
                    scale={"target": 0.5, "half_life": 10.0})
    registry, clock = CollectorRegistry(), FakeClock()
    gw = Gateway(cfg, registry=registry, clock=clock)
    demand = gw.queue.pools[0].queue.demand
    assert demand.half_life == 10.0
    assert gw.status()["demand"] is None
    one = {"model": ""}  # the pool's models are not known (nothing answers there)
    assert registry.get_sample_value("kneegate_demand_ratio", one) is None
    up = gw.queue.upstreams[0]
    for _ in range(demand.warm):  # one at a time, each 1 s: 1 of 2 slots in use
        t = Ticket("default", clock.now)
        gw.queue.offer(t, clock.now)
        clock.now += 1.0
        gw.queue.release(t, clock.now)
    status = gw.status()["demand"]
    assert status is not None and status["engines"] == 1
    ratio = registry.get_sample_value("kneegate_demand_ratio", one)
    assert ratio is not None and 0.4 < ratio < 0.5  # ~half the limit's level in use
    assert status["ratio"] == round(ratio, 3)
    assert status["suggested_replicas"] == 1 == registry.get_sample_value(
        "kneegate_suggested_replicas", one)
    up.usable = False
    assert gw.status()["demand"] is None  # no usable upstream: no capacity to measure


def test_a_reload_sets_the_half_life_and_target_without_losing_the_sums() -> None:
    clock = FakeClock()
    gw = Gateway(gw_config("http://127.0.0.1:9"), registry=CollectorRegistry(), clock=clock)
    gw.queue.offer(Ticket("default", clock.now), clock.now)
    gw.apply(gw_config("http://127.0.0.1:9", scale={"target": 0.6, "half_life": 40.0}))
    demand = gw.queue.pools[0].queue.demand
    assert demand.half_life == 40.0 and gw.config.scale.target == 0.6
    assert demand._arrivals == 1.0  # the pool's history stays


def test_arrivals_per_completion_reads_the_excess_whenever_it_is_read() -> None:
    d = Demand()
    assert d.arrivals_per_completion() == 0.0
    d.arrive(0.0)
    assert d.arrivals_per_completion() == math.inf  # nothing served yet
    assert not d.excess()  # one arrival ahead of its completion is no excess
    for i in range(1, 31):
        for _ in range(3):
            d.arrive(float(i))
        d.complete(float(i), 1)
    assert d.arrivals_per_completion() == pytest.approx(3.0, rel=0.05)
    assert d.excess()
    for i in range(31, 200):  # then as many arrive as end: the excess decays away
        d.arrive(float(i))
        d.complete(float(i), 1)
    assert d.arrivals_per_completion() == pytest.approx(1.0, abs=0.01)
    assert not d.excess()
