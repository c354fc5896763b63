"""The pure admission queue: literal steps in, exact decisions out (no asyncio, no clock)."""

from __future__ import annotations

import pytest
from helpers.controllers import make_sample
from helpers.gateway import overloaded, warm_rate

from kneegate.admission.queue import AdmissionQueue
from kneegate.admission.types import (
    Admitted,
    ClassPolicy,
    Queued,
    Rejected,
    RejectReason,
    Ticket,
    UpstreamState,
)
from kneegate.admission.wait import PrefillLine
from kneegate.controllers.base import EngineStats, Outcome, Sample
from kneegate.controllers.fixed import Fixed, FixedConfig
from kneegate.controllers.registry import build_controller


def pool(*limits: int) -> list[UpstreamState]:
    return [UpstreamState(f"u{i}", build_controller("fixed", {"initial": n}))
            for i, n in enumerate(limits)]


CLASSES = {"hi": ClassPolicy("hi", priority=10, max_wait=1.0, queue_share=0.5),
           "lo": ClassPolicy("lo", priority=0, max_wait=5.0)}


def test_admits_to_the_upstream_with_most_free_room() -> None:
    ups = pool(4, 2)
    q = AdmissionQueue(ups, CLASSES, max_queue=4)
    picks = [q.offer(Ticket("lo", 0.0), 0.0) for _ in range(6)]
    assert all(isinstance(p, Admitted) for p in picks)
    assert [u.inflight for u in ups] == [4, 2]
    assert isinstance(q.offer(Ticket("lo", 0.0), 0.0), Queued)


def test_higher_class_goes_first_and_share_caps_a_class() -> None:
    ups = pool(1)
    q = AdmissionQueue(ups, CLASSES, max_queue=4)
    first = Ticket("lo", 0.0)
    q.offer(first, 0.0)
    lo, hi1, hi2 = Ticket("lo", 1.0), Ticket("hi", 2.0), Ticket("hi", 2.1)
    assert q.offer(lo, 1.0) == Queued(0)
    assert q.offer(hi1, 2.0) == Queued(0)  # nothing of its rank or higher waits
    assert q.offer(hi2, 2.1) == Queued(1)
    third = q.offer(Ticket("hi", 2.2), 2.2)  # hi may fill half of 4
    assert isinstance(third, Rejected) and third.reason is RejectReason.QUEUE_FULL
    assert q.release(first, 2.3) == [hi1]
    assert q.release(hi1, 2.4) == [hi2]
    assert q.release(hi2, 2.5) == [lo]


def test_expire_and_withdraw() -> None:
    ups = pool(1)
    q = AdmissionQueue(ups, CLASSES, max_queue=4)
    q.offer(Ticket("lo", 0.0), 0.0)
    hi, lo = Ticket("hi", 0.0), Ticket("lo", 0.0)
    q.offer(hi, 0.0)
    q.offer(lo, 0.0)
    assert q.expire(0.99) == []
    assert q.expire(1.0) == [hi]
    assert q.withdraw(lo) is True and q.withdraw(lo) is False
    assert q.depth() == 0


def test_no_usable_upstream_is_rejected_at_once() -> None:
    ups = pool(2)
    ups[0].usable = False
    r = AdmissionQueue(ups, CLASSES).offer(Ticket("lo", 0.0), 0.0)
    assert isinstance(r, Rejected) and r.reason is RejectReason.NO_UPSTREAM


def test_reconfigure_keeps_queued_tickets_of_a_removed_class() -> None:
    ups = pool(1)
    q = AdmissionQueue(ups, CLASSES, max_queue=4)
    first = Ticket("lo", 0.0)
    q.offer(first, 0.0)
    old = Ticket("lo", 0.0)
    q.offer(old, 0.0)
    q.reconfigure({"new": ClassPolicy("new", priority=-5)}, 4, ups)
    newer = Ticket("new", 1.0)
    assert q.offer(newer, 1.0) == Queued(0)  # the removed class ranks below every class
    assert q.release(first, 2.0) == [newer]
    assert q.release(newer, 3.0) == [old]


class Budgeted(Fixed):
    """A fixed limit beside a token budget: in-flight estimates may sum to `budget`."""

    def __init__(self, limit: int, budget: int) -> None:
        super().__init__(FixedConfig(initial=limit))
        self.budget = budget

    def fits(self, inflight: int, inflight_tokens: int, tokens: int) -> bool:
        return inflight_tokens + tokens <= self.budget


