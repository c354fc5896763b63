"""Fair shares between tenants: the counter rules on the pure queue, in exact numbers, and
VTC's bound as a property over random traffic."""

from __future__ import annotations

import pytest
from helpers.controllers import make_sample
from helpers.gateway import overloaded, warm_rate
from hypothesis import given, settings
from hypothesis import strategies as st

from kneegate.admission.fairness import FairQueue
from kneegate.admission.ledger import OUTPUT_WEIGHT, Ledger
from kneegate.admission.queue import AdmissionQueue
from kneegate.admission.types import (
    Admitted,
    ClassPolicy,
    Queued,
    Rejected,
    RejectReason,
    TenantPolicy,
    Ticket,
    UpstreamState,
)
from kneegate.controllers.registry import build_controller

A, B, C = TenantPolicy("a"), TenantPolicy("b"), TenantPolicy("c")


def ticket(tenant: TenantPolicy, at: float = 0.0, tokens: int = 10, cls: str = "c") -> Ticket:
    return Ticket(cls, at, tokens=tokens, tenant=tenant)


def serve(q: FairQueue) -> Ticket:
    """Dispatch the head, as the admission queue does."""
    t = q.head()
    assert t is not None
    q.remove(t)
    q.dispatched(t)
    return t


def test_the_least_served_tenants_head_goes_first_and_fifo_within_a_tenant() -> None:
    q = FairQueue()
    a1, a2, b1, b2, b3 = (ticket(A, 0.0), ticket(A, 0.1), ticket(B, 0.2), ticket(B, 0.3),
                          ticket(B, 0.4))
    for t in (a1, a2, b1, b2, b3):
        q.append(t)
    assert serve(q) is a1  # a tie at 0: the tenant with less queued
    assert q.counter("a") == 10.0  # its prompt estimate, weight 1
    assert serve(q) is b1  # b (0) is now less served than a (10)
    assert serve(q) is a2  # a tie at 10, one queued each: the head that came first
    assert [serve(q), serve(q)] == [b2, b3]
    assert q.head() is None and len(q) == 0


def test_output_is_charged_twice_a_prompt_token_and_divided_by_the_weight() -> None:
    q = FairQueue()
    heavy = TenantPolicy("h", weight=2.0)
    t = ticket(heavy, tokens=30)
    q.append(t)
    serve(q)
    assert q.counter("h") == 15.0  # 30 prompt tokens / weight 2
    q.charge_output(t, 5)  # streamed so far
    assert q.counter("h") == 15.0 + OUTPUT_WEIGHT * 5 / 2 == 20.0
    q.released(t, 8)  # 8 in all: the 3 not yet charged, now
    assert q.counter("h") == 15.0 + OUTPUT_WEIGHT * 8 / 2 == 23.0
    assert t.charged == 23.0


def test_a_weight_of_two_gets_two_requests_for_one() -> None:
    q = FairQueue()
    gold = TenantPolicy("gold", weight=2.0)
    for i in range(6):
        q.append(ticket(gold, i / 10))
        q.append(ticket(A, i / 10))
    served = [serve(q).tenant.name for _ in range(9)]
    assert (served.count("gold"), served.count("a")) == (6, 3)
    assert (q.counter("gold"), q.counter("a")) == (30.0, 30.0)  # 60 / 2 and 30 / 1


def test_an_arrival_is_lifted_to_the_least_backlogged_counter_so_idle_time_is_not_banked() -> None:
    q = FairQueue()
    for i in range(5):
        q.append(ticket(A, i))
        q.append(ticket(B, i))
    assert [serve(q).tenant.name for _ in range(3)] == ["a", "b", "a"]
    assert (q.counter("a"), q.counter("b")) == (20.0, 10.0)
    late = ticket(C, 5.0)
    q.append(late)
    assert q.counter("c") == 10.0  # not 0: it gets no credit for the time it sent nothing
    assert serve(q) is late  # tied with b, and less queued
    assert serve(q).tenant.name == "b"


def test_a_refused_request_is_refunded_and_an_idle_tenant_at_the_floor_forgotten() -> None:
    q = FairQueue()
    t = ticket(A, tokens=40)
    q.append(t)
    serve(q)
    q.charge_output(t, 3)
    assert q.counter("a") == 46.0 and q.held("a") == 1
    q.refund(t)  # the engine refused it unstarted
    assert (t.charged, t.output_charged) == (0.0, 0)
    assert q.counter("a") is None and q.held("a") == 0  # back to the floor, 0: forgotten


