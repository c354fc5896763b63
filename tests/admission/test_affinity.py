"""Prefix affinity: a prompt goes back to the engine that served its beginning, while it
has room."""

from __future__ import annotations

import pytest

from kneegate.admission.affinity import PrefixMap
from kneegate.admission.queue import AdmissionQueue
from kneegate.admission.types import AFFINITY_SLACK, Admitted, ClassPolicy, Ticket, UpstreamState
from kneegate.controllers.registry import build_controller

CLASSES = {"default": ClassPolicy("default", priority=0, max_wait=5.0)}


def test_the_longest_known_prefix_names_the_engine() -> None:
    m = PrefixMap()
    m.record((1, 2), "a")  # turn 1 of a conversation: two messages
    m.record((1, 2, 3, 4), "b")  # turn 2, elsewhere
    assert m.lookup((1, 2, 3, 4, 5, 6)) == "b"  # turn 3 begins with turn 2's whole prompt
    assert m.lookup((1, 2, 9)) == "a"
    assert m.lookup((1,)) is None  # a shared first message alone is no entry
    assert m.lookup(()) is None


def test_it_holds_at_most_its_capacity_dropping_the_least_recently_used() -> None:
    m = PrefixMap(capacity=2)
    m.record((1,), "a")
    m.record((2,), "b")
    assert m.lookup((1,)) == "a"  # used: now the most recent
    m.record((3,), "c")
    assert len(m) == 2 and m.lookup((2,)) is None and m.lookup((1,)) == "a"
    m.forget("a")
    assert m.lookup((1,)) is None and m.lookup((3,)) == "c"
    with pytest.raises(ValueError, match="capacity"):
        PrefixMap(capacity=0)


def queue(*limits: int) -> tuple[AdmissionQueue, list[UpstreamState]]:
    ups = [UpstreamState(f"u{i}", build_controller("fixed", {"initial": n}))
           for i, n in enumerate(limits)]
    q = AdmissionQueue(ups, CLASSES)
    q.affinity = PrefixMap()
    return q, ups


def offer(q: AdmissionQueue, prefix: tuple[int, ...], at: float = 0.0) -> UpstreamState:
    decision = q.offer(Ticket("default", at, prefix=prefix), at)
    assert isinstance(decision, Admitted)
    return decision.upstream


def test_a_conversations_next_turn_goes_where_the_last_one_went_while_it_has_room() -> None:
    q, _ = queue(8, 8)
    first = offer(q, (10, 11))
    other = offer(q, (1000, 1001))
    assert other is not first  # no prefix known: least full, as ever
    # the first conversation's next turns go back to its engine, though it grows fuller
    # than the other (1 of 8), until it is half its limit fuller (AFFINITY_SLACK): at 5
    # of 8 it still takes one, at 6 of 8 it is passed by
    assert AFFINITY_SLACK == 0.5
    turns = [tuple(range(10, 10 + 2 * k)) for k in range(2, 8)]
    assert [offer(q, t) for t in turns[:5]] == [first] * 5
    assert (first.inflight, other.inflight) == (6, 1)
    assert offer(q, turns[5]) is other  # and it is remembered there
    assert q.affinity is not None and q.affinity.lookup(turns[5]) == other.name


def test_a_turn_whose_engine_is_full_goes_where_there_is_room() -> None:
    q, ups = queue(1, 3)
    first = offer(q, (10, 11))
    assert first is ups[0] and first.inflight == first.limit
    assert offer(q, (10, 11, 12, 13)) is ups[1]


def test_without_affinity_the_least_full_engine_takes_it() -> None:
    q, _ = queue(3, 3)
    q.affinity = None
    first = offer(q, (10, 11))
    assert offer(q, (10, 11, 12, 13)) is not first


def test_prompt_keys_grow_with_a_conversation_and_differ_between_conversations() -> None:
    from kneegate.admission.affinity import TEXT_RUN, TOKEN_RUN, prompt_keys

    turn1 = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    turn2 = [*turn1, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "?"}]
    k1, k2 = prompt_keys({"messages": turn1}), prompt_keys({"messages": turn2})
    assert len(k1) == 2 and k2[:2] == k1 and len(k2) == 4
    other = prompt_keys({"messages": [{"role": "system", "content": "be brief"},
                                      {"role": "user", "content": "ho"}]})
    assert other[0] == k1[0] and other[1] != k1[1]
    assert len(prompt_keys({"prompt": "x" * (2 * TEXT_RUN + 1)})) == 2
    assert len(prompt_keys({"prompt": list(range(TOKEN_RUN * 3))})) == 3
    assert prompt_keys({"prompt": ["a", "b"]}) == () and prompt_keys({}) == ()
