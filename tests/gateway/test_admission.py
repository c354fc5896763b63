"""The pure admission queue: literal steps in, exact decisions out (no asyncio, no clock)."""

from __future__ import annotations

from controllers.registry import build_controller
from gateway.admission import (
    AdmissionQueue,
    Admitted,
    ClassPolicy,
    Queued,
    Rejected,
    RejectReason,
    Ticket,
    UpstreamState,
)


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
    q.offer(Ticket("lo", 0.0), 0.0)
    lo, hi1, hi2 = Ticket("lo", 1.0), Ticket("hi", 2.0), Ticket("hi", 3.0)
    assert q.offer(lo, 1.0) == Queued(0)
    assert q.offer(hi1, 2.0) == Queued(0)  # nothing of its rank or higher waits
    assert q.offer(hi2, 3.0) == Queued(1)
    third = q.offer(Ticket("hi", 4.0), 4.0)  # hi may fill half of 4
    assert isinstance(third, Rejected) and third.reason is RejectReason.QUEUE_FULL
    assert q.release(ups[0], 5.0) == [hi1]
    assert q.release(ups[0], 6.0) == [hi2]
    assert q.release(ups[0], 7.0) == [lo]


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
    q.offer(Ticket("lo", 0.0), 0.0)
    old = Ticket("lo", 0.0)
    q.offer(old, 0.0)
    q.reconfigure({"new": ClassPolicy("new", priority=-5)}, 4, ups)
    newer = Ticket("new", 1.0)
    assert q.offer(newer, 1.0) == Queued(0)  # the removed class ranks below every class
    assert q.release(ups[0], 2.0) == [newer]
    assert q.release(ups[0], 3.0) == [old]
