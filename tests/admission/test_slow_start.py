"""No refusal without evidence: the slow start alone, then driving the pure admission queue."""

from __future__ import annotations

import dataclasses

import pytest
from helpers.controllers import make_sample

from kneegate.admission.queue import AdmissionQueue
from kneegate.admission.slow_start import SlowStart, saturated
from kneegate.admission.types import (
    ClassPolicy,
    Queued,
    Rejected,
    RejectReason,
    Ticket,
    UpstreamState,
)
from kneegate.controllers.base import EngineStats, Outcome
from kneegate.controllers.registry import build_controller

CLASSES = {"default": ClassPolicy("default", max_wait=30.0, ttft_objective=2.0)}


def stats(preemptions: float) -> EngineStats:
    return EngineStats(at=0.0, running=8, waiting=40, kv_cache_usage=0.5,
                       preemptions_total=preemptions)


def test_each_timely_first_token_at_the_limit_adds_one_slot_up_to_its_reach() -> None:
    ss = SlowStart()
    assert ss.limit(4) == 4
    assert not ss.first_token(0.1, 2.0, inflight=4, controller_limit=4)
    assert ss.limit(4) == 5
    ss.first_token(0.1, 2.0, inflight=2, controller_limit=4)  # not full: no growth
    assert ss.limit(4) == 5
    for _ in range(100):
        ss.first_token(0.1, 2.0, inflight=ss.limit(4), controller_limit=4)
    assert ss.limit(4) == SlowStart.REACH * 4  # within its reach of the first limit
    assert ss.limit(40) == 40  # a controller that climbed past it decides


def test_saturation_closes_it_for_good() -> None:
    late = SlowStart(allowance=12)
    assert late.first_token(2.5, 2.0, inflight=12, controller_limit=4)  # past the objective
    assert not late.open and late.ended_at_level == 12 and late.limit(4) == 4
    assert not late.first_token(0.1, 2.0, inflight=4, controller_limit=4)
    assert late.limit(4) == 4
    preempted = SlowStart(allowance=12)
    assert not preempted.engine_stats(stats(3), 12, 2.0)  # the first scrape: no delta
    assert preempted.engine_stats(stats(5), 12, 2.0)
    assert not preempted.open
    queued = SlowStart(allowance=12)
    assert not queued.engine_stats(stats(3), 12, 2.0)  # one reading of a queue
    assert queued.engine_stats(stats(3), 12, 2.0)  # standing: saturation
    assert not queued.open


def timed(waiting: float, waited: float, left: float) -> EngineStats:
    """A scrape of an engine that reports its queue time: `left` requests have left its
    queue, having waited `waited` s in all."""
    return EngineStats(at=0.0, running=8, waiting=waiting, kv_cache_usage=0.5,
                       preemptions_total=0, queue_time_sum=waited, queue_time_count=left)


def test_an_engine_that_reports_its_queue_time_is_saturated_only_by_long_waits() -> None:
    # a burst: requests wait at every scrape, but briefly (0.2 s on average): not saturation
    assert not saturated(timed(30, 0.0, 0), timed(30, 6.0, 30), 2.0)
    assert not saturated(timed(30, 6.0, 30), timed(20, 10.0, 50), 2.0)
    # waits of half the objective on average: saturation
    assert saturated(timed(30, 6.0, 30), timed(30, 18.0, 40), 2.0)  # 1.2 s each
    # nobody left the queue in an interval (a long prefill ahead): not yet known
    assert not saturated(timed(5, 6.0, 30), timed(5, 6.0, 30), 2.0)
    ss = SlowStart(allowance=12)
    for s in (timed(30, 0.0, 0), timed(30, 6.0, 30), timed(20, 10.0, 50)):
        assert not ss.engine_stats(s, 12, 2.0)
    assert ss.open and ss.engine_stats(timed(20, 40.0, 70), 12, 2.0)  # 1.5 s each


def queue(controller: str = "aimd") -> tuple[AdmissionQueue, UpstreamState]:
    up = UpstreamState("u", build_controller(controller, {"initial": 4}))
    return AdmissionQueue([up], CLASSES, max_queue=64), up


def burst(q: AdmissionQueue, n: int, now: float) -> list[Ticket]:
    tickets = [Ticket("default", now, streamed=True) for _ in range(n)]
    answers = [q.offer(t, now) for t in tickets]
    assert not [a for a in answers if isinstance(a, Rejected)], answers
    return tickets