def test_an_idle_tenant_keeps_its_debt_and_the_remembered_debts_are_bounded() -> None:
    q = FairQueue()
    q.ledger.IDLE_MAX = 2
    done = []
    for name in ("x", "y", "z"):
        t = ticket(TenantPolicy(name), tokens=50)
        q.append(t)
        serve(q)
        done.append(t)
    for t in done:
        q.released(t, 0)
    assert q.ledger.floor == 0.0  # each was dispatched at 0, alone
    # each owes 50 over the floor; two debts are remembered, x's (the oldest) forgotten
    assert [q.counter(n) for n in ("x", "y", "z")] == [None, 50.0, 50.0]
    back = ticket(TenantPolicy("y"))
    q.append(back)
    assert q.counter("y") == 50.0  # its debt came back with it


def test_the_victim_is_the_newest_request_of_the_tenant_furthest_over_its_share() -> None:
    q = FairQueue()
    heavy = [ticket(A, i / 10) for i in range(4)]
    for t in heavy:
        q.append(t)
    q.append(ticket(B, 0.5))
    assert q.victim(ticket(B, 0.6)) is heavy[-1]  # a's queue ends at 40, b's at 20
    arrival = ticket(A, 0.7)
    assert q.victim(arrival) is arrival  # its own tenant is the one over its share


def test_the_fair_position_counts_only_what_comes_before_it() -> None:
    q = FairQueue()
    for i in range(6):
        q.append(ticket(A, i / 10))
    assert q.position(ticket(B, 1.0)) == 0  # a tie at 0 that b wins: less queued
    assert q.position(ticket(A, 1.0)) == 6  # behind its own six


CLASSES = {"c": ClassPolicy("c", ttft_objective=2.0)}


def one_slot() -> tuple[AdmissionQueue, UpstreamState]:
    up = UpstreamState("u", build_controller("fixed", {"initial": 1}))
    q = AdmissionQueue([up], CLASSES, max_queue=4)
    warm_rate(q, 20.0, 20, start=-2.0)  # a rate before: every wait below is predicted short
    return q, up


def test_a_light_tenant_waits_for_a_slot_not_for_the_heavy_queue() -> None:
    q, up = one_slot()
    first = ticket(A, 0.0)
    assert q.offer(first, 0.0) == Admitted(up)  # a's counter: 10, its prompt
    heavy = [ticket(A, 0.1 * i) for i in range(1, 4)]
    assert [q.offer(t, t.arrived_at) for t in heavy] == [Queued(0), Queued(1), Queued(2)]
    light = ticket(B, 0.5)
    # lifted to a's 10 on arrival, a tie it wins (less queued): none ahead, not three
    assert q.offer(light, 0.5) == Queued(0)
    # (and the first request's 5 output tokens charge a 10 more: b is the less served)
    assert q.release(first, 1.0, make_sample(output_tokens=5)) == [light]
    assert q.release(light, 2.0, make_sample(output_tokens=5)) == [heavy[0]]


def test_a_full_queue_sheds_the_heavy_tenants_newest_not_the_light_arrival() -> None:
    q, _ = one_slot()
    q.offer(ticket(A, 0.0), 0.0)
    heavy = [ticket(A, 0.1 * i) for i in range(1, 5)]
    for t in heavy:
        q.offer(t, t.arrived_at)
    assert q.depth() == 4  # max_queue
    light = ticket(B, 1.0)
    verdict = q.offer(light, 1.0)
    assert isinstance(verdict, Queued) and verdict.evicted is not None
    victim, answer = verdict.evicted
    assert victim is heavy[-1] and answer.reason is RejectReason.QUEUE_FULL
    assert q.depth() == 4 and q.withdraw(victim) is False
    again = q.offer(ticket(A, 1.1), 1.1)  # the heavy tenant's own arrival: refused itself
    assert isinstance(again, Rejected) and again.reason is RejectReason.QUEUE_FULL


