"""The gate: permits, queue waits, timeouts, cancellation, and counts that always add up."""

from __future__ import annotations

import asyncio

import anyio
import pytest
from prometheus_client import CollectorRegistry

from kneegate.admission.pools import Pools
from kneegate.admission.types import ClassPolicy
from kneegate.controllers.base import EngineStats, Outcome, Sample
from kneegate.controllers.registry import build_controller
from kneegate.gateway.errors import QueueFull, QueueTimeout
from kneegate.gateway.gate import Gate, Permit
from kneegate.gateway.observability.metrics import GatewayMetrics
from kneegate.gateway.upstream.state import Upstream

pytestmark = pytest.mark.anyio


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self, dt: float) -> None:
        if dt < 0:
            raise ValueError("time can't go backwards")
        self.now += dt


def make_gate(limit: int = 2, max_queue: int = 4) -> tuple[Gate, Upstream, FakeClock]:
    up = Upstream(name="e0", controller=build_controller("fixed", {"initial": limit}))
    classes = {"hi": ClassPolicy("hi", 10, max_wait=1.0), "lo": ClassPolicy("lo", 0, max_wait=5.0)}
    clock = FakeClock()
    registry = CollectorRegistry()
    metrics = GatewayMetrics(registry)
    gate = Gate(Pools([up], classes, max_queue), metrics, clock)
    metrics.bind_live(lambda: [up], lambda: [(c, gate.depth(c)) for c in classes])
    return gate, up, clock


async def one_waiting(gate: Gate, cls: str = "lo") -> tuple[Permit, asyncio.Task[Permit]]:
    """A request of class `cls` holding the only slot, and one queued behind it."""
    held = await gate.acquire(cls)
    waiting = asyncio.create_task(gate.acquire(cls))
    await asyncio.sleep(0)  # the waiter is queued
    return held, waiting


def value(gate: Gate, name: str, **labels: str) -> float:
    return gate.metrics.registry.get_sample_value(name, labels) or 0.0


def conserved(gate: Gate) -> None:
    reg = gate.metrics.registry
    def s(name: str) -> float:
        return sum(x.value for m in reg.collect() for x in m.samples if x.name == name)
    received = s("kneegate_requests_received_total") + s("kneegate_requests_requeued_total")
    admitted = s("kneegate_requests_admitted_total")
    assert received == admitted + s("kneegate_requests_shed_total") + s(
        "kneegate_requests_queue_timeout_total") + s("kneegate_queue_depth")
    assert admitted == s("kneegate_requests_finished_total") + s("kneegate_in_flight")
    # the queue's record of what is in flight (its wait bound) loses and keeps nothing
    assert gate.queue.flying == sum(u.inflight for u in gate.queue.upstreams)


def sample(outcome: Outcome = Outcome.OK) -> Sample:
    return Sample(admitted_at=100.0, duration=1.0, ttft=0.1, prompt_tokens=3, output_tokens=11,
                  inflight_at_admit=1, outcome=outcome)


async def test_finish_is_idempotent() -> None:
    gate, up, _ = make_gate()
    permit = await gate.acquire("hi")
    assert up.inflight == 1
    assert permit.finish(Outcome.OK, sample()) is True
    assert permit.finish(Outcome.OK, sample()) is False
    assert permit.finish(Outcome.CLIENT_CANCELLED) is False
    assert up.inflight == 0
    assert value(gate, "kneegate_requests_finished_total", upstream="e0", outcome="completed") == 1
    assert value(gate, "kneegate_output_tokens_total", upstream="e0") == 11
    conserved(gate)


async def test_cancelled_is_counted_but_not_a_sample() -> None:
    gate, up, _ = make_gate()
    seen: list[Sample] = []
    up.controller.on_sample = seen.append  # type: ignore[method-assign,assignment]
    (await gate.acquire("hi")).finish(Outcome.CLIENT_CANCELLED, sample(Outcome.CLIENT_CANCELLED))
    (await gate.acquire("hi")).finish(Outcome.TIMEOUT, sample(Outcome.TIMEOUT))
    assert [s.outcome for s in seen] == [Outcome.TIMEOUT]
    assert value(gate, "kneegate_requests_finished_total", upstream="e0",
                 outcome="client_cancelled") == 1
    assert value(gate, "kneegate_upstream_failures_total", upstream="e0", kind="timeout") == 1