def test_a_cold_burst_is_queued_then_let_in_as_first_tokens_come_never_refused() -> None:
    q, up = queue()
    tickets = burst(q, 15, 0.0)
    assert up.inflight == 4
    # 1 s with no first token: the old guess, 12 ahead x the oldest's age / 4 in flight,
    # said 3.0 s and refused it (over_objective)
    late = Ticket("default", 1.0, streamed=True)
    assert isinstance(q.offer(late, 1.0), Queued)
    now = 1.0
    while any(t.dispatched_at is None for t in [*tickets, late]):
        now += 0.1
        waiting_first = [t for t in [*tickets, late] if t.awaiting_first]
        assert waiting_first, "nothing in flight and something queued"
        for t in waiting_first:
            q.first_token(t, now)
    assert up.inflight == up.limit == 16  # its reach: 4 x the controller's 4
    assert now < 2.0  # a few round trips to a first token, before any is due


def test_once_saturated_the_limit_is_the_controllers_and_the_queue_may_refuse() -> None:
    q, up = queue()
    tickets = burst(q, 12, 0.0)
    for t in [t for t in tickets if t.awaiting_first]:
        q.first_token(t, 0.1)  # 4 timely first tokens: room for 8
    assert up.limit == 8
    first = next(t for t in tickets if t.awaiting_first)
    q.first_token(first, 2.6)  # 2.5 s after its dispatch: past the 2 s objective
    assert up.slow_start is not None and not up.slow_start.open
    assert up.limit == up.controller.limit == 4
    for i in range(40):  # answers end slowly: the measured rate says a wait of 3 s
        q.note_completion(10.0 + 3 * i)
    refused = q.offer(Ticket("default", 130.0, streamed=True), 130.0)
    assert isinstance(refused, Rejected) and refused.reason is RejectReason.OVER_OBJECTIVE


def _engine_in_time(q: AdmissionQueue, up: UpstreamState, reports_queue_time: bool) -> None:
    for at, waited, left in ((0.0, 0.0, 0), (1.0, 0.1, 1)):  # an engine that is not saturated
        scrape = timed(0, waited, left) if reports_queue_time else stats(0)
        q.engine_stats(up, dataclasses.replace(scrape, at=at, waiting=0))


@pytest.mark.parametrize("reports_queue_time", [True, False])
def test_a_request_queued_past_its_objective_at_the_reach_ends_a_slow_start_on_queue_time(
        reports_queue_time: bool) -> None:
    below, up = queue()  # below its reach the slow start may still grow: it stays open
    _engine_in_time(below, up, reports_queue_time)
    burst(below, 8, 0.0)  # 4 in flight with no first token, 4 queued until they are due
    _, expired = below.tick(2.1)
    assert len(expired) == 4 and up.slow_start is not None and up.slow_start.open
    q, up = queue()
    _engine_in_time(q, up, reports_queue_time)
    tickets, now = burst(q, 40, 0.0), 0.0
    for _ in range(100):  # timely first tokens: it grows to its reach
        if up.limit == SlowStart.REACH * 4:
            break
        now += 0.01
        for t in [t for t in tickets if t.awaiting_first]:
            q.first_token(t, now)
    assert up.limit == SlowStart.REACH * 4 and now < 1.0
    assert up.slow_start is not None and up.slow_start.open
    for _ in range(4):
        q.offer(Ticket("default", now, streamed=True), now)
    _, expired = q.tick(now + 2.1)
    assert expired  # queued past its objective, the upstream at its reach
    assert up.slow_start.open is not reports_queue_time
    assert up.slow_start.ended_by == ("queued_past_objective" if reports_queue_time else None)


def test_an_overloaded_answer_is_saturation() -> None:
    q, up = queue()
    (t,) = burst(q, 1, 0.0)
    q.release(t, 1.0, make_sample(outcome=Outcome.UPSTREAM_OVERLOADED, ttft=None))
    assert up.slow_start is not None and not up.slow_start.open


def test_a_fixed_limit_is_the_operators_number() -> None:
    q, up = queue("fixed")
    assert up.slow_start is None
    tickets = burst(q, 8, 0.0)
    for t in [t for t in tickets if t.awaiting_first]:
        q.first_token(t, 0.1)
    assert up.inflight == 4 and up.limit == 4
    # and its queue guesses the wait from the time that passed with no answer, as before
    refused = q.offer(Ticket("default", 3.0, streamed=True), 3.0)
    assert isinstance(refused, Rejected) and refused.reason is RejectReason.OVER_OBJECTIVE