def test_over_the_objective_the_heavy_tenants_newest_is_told_at_once() -> None:
    up = UpstreamState("u", build_controller("fixed", {"initial": 1}))
    policy = ClassPolicy("c", ttft_objective=1.5, queue_budget=0.9)
    q = AdmissionQueue([up], {"c": policy}, max_queue=64)
    held = ticket(A, 0.0)
    q.offer(held, 0.0)
    for i in range(1, 5):  # a completion every 0.25 s, each first token 0.5 s after dispatch
        q.release(held, 0.25 * i, make_sample(duration=0.25, ttft=0.5, output_tokens=5))
        held = ticket(A, 0.25 * i)
        assert isinstance(q.offer(held, 0.25 * i), Admitted)
    assert q.completion_rate == pytest.approx(4.0) and q.engine_ttft == 0.5
    overloaded(q, 1.1)
    # a queued request may wait 0.9 x (1.5 - 0.5) = 0.9 s: at 4 a second, 3 of them
    heavy = [ticket(A, 1.1) for _ in range(3)]
    assert [q.offer(t, 1.1) for t in heavy] == [Queued(0), Queued(1), Queued(2)]
    fourth = q.offer(ticket(A, 1.1), 1.1)  # a's own: 1.0 s predicted, refused itself
    assert isinstance(fourth, Rejected) and fourth.reason is RejectReason.OVER_OBJECTIVE
    light = ticket(B, 1.2)
    verdict = q.offer(light, 1.2)  # its place is first (0.25 s); a's last would be late
    assert isinstance(verdict, Queued) and verdict.position == 0
    assert verdict.evicted is not None
    victim, answer = verdict.evicted
    assert victim is heavy[-1] and answer.reason is RejectReason.OVER_OBJECTIVE
    assert answer.retry_after == 1 and q.depth() == 3


def test_a_tenant_under_its_share_may_wait_its_objective_where_one_over_it_is_refused() -> None:
    """The queue's budget rations the excess of tenants over their share of the slots: a,
    alone and holding both, is refused a predicted wait over the budget; b, holding none,
    is queued for the same wait, which its objective allows."""
    up = UpstreamState("u", build_controller("fixed", {"initial": 2}))
    policy = ClassPolicy("c", ttft_objective=1.5, queue_budget=0.25)
    q = AdmissionQueue([up], {"c": policy}, max_queue=64)
    flying = [ticket(A, 0.0)]
    assert isinstance(q.offer(flying[0], 0.0), Admitted)
    flying.append(ticket(A, 0.5))
    assert isinstance(q.offer(flying[1], 0.5), Admitted)
    for i in range(2, 6):  # each lasts 1 s: one ends every 0.5 s, and another takes its slot
        now = 0.5 * i
        q.release(flying.pop(0), now, make_sample(duration=1.0, ttft=0.5, output_tokens=5))
        flying.append(ticket(A, now))
        assert isinstance(q.offer(flying[-1], now), Admitted)
    assert 1.5 < q.completion_rate <= 2.0 and q.engine_ttft == 0.5
    overloaded(q, 2.6)  # an excess: the budget rations it
    # the next slot frees in ~0.5-0.6 s: over the budget, 0.25 x (1.5 - 0.5), within 1.5 - 0.5
    over = q.offer(ticket(A, 2.6), 2.6)
    assert isinstance(over, Rejected) and over.reason is RejectReason.OVER_OBJECTIVE
    under = q.offer(ticket(B, 2.6), 2.6)
    assert isinstance(under, Queued) and under.position == 0 and under.evicted is None
    again = q.offer(ticket(A, 2.7), 2.7)  # a still holds both slots, over its share of one
    assert isinstance(again, Rejected) and again.reason is RejectReason.OVER_OBJECTIVE


def test_a_tenant_at_its_in_flight_cap_is_refused_with_its_own_reason() -> None:
    up = UpstreamState("u", build_controller("fixed", {"initial": 4}))
    q = AdmissionQueue([up], CLASSES, max_queue=4)
    capped = TenantPolicy("capped", max_inflight=2, label="capped")
    assert isinstance(q.offer(ticket(capped), 0.0), Admitted)
    assert isinstance(q.offer(ticket(capped), 0.0), Admitted)
    third = q.offer(ticket(capped), 0.0)
    assert isinstance(third, Rejected) and third.reason is RejectReason.TENANT_QUOTA
    assert "'capped'" in third.message and "2 requests in flight" in third.message
    assert isinstance(q.offer(ticket(A), 0.0), Admitted)  # others are not held to it