def test_a_head_over_the_token_budget_waits_and_so_does_everything_behind_it() -> None:
    up = UpstreamState("u", Budgeted(limit=10, budget=1000))
    q = AdmissionQueue([up], CLASSES, max_queue=8)
    first = Ticket("lo", 0.0, tokens=600)
    assert q.offer(first, 0.0) == Admitted(up)
    big, small = Ticket("lo", 1.0, tokens=500), Ticket("lo", 2.0, tokens=100)
    assert q.offer(big, 1.0) == Queued(0)  # 600 + 500 > 1000, though the count has room
    assert q.offer(small, 2.0) == Queued(1)  # it would fit, but FIFO: it waits behind
    assert q.pump(3.0) == []
    assert q.release(first, 4.0) == [big, small]  # 500 + 100 fit
    assert (up.inflight, up.inflight_tokens) == (2, 600)


def test_an_idle_upstream_takes_a_request_larger_than_its_whole_budget() -> None:
    up = UpstreamState("u", Budgeted(limit=10, budget=100))
    q = AdmissionQueue([up], CLASSES, max_queue=8)
    assert q.offer(Ticket("lo", 0.0, tokens=5000), 0.0) == Admitted(up)
    assert q.offer(Ticket("lo", 0.0, tokens=1), 0.0) == Queued(0)


def test_a_request_goes_to_the_upstream_whose_budget_it_fits() -> None:
    full = UpstreamState("full", Budgeted(limit=10, budget=1000))
    roomy = UpstreamState("roomy", Budgeted(limit=10, budget=10_000))
    q = AdmissionQueue([full, roomy], CLASSES, max_queue=8)
    for _ in range(2):  # one each: both at 1/10 of their count
        q.offer(Ticket("lo", 0.0, tokens=900), 0.0)
    assert (full.inflight, roomy.inflight) == (1, 1)
    assert q.offer(Ticket("lo", 0.0, tokens=200), 0.0) == Admitted(roomy)


def test_retry_after_at_cold_start_comes_from_the_limits() -> None:
    # no completion yet: 30 ahead over two upstreams of 8 and 7 slots -> 31 / 15 -> 3 s
    q = AdmissionQueue(pool(8, 7), CLASSES, max_queue=64, retry_after_max=60)
    assert q.retry_after(30) == 3


def test_retry_after_is_not_inflated_by_a_young_completion_rate() -> None:
    # 20 completions at 10/s: the plain average still read 1.3/s (Retry-After 24 s for 30
    # ahead); debiased it reads 10/s: 31 / 10 -> 4 s
    q = AdmissionQueue(pool(10), CLASSES, max_queue=64, retry_after_max=60)
    for i in range(20):
        q.note_completion(100.0 + i / 10)
    assert abs(q.completion_rate - 10.0) < 0.5
    assert q.retry_after(30) == 4


def test_the_completion_rate_counts_a_wave_over_the_time_it_ran() -> None:
    # 16 answers sent at t=0 end together 7.0-7.3 s later. Counted from the first of them,
    # the other 15 came in 0.3 s: 50/s, where the engine served ~2.2/s; the queue then took
    # requests it could not start in time (on the emulator fitted to vLLM's CPU build, 503s
    # after ~1 s). Counted from the dispatch that made it busy: 2.7/s (an EWMA weighs the
    # wave's end above its start).
    ups = pool(16)
    q = AdmissionQueue(ups, CLASSES, max_queue=64)
    wave = [Ticket("lo", 0.0) for _ in range(16)]
    assert all(isinstance(q.offer(t, 0.0), Admitted) for t in wave)
    for i, t in enumerate(wave):
        q.release(t, 7.0 + i * 0.02)
    assert q.completion_rate == pytest.approx(2.72, abs=0.01)