async def test_queued_request_gets_the_freed_slot_higher_class_first() -> None:
    gate, up, clock = make_gate(limit=1)
    first = await gate.acquire("lo")
    lo = asyncio.create_task(gate.acquire("lo"))
    hi = asyncio.create_task(gate.acquire("hi"))
    await asyncio.sleep(0)  # both tasks reach the queue
    assert gate.queue.depth() == 2
    conserved(gate)
    clock.advance(0.5)
    first.finish(Outcome.OK, sample())
    with anyio.fail_after(1):
        got: Permit = await hi
    assert not lo.done() and got.upstream is up
    assert value(gate, "kneegate_queue_wait_seconds_sum", **{"class": "hi"}) == 0.5
    got.finish(Outcome.OK, sample())
    with anyio.fail_after(1):
        (await lo).finish(Outcome.OK, sample())
    assert up.inflight == 0
    conserved(gate)


async def test_queue_full_is_429_with_retry_after() -> None:
    gate, _, _ = make_gate(limit=1, max_queue=1)
    await gate.acquire("lo")
    waiting = asyncio.create_task(gate.acquire("lo"))
    await asyncio.sleep(0)
    with pytest.raises(QueueFull) as info:
        await gate.acquire("lo")
    assert info.value.retry_after >= 1 and "full" in info.value.message
    assert value(gate, "kneegate_requests_shed_total", **{"class": "lo"},
                 reason="queue_full") == 1
    waiting.cancel()
    conserved(gate)


async def test_wait_past_class_timeout_is_503() -> None:
    gate, up, clock = make_gate(limit=1)
    await gate.acquire("hi")
    waiting = asyncio.create_task(gate.acquire("hi"))
    await asyncio.sleep(0)
    clock.advance(0.9)
    gate.tick([up])
    assert not waiting.done()
    clock.advance(0.2)
    gate.tick([up])
    with anyio.fail_after(1), pytest.raises(QueueTimeout) as info:
        await waiting
    assert "exceeded 1s for class 'hi'" in info.value.message
    assert value(gate, "kneegate_requests_queue_timeout_total", **{"class": "hi"}) == 1
    conserved(gate)


async def test_caller_leaving_the_queue_is_counted_and_frees_its_place() -> None:
    gate, up, _ = make_gate(limit=1)
    held, waiting = await one_waiting(gate)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert gate.queue.depth() == 0
    assert value(gate, "kneegate_requests_shed_total", **{"class": "lo"},
                 reason="client_gone") == 1
    held.finish(Outcome.OK, sample())
    assert up.inflight == 0
    conserved(gate)


async def test_caller_leaving_just_after_dispatch_is_shed_not_admitted() -> None:
    # The engine never saw it: shed client_gone (was counted admitted + client_cancelled).
    gate, up, _ = make_gate(limit=1)
    held, waiting = await one_waiting(gate)
    held.finish(Outcome.OK, sample())  # dispatches the waiter: its future is resolved...
    conserved(gate)  # a scrape now sees it queued, not yet admitted nor in flight
    waiting.cancel()  # ...but its task is cancelled before it resumes
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert up.inflight == 0
    assert value(gate, "kneegate_requests_admitted_total", upstream="e0", **{"class": "lo"}) == 1
    assert value(gate, "kneegate_requests_finished_total", upstream="e0",
                 outcome="client_cancelled") == 0
    assert value(gate, "kneegate_requests_shed_total", **{"class": "lo"},
                 reason="client_gone") == 1
    conserved(gate)


async def test_a_handed_slot_is_admitted_when_its_caller_resumes() -> None:
    gate, up, _ = make_gate(limit=1)
    held, waiting = await one_waiting(gate)
    held.finish(Outcome.OK, sample())
    assert gate.depth("lo") == 1 and up.inflight == 1  # handed over, caller not resumed
    with anyio.fail_after(1):
        permit = await waiting
    assert gate.depth("lo") == 0
    assert value(gate, "kneegate_requests_admitted_total", upstream="e0", **{"class": "lo"}) == 2
    conserved(gate)
    permit.finish(Outcome.OK, sample())
    conserved(gate)


class Exploding:
    """A controller whose every hook raises: a bug must cost no slot and no request."""

    limit = 1
    knee_estimate = None

    def __getattr__(self, name: str) -> object:
        def boom(*args: object) -> None:
            raise RuntimeError(f"{name} exploded")
        return boom