def test_a_tenants_tokens_a_minute_are_a_bucket_refilled_continuously() -> None:
    up = UpstreamState("u", build_controller("fixed", {"initial": 8}))
    q = AdmissionQueue([up], CLASSES, max_queue=4)
    metered = TenantPolicy("m", tokens_per_minute=600.0, label="m")  # 10 tokens a second
    t = ticket(metered, tokens=400)
    assert isinstance(q.offer(t, 0.0), Admitted)
    q.release(t, 1.0, make_sample(output_tokens=250))  # 650 drawn, 10 refilled: -40
    refused = q.offer(ticket(metered), 1.0)
    assert isinstance(refused, Rejected) and refused.reason is RejectReason.TENANT_QUOTA
    assert refused.retry_after == 4  # 40 tokens at 10 a second
    assert isinstance(q.offer(ticket(metered), 5.1), Admitted)


def test_jains_index_reads_the_service_between_two_readings() -> None:
    q = FairQueue()
    for i in range(4):
        q.append(ticket(A, i))
        q.append(ticket(B, i))
    assert q.jain() is None  # the first reading only sets the marks
    serve(q), serve(q)  # a and b: 10 each
    assert q.jain() == 1.0
    t = serve(q)  # a: 10 more, then b is served nothing
    q.charge_output(t, 45)  # 90 more
    assert q.jain() == pytest.approx(100**2 / (2 * 100**2))  # 0.5: one took it all


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(1, 50), st.integers(0, 40)),
                min_size=20, max_size=200),
       st.integers(1, 6))