def test_reroute_frees_the_unreachable_slot_without_a_completion() -> None:
    ups = pool(2, 1)
    q = AdmissionQueue(ups, CLASSES, max_queue=4)
    t = Ticket("lo", 0.0, tokens=30)
    assert q.offer(t, 0.0) == Admitted(ups[0])
    ups[0].usable = False  # its connect failed
    assert q.reroute(t, 1.0) is ups[1]
    assert (t.upstream, t.dispatched_at, t.inflight_at_admit) == (ups[1], 1.0, 1)
    assert [(u.inflight, u.inflight_tokens) for u in ups] == [(0, 0), (1, 30)]
    assert q.completion_rate == 0.0  # nothing was served
    other = Ticket("lo", 2.0)
    assert isinstance(q.offer(other, 2.0), Queued)  # u1 is full, u0 unusable
    assert q.reroute(t, 3.0) is None  # no other upstream has room: the ticket stays
    assert t.upstream is ups[1] and ups[1].inflight == 1


# --- the queue bounded by time (issue 12) -------------------------------------------

# the whole objective as the queue's budget, so the rule's arithmetic shows plainly
OBJ = {"chat": ClassPolicy("chat", priority=0, max_wait=30.0, ttft_objective=2.0,
                           queue_budget=1.0)}


def test_a_request_that_cannot_meet_its_objective_is_told_at_once() -> None:
    # 4 completions/s, engine TTFT 0.25 s: the k-th queued request's first token comes
    # (k + 1) / 4 + 0.25 s from now; with a 2 s objective 6 may wait (k = 0..5: 1.75 s),
    # the 7th (k = 6: 2.0 s) still fits, the 8th (2.25 s) is refused with Retry-After 1
    ups = pool(1)
    q = AdmissionQueue(ups, OBJ, max_queue=64)
    now = warm_rate(q, 4.0)
    q.note_ttft(0.25)
    assert isinstance(q.offer(Ticket("chat", now), now), Admitted)
    decisions = [q.offer(Ticket("chat", now), now) for _ in range(8)]
    assert decisions[:7] == [Queued(k) for k in range(7)]
    refused = decisions[7]
    assert isinstance(refused, Rejected) and refused.reason is RejectReason.OVER_OBJECTIVE
    assert refused.retry_after == 1
    assert q.depth() == 7


def test_no_wait_is_predicted_shorter_than_the_oldest_answers_time_left() -> None:
    # 4 completions/s, answers 1 s long, engine TTFT 0.25 s. Four answers start together at
    # `now` (a wave): no slot frees before now + 1, whatever the rate says (0.25 s). With a
    # 0.9 s objective the queue may hold 0.65 s: refused then, queued once the wave is old.
    ups = pool(4)
    q = AdmissionQueue(ups, OBJ, max_queue=64)
    now = warm_rate(q, 4.0)
    for _ in range(10):
        q.note_sample(ups[0], make_sample(duration=1.0, ttft=0.25))
    assert all(isinstance(q.offer(Ticket("chat", now), now), Admitted) for _ in range(4))
    early = q.offer(Ticket("chat", now, ttft_objective=0.9), now)
    assert isinstance(early, Rejected) and early.reason is RejectReason.OVER_OBJECTIVE
    assert early.retry_after == 1  # ceil(1.0 - 0.65)
    later = now + 0.9  # the wave has 0.1 s left: the rate's 0.25 s holds again
    assert q.offer(Ticket("chat", later, ttft_objective=0.9), later) == Queued(0)


def test_a_queue_that_drains_slower_than_answers_end_is_predicted_by_its_drain() -> None:
    # answers end 4 a second (3 of them elsewhere: on another gateway, or freeing KV a
    # larger request still waits for), but the queue's head leaves once a second. The
    # completion rate alone promised 0.75 s to a request with 2 ahead: by the queue's own
    # drain it is 3 s, over the 2 s it may queue (a quarter of 8 s), and it is told at once
    ups = pool(1)
    slow = {"chat": ClassPolicy("chat", max_wait=30.0, ttft_objective=8.0)}
    q = AdmissionQueue(ups, slow, max_queue=64)
    now = warm_rate(q, 4.0)
    flying = Ticket("chat", now)
    assert q.offer(flying, now) == Admitted(ups[0])
    queued = [Ticket("chat", now) for _ in range(6)]
    assert [q.offer(t, now) for t in queued] == [Queued(k) for k in range(6)]
    for i in range(1, 6):
        for k in (3, 2, 1):
            q.note_completion(now + i - k / 4)
        assert q.release(flying, now + i) == [queued[i - 1]]
        flying = queued[i - 1]
    assert q.completion_rate == pytest.approx(4.0, abs=0.01)
    later = now + 5
    assert q.offer(Ticket("chat", later), later) == Queued(1)  # (1 + 1) / 1: 2 s
    refused = q.offer(Ticket("chat", later), later)
    assert isinstance(refused, Rejected) and refused.reason is RejectReason.OVER_OBJECTIVE
    assert "~3.0s predicted" in refused.message