async def test_a_controller_that_raises_keeps_no_slot() -> None:
    gate, up, _ = make_gate(limit=1)
    up.controller = Exploding()  # type: ignore[assignment]
    first = await gate.acquire("lo")  # on_admit raises: counted, the permit still comes
    waiting = asyncio.create_task(gate.acquire("lo"))
    await asyncio.sleep(0)
    first.finish(Outcome.OK, sample())  # on_sample raises after the slot is free
    with anyio.fail_after(1):
        second = await waiting  # the freed slot reached the waiter
    gate.tick([up])  # on_tick raises: the tick goes on
    gate.engine_stats(up, EngineStats(100.0, 1, 0, 0.1, 0))  # as the scraper feeds it
    second.finish(Outcome.OK, sample())
    assert up.inflight == 0
    assert value(gate, "kneegate_controller_errors_total", upstream="e0", hook="on_arrival") == 2
    assert value(gate, "kneegate_controller_errors_total", upstream="e0",
                 hook="on_engine_stats") == 1
    assert value(gate, "kneegate_controller_errors_total", upstream="e0", hook="on_sample") == 2
    assert value(gate, "kneegate_controller_errors_total", upstream="e0", hook="on_admit") == 2
    assert value(gate, "kneegate_controller_errors_total", upstream="e0", hook="on_tick") == 1
    conserved(gate)


async def test_a_growing_limit_dispatches_at_the_tick() -> None:
    gate, up, _ = make_gate(limit=1)
    await gate.acquire("lo")
    waiting = asyncio.create_task(gate.acquire("lo"))
    await asyncio.sleep(0)
    up.controller._set_limit(2)  # type: ignore[attr-defined]
    gate.tick([up])
    with anyio.fail_after(1):
        await waiting
    assert up.inflight == 2


async def test_waiter_cancelled_just_before_its_slot_comes_releases_it_once() -> None:
    gate, up, _ = make_gate(limit=1)
    first = await gate.acquire("lo")
    waiter = asyncio.create_task(gate.acquire("lo"))
    await asyncio.sleep(0)  # the waiter is queued
    waiter.cancel()  # the client goes away: its future is cancelled now, its task runs later
    first.finish(Outcome.OK, sample())  # before the task runs, the freed slot reaches it
    with anyio.fail_after(1):
        done = await asyncio.gather(waiter, return_exceptions=True)
    assert isinstance(done[0], asyncio.CancelledError), done[0]
    assert up.inflight == 0
    conserved(gate)


async def test_user_ttft_and_goodput_are_judged_from_arrival() -> None:
    """The engine's TTFT is from dispatch; the user's adds the queue wait, and only answers
    whose first token met the objective from arrival count as goodput."""
    up = Upstream(name="e0", controller=build_controller("fixed", {"initial": 1}))
    classes = {"c": ClassPolicy("c", 0, max_wait=5.0, ttft_objective=1.0)}
    clock, metrics = FakeClock(), GatewayMetrics(CollectorRegistry())
    gate = Gate(Pools([up], classes, 4), metrics, clock)
    held, waiting = await one_waiting(gate, "c")
    clock.advance(0.5)
    held.finish(Outcome.OK, Sample(admitted_at=100.0, duration=0.5, ttft=0.1, prompt_tokens=3,
                                   output_tokens=11, inflight_at_admit=1, outcome=Outcome.OK))
    second = await asyncio.wait_for(waiting, 1)
    assert second.admitted_at == 100.5
    clock.advance(1.0)  # its engine TTFT is 0.6 s, met from dispatch; 1.1 s from arrival
    second.finish(Outcome.OK, Sample(admitted_at=100.5, duration=1.0, ttft=0.6,
                                     prompt_tokens=3, output_tokens=7, inflight_at_admit=1,
                                     outcome=Outcome.OK))
    cls = {"class": "c"}
    assert value(gate, "kneegate_request_ttft_seconds_count", **cls) == 2
    assert value(gate, "kneegate_request_ttft_seconds_sum", **cls) == pytest.approx(1.2)
    assert value(gate, "kneegate_ttft_seconds_sum", upstream="e0") == pytest.approx(0.7)
    assert value(gate, "kneegate_goodput_tokens_total", **cls) == 11
    assert value(gate, "kneegate_output_tokens_total", upstream="e0") == 18