def test_two_backlogged_tenants_stay_within_the_bound(
        traffic: list[tuple[int, int, int]], limit: int) -> None:
    """VTC's bound as this queue keeps it: while tenants a and b stay backlogged, their
    counters differ by at most the largest prompt charge plus `limit` x the largest output
    charge (the requests in flight, whose output is charged as it streams)."""
    q = FairQueue()
    tenants = [A, B, C]
    prompt_max, output_max = 50, OUTPUT_WEIGHT * 40
    for i in range(40):  # a and b stay backlogged throughout: 40 requests each, queued first
        q.append(ticket(A, i, tokens=1 + (7 * i) % 50))
        q.append(ticket(B, i, tokens=1 + (11 * i) % 50))
    inflight: list[tuple[Ticket, int]] = []
    for who, prompt, out in traffic:
        q.append(ticket(tenants[who], 100.0, tokens=prompt))  # c comes and goes; a, b more
        while len(inflight) < limit and q:
            inflight.append((serve(q), out))
        t, total = inflight.pop(0)  # one ends: its output streams, then it is released
        q.charge_output(t, total // 2)
        q.released(t, total)
        if q.queued("a") == 0 or q.queued("b") == 0:
            break  # a or b no longer backlogged: the bound holds while both are
        ca, cb = q.counter("a"), q.counter("b")
        assert ca is not None and cb is not None
        assert abs(ca - cb) <= prompt_max + limit * output_max


def test_a_tenant_with_answers_still_streaming_comes_back_ahead_a_new_key_does_not() -> None:
    q = FairQueue()  # CREDIT 3: up to three of its requests short of the least served
    for i in range(4):
        q.append(ticket(A, i, tokens=100))
    streaming = ticket(B)
    q.append(streaming)
    assert serve(q) is streaming  # b: 10, in flight
    serve(q)  # a: 100
    newcomer, back = ticket(C, 5.0), ticket(B, 5.1)
    q.append(newcomer)
    q.append(back)
    # the least backlogged is a at 100: c, a key never seen, starts there (no credit it has
    # not earned); b at max(10, 100 - 3 x 10) = 70
    assert (q.counter("b"), q.counter("c")) == (70.0, 100.0)
    assert serve(q) is back and serve(q) is newcomer  # then c and a tie: c has less queued


# --- tenants that can be minted: the pool ------------------------------------------------

POOL = Ledger.POOL.name


def minted(i: int) -> TenantPolicy:
    return TenantPolicy(f"key-{i:012x}", unlisted=True)


def test_keys_minted_per_request_share_one_pool_and_get_one_share_between_them() -> None:
    q = FairQueue()
    for i in range(6):
        q.append(ticket(A, i))
        q.append(ticket(minted(i), i + 0.5))
    assert q.tenants == 2  # a, and the pool of the six keys never served
    served = ["pool" if t.pooled else t.tenant.name for t in (serve(q) for _ in range(6))]
    assert served == ["a", "pool"] * 3
    assert q.counter(POOL) == q.counter("a") == 30.0


def test_a_configured_tenant_never_pools() -> None:
    q = FairQueue()
    q.append(ticket(TenantPolicy("paid")))
    q.append(ticket(minted(1)))
    assert q.queued("paid") == 1 and q.queued(POOL) == 1


def test_a_served_key_has_its_own_turn_from_where_the_pool_left_it() -> None:
    q = FairQueue()
    first = ticket(minted(1), tokens=20)
    q.dispatched(first, queued=False)  # straight through an empty queue, from the pool
    assert first.pooled and q.counter(POOL) == 20.0
    q.charge_output(first, 5)  # its answer streams: the pool pays, the key carries the bill
    for i in range(3):
        q.append(ticket(A, 1.0 + i))
    again = ticket(minted(1), 2.0)
    q.append(again)
    assert not again.pooled and q.counter("key-000000000001") == 30.0  # 20 + 2 x 5
    q.append(ticket(minted(2), 3.0))  # a key never served: pooled
    assert q.queued(POOL) == 1 and q.queued("key-000000000001") == 1


def test_a_refunded_pooled_request_leaves_its_key_unproven() -> None:
    q = FairQueue()
    t = ticket(minted(1))
    q.dispatched(t, queued=False)
    q.refund(t)  # its engine refused it unstarted: the key was never served
    again = ticket(minted(1), 1.0)
    q.append(again)
    assert again.pooled


def test_the_served_keys_remembered_are_bounded_least_recently_seen_forgotten() -> None:
    q = FairQueue()
    q.ledger.GRADUATED_MAX = 2
    for i in (1, 2):
        t = ticket(minted(i))
        q.dispatched(t, queued=False)
        q.released(t, 0)
    q.append(ticket(minted(1), 1.0))  # key 1 seen again: key 2 is now the least recent
    t3 = ticket(minted(3))
    q.dispatched(t3, queued=False)  # served: remembered, key 2 forgotten
    assert t3.pooled and len(q.ledger._graduated) == 2
    assert not ticket_pooled(q, minted(1)) and ticket_pooled(q, minted(2))


def ticket_pooled(q: FairQueue, tenant: TenantPolicy) -> bool:
    """Would a request of `tenant` be pooled now? (queued, then withdrawn)"""
    t = ticket(tenant, 9.0)
    q.append(t)
    q.remove(t)
    return t.pooled


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 50), st.integers(0, 40)),
                min_size=20, max_size=300),
       st.integers(1, 6))
def test_minted_keys_get_one_share_and_bounded_memory_whatever_their_number(
        traffic: list[tuple[bool, int, int]], limit: int) -> None:
    """A tenant that stays backlogged and a stream of keys each used once: the keys, pooled,
    stay within VTC's bound of it as one tenant would, and what the queue keeps is bounded
    by what is queued or in flight and `GRADUATED_MAX`, however many keys there were."""
    q = FairQueue()
    q.ledger.GRADUATED_MAX = 8
    for i in range(40):
        q.append(ticket(A, i, tokens=1 + (7 * i) % 50))
        q.append(ticket(minted(1000 + i), i, tokens=1 + (11 * i) % 50))
    inflight: list[tuple[Ticket, int]] = []
    for n, (mint, prompt, out) in enumerate(traffic):
        q.append(ticket(minted(n) if mint else A, 100.0, tokens=prompt))
        while len(inflight) < limit and q:
            inflight.append((serve(q), out))
        t, total = inflight.pop(0)
        q.charge_output(t, total // 2)
        q.released(t, total)
        assert len(q.ledger._graduated) <= 8 and len(q.ledger._accounts) <= 2 + limit
        if q.queued("a") == 0 or q.queued(POOL) == 0:
            break
        ca, cp = q.counter("a"), q.counter(POOL)
        assert ca is not None and cp is not None
        assert abs(ca - cp) <= 50 + limit * OUTPUT_WEIGHT * 40