def test_by_default_the_queue_may_hold_a_quarter_of_the_objective() -> None:
    # the same 4/s and 0.25 s engine TTFT: a quarter of 2 - 0.25 is 0.4375 s of queue, so one
    # may wait (0.25 s predicted), the next (0.5 s) is refused, Retry-After ceil(0.0625) = 1
    ups = pool(1)
    q = AdmissionQueue(ups, {"chat": ClassPolicy("chat", ttft_objective=2.0)}, max_queue=64)
    now = warm_rate(q, 4.0)
    q.note_ttft(0.25)
    assert isinstance(q.offer(Ticket("chat", now), now), Admitted)
    assert q.offer(Ticket("chat", now), now) == Queued(0)
    refused = q.offer(Ticket("chat", now), now)
    assert isinstance(refused, Rejected) and refused.reason is RejectReason.OVER_OBJECTIVE
    assert refused.retry_after == 1


def test_without_an_excess_of_arrivals_a_request_may_wait_what_its_objective_allows() -> None:
    # the same 4/s and 0.25 s engine TTFT, but as many arrivals as completions: nothing
    # to ration, so the queue may hold the objective less the engine's TTFT, 1.75 s: the
    # k-th queued request waits (k + 1) / 4, so 7 are queued (k = 6: 1.75 s), the 8th is
    # refused
    ups = pool(1)
    q = AdmissionQueue(ups, {"chat": ClassPolicy("chat", ttft_objective=2.0)}, max_queue=64)
    now = warm_rate(q, 4.0, n=200, offered=1)  # 50 s of them: 8 more arrivals read 1.1
    q.note_ttft(0.25)
    assert isinstance(q.offer(Ticket("chat", now), now), Admitted)
    decisions = [q.offer(Ticket("chat", now), now) for _ in range(8)]
    assert decisions[:7] == [Queued(k) for k in range(7)]
    assert isinstance(decisions[7], Rejected)
    assert decisions[7].reason is RejectReason.OVER_OBJECTIVE
    assert not q.demand.excess()
    # two arrivals a completion: the excess is rationed, a quarter of 2 - 0.25 s
    q2 = AdmissionQueue(pool(1), {"chat": ClassPolicy("chat", ttft_objective=2.0)},
                        max_queue=64)
    now = warm_rate(q2, 4.0, offered=2)
    q2.note_ttft(0.25)
    assert isinstance(q2.offer(Ticket("chat", now), now), Admitted)
    assert q2.offer(Ticket("chat", now), now) == Queued(0)
    assert isinstance(q2.offer(Ticket("chat", now), now), Rejected)  # 0.5 s > 0.4375 s


def test_a_request_may_tighten_its_objective() -> None:
    ups = pool(1)
    q = AdmissionQueue(ups, OBJ, max_queue=64)
    now = warm_rate(q, 4.0)
    q.offer(Ticket("chat", now), now)
    tight = q.offer(Ticket("chat", now, ttft_objective=0.2), now)  # 1 / 4 > 0.2
    assert isinstance(tight, Rejected) and tight.reason is RejectReason.OVER_OBJECTIVE
    loose = q.offer(Ticket("chat", now, ttft_objective=60.0), now)  # cannot loosen: 2 s
    assert loose == Queued(0)


def test_demand_counts_what_the_engines_could_have_served_and_nothing_a_client_chose() -> None:
    ups = pool(1)
    q = AdmissionQueue(ups, OBJ, max_queue=64)
    now = warm_rate(q, 4.0)
    arrivals = q.demand._arrivals

    def counted(ticket: Ticket) -> float:
        before = q.demand._arrivals
        q.offer(ticket, now)
        return q.demand._arrivals - before

    assert counted(Ticket("chat", now)) == 1  # admitted
    assert counted(Ticket("chat", now)) == 1  # queued
    assert counted(Ticket("chat", now, ttft_objective=0.2)) == 0  # its own objective refused it
    assert counted(Ticket("chat", now, generation=False)) == 0  # passes, no slot
    assert counted(Ticket("chat", now, generation=False)) == 0
    assert (ups[0].inflight, ups[0].passing, q.flying) == (1, 2, 1)
    offered = 2
    for _ in range(20):  # until the class's own objective refuses: capacity, counted
        offered += 1
        if isinstance(refused := q.offer(Ticket("chat", now), now), Rejected):
            break
    assert isinstance(refused, Rejected) and refused.reason is RejectReason.OVER_OBJECTIVE
    assert q.demand._arrivals == arrivals + offered


