"""Invariants over any stream of samples, ticks and engine scrapes, for every controller."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kneegate.controllers import (
    CONTROLLERS,
    EngineStats,
    LimitController,
    Outcome,
    Sample,
    build_controller,
)


@dataclass(frozen=True)
class Event:
    kind: str  # "sample" | "tick" | "stats"
    dt: float  # virtual time advanced before it
    load: float  # in-flight as a fraction of the current limit
    ttft: float | None
    duration: float
    tokens: int
    outcome: Outcome
    waiting: int


events = st.lists(
    st.builds(
        Event,
        kind=st.sampled_from(["sample", "sample", "tick", "tick", "stats"]),
        dt=st.floats(0.0, 4.0),
        load=st.floats(0.0, 2.0),
        ttft=st.one_of(st.none(), st.floats(0.0, 10.0)),
        duration=st.floats(0.0, 60.0),
        tokens=st.integers(0, 2000),
        outcome=st.sampled_from(list(Outcome)),
        waiting=st.integers(0, 20),
    ),
    max_size=200,
)


def drive(ctl: LimitController, stream: list[Event], *, app_limited: bool = False) -> list[int]:
    """Play the stream; with `app_limited`, in-flight always stays under half the limit."""
    now, limits, preempted = 0.0, [], 0
    for e in stream:
        now += e.dt
        load = min(e.load, 0.49) if app_limited else e.load
        inflight = int(load * ctl.limit)
        if e.kind == "tick":
            ctl.on_tick(now, inflight)
        elif e.kind == "stats":
            preempted += e.waiting % 3 == 0
            ctl.on_engine_stats(EngineStats(now, inflight, e.waiting, 0.5, preempted, 100.0 * now))
        else:
            ttft = None if e.ttft is None else min(e.ttft, e.duration)
            ctl.on_sample(
                Sample(now - e.duration, e.duration, ttft, 100, e.tokens, inflight, e.outcome)
            )
        limits.append(ctl.limit)
    return limits


NAMES = sorted(CONTROLLERS)
PARAMS = {"initial": 16, "min_limit": 2, "max_limit": 64}


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=60, deadline=None)
@given(stream=events)
def test_limit_stays_in_bounds(name: str, stream: list[Event]) -> None:
    limits = drive(build_controller(name, PARAMS), stream)
    assert all(2 <= x <= 64 for x in limits)


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=40, deadline=None)
@given(stream=events)
def test_same_stream_same_limits(name: str, stream: list[Event]) -> None:
    assert drive(build_controller(name, PARAMS), stream) == drive(
        build_controller(name, PARAMS), stream
    )


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=60, deadline=None)
@given(stream=events)
def test_no_growth_while_app_limited(name: str, stream: list[Event]) -> None:
    limits = drive(build_controller(name, PARAMS), stream, app_limited=True)
    assert all(b <= a for a, b in zip([16, *limits], limits, strict=False))