def test_a_burst_onto_a_fresh_gateway_is_queued() -> None:
    ups = pool(1)
    q = AdmissionQueue(ups, OBJ, max_queue=64)
    q.offer(Ticket("chat", 0.0), 0.0)
    assert [q.offer(Ticket("chat", 0.0), 0.0) for _ in range(3)] == [
        Queued(0), Queued(1), Queued(2)]


def test_before_an_answer_ends_the_time_without_one_is_the_prediction() -> None:
    # 4 slots taken at 0, and no answer has ended: each slot is guessed to free once per
    # the oldest's age. At 0.1 that is 0.025 s a slot: 3 queued within the 0.5 s budget
    # (a quarter of 2 s). At 2 s, the fourth would wait (3 + 1) x 2 / 4 = 2 s: refused at
    # once, where before a rate was measured it was queued until its objective passed.
    ups = pool(4)
    q = AdmissionQueue(ups, OBJ2, max_queue=64)
    for _ in range(4):
        q.offer(Ticket("default", 0.0), 0.0)
    assert [q.offer(Ticket("default", 0.1), 0.1) for _ in range(3)] == [
        Queued(0), Queued(1), Queued(2)]
    late = q.offer(Ticket("default", 2.0), 2.0)
    assert isinstance(late, Rejected) and late.reason is RejectReason.OVER_OBJECTIVE
    assert "~2.0s predicted" in late.message
    assert q.completion_rate == 0.0  # the measured rate is not touched


def test_a_request_past_its_objective_is_never_dispatched() -> None:
    # engine TTFT 0.5 s: a request queued at t must be sent by t + 1.5 or not at all
    ups = pool(1)
    q = AdmissionQueue(ups, OBJ, max_queue=64)
    q.note_ttft(0.5)
    first = Ticket("chat", 0.0)
    q.offer(first, 0.0)
    late, early = Ticket("chat", 0.0), Ticket("chat", 0.1)
    q.offer(late, 0.0)
    q.offer(early, 0.1)
    assert (late.deadline, early.deadline) == (1.5, 1.6)
    assert q.release(first, 1.55) == [early]  # the slot skips the one past its deadline
    assert q.expire(1.55) == [late]  # which is answered now (503), never sent on
    assert q.timeout_rejection(late).reason is RejectReason.QUEUE_TIMEOUT
    assert "objective" in q.timeout_rejection(late).message


def test_a_tighter_objective_behind_expires_first() -> None:
    ups = pool(1)
    q = AdmissionQueue(ups, OBJ, max_queue=64)
    q.offer(Ticket("chat", 0.0), 0.0)
    loose, tight = Ticket("chat", 0.0), Ticket("chat", 0.0, ttft_objective=0.5)
    q.offer(loose, 0.0)
    q.offer(tight, 0.0)
    assert q.expire(0.6) == [tight]
    assert q.depth() == 1


def test_a_request_the_engine_refused_waits_again_at_the_head_of_its_queue() -> None:
    # engine TTFT 0.5 s, objective 2 s: a request that arrived at 0 must be sent by 1.5
    ups = pool(2)
    q = AdmissionQueue(ups, OBJ, max_queue=64)
    q.note_ttft(0.5)
    refused, other = Ticket("chat", 0.0, tokens=30), Ticket("chat", 0.0)
    assert q.offer(refused, 0.0) == Admitted(ups[0])
    assert q.offer(other, 0.0) == Admitted(ups[0])
    behind = Ticket("chat", 0.2)
    assert q.offer(behind, 0.2) == Queued(0)
    assert q.requeue(refused, 0.3)  # the engine's valve refused it
    assert (ups[0].inflight, ups[0].inflight_tokens, ups[0].refusing) == (1, 0, True)
    assert (refused.upstream, refused.dispatched_at) == (None, None)
    assert (refused.due, refused.deadline) == (1.5, 1.5)  # as if queued on arrival
    assert q.pump(0.3) == []  # the refusing engine has no room, though under its limit
    assert q.expire(0.4) == []  # nor at a tick while a request of ours is in it
    assert q.completion_rate == 0.0  # nothing was served
    assert q.release(other, 0.5) == [refused, behind]  # one ended: it goes first
    assert (refused.upstream, refused.dispatched_at, ups[0].refusing) == (ups[0], 0.5, False)


def test_a_refusal_stands_past_the_objective_and_an_idle_refuser_is_retried_a_tick_on() -> None:
    ups = pool(1)
    q = AdmissionQueue(ups, OBJ, max_queue=64)
    q.note_ttft(0.5)
    t = Ticket("chat", 0.0)
    q.offer(t, 0.0)
    assert not q.requeue(t, 1.5)  # a first token can no longer come within 2 s
    assert (t.upstream, ups[0].inflight, ups[0].refusing) == (ups[0], 1, False)
    assert q.requeue(t, 1.0)
    assert ups[0].inflight == 0 and q.pump(1.0) == []  # filled by others, not by us
    assert q.expire(1.1) == [] and not ups[0].refusing  # the tick lets it be tried again
    assert q.pump(1.1) == [t]


def test_a_standing_queue_answers_heads_over_target_instead_of_dispatching_them() -> None:
    # objective 8 s, budget a quarter: heads should wait at most 2 s (the target). The one
    # slot is held throughout; a request arrives each second and the tick pumps each second.
    ups = pool(1)
    q = AdmissionQueue(ups, {"c": ClassPolicy("c", ttft_objective=8.0)}, max_queue=64)
    warm_rate(q, 10.0, 20, start=-2.0)  # a rate before: the prediction (wrong here) admits all
    q.offer(Ticket("c", 0.0), 0.0)  # holds the slot
    tickets, late = [], []
    for t in range(11):
        tickets.append(Ticket("c", float(t)))
        assert isinstance(q.offer(tickets[-1], float(t)), Queued)
        assert q.pump(float(t)) == []
        late.append(q.take_late())
    # at 2 the head had waited 2 s, the target, for the last time; from 8 on each head
    # leaves at its objective (due at arrival + 8), one a second, as without the net
    assert late[:8] == [[]] * 8 and [x for t in late[8:] for x in t] == tickets[:3]
    # at 10.5 every head has waited over target for 8.5 s (> 4 targets): the queue stands,
    # and every head over target is answered now, 0.5-5.5 s before its objective
    assert q.pump(10.5) == []
    assert q.take_late() == tickets[3:9]
    assert q.depth() == 2  # those that waited no more than the target stay
    assert q.pump(11.0) == [] and q.take_late() == []  # no longer standing


# --- the controller's lifecycle: the queue makes every call (issue 13) -------------------


class Recorder(Fixed):
    """A fixed limit that writes down every call, with the slots in flight at that moment."""

    def __init__(self, limit: int, up: list[UpstreamState]) -> None:
        super().__init__(FixedConfig(initial=limit))
        self.up = up
        self.calls: list[tuple[object, ...]] = []
        self.fail: set[str] = set()

    def _note(self, *call: object) -> None:
        self.calls.append((*call, self.up[0].inflight))
        if call[0] in self.fail:
            raise RuntimeError(f"broken {call[0]}")

    def on_arrival(self, prompt_tokens: int) -> None:
        self._note("on_arrival", prompt_tokens)

    def on_admit(self, prompt_tokens: int) -> None:
        self._note("on_admit", prompt_tokens)

    def on_sample(self, sample: Sample) -> None:
        self._note("on_sample", sample.outcome)

    def on_tick(self, now: float, inflight: int) -> None:
        self._note("on_tick", now)

    def on_engine_stats(self, stats: EngineStats) -> None:
        self._note("on_engine_stats", stats.running)


def _recorded(limit: int = 1
              ) -> tuple[AdmissionQueue, UpstreamState, Recorder, list[tuple[str, str, str]]]:
    box: list[UpstreamState] = []
    ctl = Recorder(limit, box)
    up = UpstreamState("u0", ctl)
    box.append(up)
    errors: list[tuple[str, str, str]] = []
    q = AdmissionQueue([up], CLASSES, max_queue=4,
                       on_error=lambda u, hook, exc: errors.append((u.name, hook, str(exc))))
    return q, up, ctl, errors



def test_the_queue_makes_every_controller_call_in_its_order() -> None:
    q, up, ctl, errors = _recorded()
    first, second = Ticket("lo", 0.0, tokens=30), Ticket("lo", 0.5, tokens=40)
    q.offer(first, 0.0)
    q.offer(second, 0.5)
    assert ctl.calls == [("on_arrival", 30, 0), ("on_admit", 30, 1),  # dispatched at once
                         ("on_arrival", 40, 1)]  # queued: no admission yet
    ctl.calls.clear()
    assert q.release(first, 1.0, make_sample()) == [second]
    # the slot is free before the sample is fed, and the next is admitted after it
    assert ctl.calls == [("on_sample", Outcome.OK, 0), ("on_admit", 40, 1)]
    assert q.engine_ttft == 0.2  # a first token: the engine's part of a predicted wait
    ctl.calls.clear()
    q.engine_stats(up, EngineStats(1.0, 3, 0, 0.1, 0, 100))
    assert q.tick(1.5) == ([], [])
    assert q.release(second, 2.0, make_sample(outcome=Outcome.CLIENT_CANCELLED)) == []
    assert ctl.calls == [("on_engine_stats", 3, 1), ("on_tick", 1.5, 1)]  # a client's: none
    assert errors == []


def test_a_controller_that_raises_costs_its_update_never_a_slot() -> None:
    q, up, ctl, errors = _recorded()
    ctl.fail = {"on_arrival", "on_admit", "on_sample", "on_tick", "on_engine_stats"}
    t = Ticket("lo", 0.0)
    assert q.offer(t, 0.0) == Admitted(up)  # admitted, though both of its calls raised
    q.offer(Ticket("lo", 0.1), 0.1)
    assert len(q.release(t, 1.0, make_sample())) == 1  # freed and the next dispatched
    q.tick(1.5)
    q.engine_stats(up, EngineStats(1.0, 3, 0, 0.1, 0, 100))
    assert [e[1] for e in errors] == ["on_arrival", "on_admit", "on_arrival", "on_sample",
                                      "on_admit", "on_tick", "on_engine_stats"]
    assert up.inflight == 1
    q.on_error = None  # without a handler, a bug is not hidden
    with pytest.raises(RuntimeError, match="broken on_tick"):
        q.tick(2.0)


# -- the engine's prefill backlog -------------------------------------------------------------

OBJ2 = {"default": ClassPolicy("default", ttft_objective=2.0)}  # budget 0.25: a 0.5 s horizon


def streamed(at: float) -> Ticket:
    return Ticket("default", at, streamed=True)


def on_line(backlog: int) -> float:
    """The TTFT of a request that found `backlog` ahead, on an engine whose 128-token
    prefills queue: 0.1 s, and 0.12 s for each prompt ahead (vLLM's CPU build)."""
    return 0.1 + 0.12 * backlog


def test_the_line_allows_the_backlog_whose_ttft_stays_within_the_horizon() -> None:
    line = PrefillLine()
    for b in range(7):
        line.note(b, on_line(b))
    assert line.cap(0.5) == 0  # 7 first tokens: not yet
    for b in range(7, 10):
        line.note(b, on_line(b))
    assert line.cap(0.5) == 4  # 0.1 + 0.12 x 3 <= 0.5 < 0.1 + 0.12 x 4
    assert line.cap(2.0) == 16
    assert line.cap(0.05) == 1  # even its base is over: one at a time


def test_no_cap_where_the_ttft_does_not_grow_with_the_backlog_or_the_backlog_never_varied() -> None:
    flat, still = PrefillLine(), PrefillLine()
    for b in range(32):
        flat.note(b, 0.05)  # a GPU prefills the batch in one step
        still.note(0, 0.3)
    assert flat.cap(0.5) == 0 and still.cap(0.5) == 0


def test_an_upstream_takes_no_more_than_the_line_allows_awaiting_a_first_token() -> None:
    up = pool(20)[0]
    q = AdmissionQueue([up], OBJ2, max_queue=8)
    wave = [streamed(0.0) for _ in range(10)]
    assert all(isinstance(q.offer(t, 0.0), Admitted) for t in wave)  # nothing measured: no cap
    assert [t.backlog_at_dispatch for t in wave] == list(range(10))
    for t in wave[:8]:
        assert q.first_token(t, on_line(t.backlog_at_dispatch)) == []
    assert up.prefill_cap == 4 and up.prefilling == 2
    now = on_line(7)
    more = [streamed(now) for _ in range(3)]
    assert [type(q.offer(t, now)) for t in more] == [Admitted, Admitted, Queued]
    assert up.prefilling == 4  # the cap, with 10 of the limit's 20 slots free
    assert q.first_token(wave[8], on_line(8)) == [more[2]]  # 3 await: the queue's head goes
    assert up.prefilling == 4 and more[2].backlog_at_dispatch == 3


def test_the_cap_never_keeps_the_limit_unfilled() -> None:
    """Where the TTFT is long for another reason (a full KV cache), the line's base alone
    is over the horizon; the cap stays at what frees while one request awaits its first
    token: limit 20 x TTFT 1 s / a 4 s answer = 5."""
    up = pool(20)[0]
    q = AdmissionQueue([up], OBJ2, max_queue=8)
    done = [streamed(0.0) for _ in range(4)]
    for t in done:
        q.offer(t, 0.0)
        q.first_token(t, 1.0)
        q.release(t, 4.0, make_sample(duration=4.0, ttft=1.0))
    wave = [streamed(4.0) for _ in range(10)]
    for t in wave:
        q.offer(t, 4.0)
    for t in wave[:8]:
        q.first_token(t, 4.0 + 1.0 + 0.01 * t.backlog_at_dispatch)
    assert up.prefill_line.cap(0.5) == 1
    assert up.prefill_cap == 5


def test_without_an_excess_a_request_held_back_only_by_the_prefill_backlog_is_queued() -> None:
    """One long prompt prefills on an engine with free slots and a cap of 1 awaiting a
    first token; answers end slowly (4 s each). Where arrivals outnumber completions, the
    predicted wait refuses the next arrivals; where they do not, they wait here for the
    prefill ahead, as they would have in the engine's own queue."""
    for excess in (False, True):
        up = pool(8)[0]
        q = AdmissionQueue([up], OBJ2, max_queue=8)
        now = warm_rate(q, 0.25, offered=1)
        q.note_ttft(1.0)
        if excess:
            overloaded(q, now)
        long = streamed(now)
        assert isinstance(q.offer(long, now), Admitted)
        up.prefill_cap = 1  # as `first_token` sets it from the line
        now += 2.5  # the long prompt still has no first token
        waiting = [streamed(now) for _ in range(3)]
        decisions = [q.offer(t, now) for t in waiting]
        if excess:
            assert all(isinstance(d, Rejected) for d in decisions)
            assert decisions[0].reason is RejectReason.OVER_OBJECTIVE  # type: ignore[union-attr]
        else:
            assert decisions == [Queued(0), Queued(1), Queued(2)]
            # its first token: the line, not yet warm, sets no cap, and the queue goes
            assert q.first_token(long, now + 0.1) == waiting


def test_a_request_that_ends_before_its_first_token_leaves_the_backlog_once() -> None:
    up = pool(4)[0]
    q = AdmissionQueue([up], OBJ2, max_queue=8)
    t, plain = streamed(0.0), Ticket("default", 0.0)  # `plain`: not streamed, never counted
    q.offer(t, 0.0)
    q.offer(plain, 0.0)
    assert up.prefilling == 1 and not plain.awaiting_first
    q.release(t, 1.0, make_sample(outcome=Outcome.UPSTREAM_ERROR, ttft=None))
    assert up.prefilling == 0 and not t.awaiting_first
    assert q.first_token(t, 1.1) == [] and up.prefilling == 0  # too late: nothing counted
    assert up.prefill_line.count == 0


def test_without_a_finite_objective_nothing_caps_the_backlog() -> None:
    up = pool(20)[0]
    q = AdmissionQueue([up], {"default": ClassPolicy("default")}, max_queue=8)
    wave = [streamed(0.0) for _ in range(10)]
    for t in wave:
        q.offer(t, 0.0)
    for t in wave[:9]:
        q.first_token(t, on_line(t.backlog_at_dispatch))
    assert up.prefill_cap == 0
    assert isinstance(q.offer(streamed(2.0), 2.0), Admitted)
