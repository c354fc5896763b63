from __future__ import annotations

import pytest
from helpers.controllers import scrape, window

from kneegate.controllers import Gradient, GradientConfig, Outcome


def make(**cfg: object) -> Gradient:
    base = {"initial": 20, "queue_size": 4.0, "min_samples": 8}
    return Gradient(GradientConfig(**{**base, **cfg}))


def test_grows_by_smoothed_queue_when_latency_is_flat() -> None:
    ctl = make()
    t = window(ctl, 0.0, 20, 400.0)  # 20 * 0.8 + (20 * 1 + 4) * 0.2 = 20.8
    assert ctl.limit == 20
    window(ctl, t, 20, 400.0)  # 20.8 * 0.8 + 24.8 * 0.2 = 21.6
    assert ctl.limit == 21


def test_latency_rise_shrinks_the_limit() -> None:
    ctl = make(tolerance=1.0)
    t = window(ctl, 0.0, 20, 400.0, ttft=0.2)  # 20.8
    # ttft long = mean(0.2, 0.8) = 0.5, short 0.8: gradient 0.625
    # new = 20.8 * 0.625 + 4 = 17.0; smoothed 20.8 * 0.8 + 17.0 * 0.2 = 20.04
    window(ctl, t, 20, 400.0, ttft=0.8)
    assert ctl.limit == 20
    assert ctl._limit == pytest.approx(20.04)


def test_long_answers_are_not_congestion() -> None:
    short, long = make(tolerance=1.0), make(tolerance=1.0)
    t = 0.0
    for out in (100, 1000, 1000):  # same TTFT and per-token time, 10x longer answers
        window(short, t, 20, 400.0)
        t = window(long, t, 20, 400.0 * out / 100, out=out)
    assert long.limit == short.limit == 22


def test_drop_uses_the_floor_gradient() -> None:
    ctl = make()
    ctl.on_tick(0.0, 20)
    t = window(ctl, 0.0, 20, 400.0, outcome=Outcome.TIMEOUT, ttft=None)
    # 20 * 0.8 + (20 * 0.5 + 4) * 0.2 = 18.8
    assert ctl.limit == 18
    assert t == 5.0


def test_distress_uses_the_floor_gradient() -> None:
    ctl = make()
    ctl.on_engine_stats(scrape(-1.0, waiting=3))
    ctl.on_engine_stats(scrape(0.0, waiting=4))  # waiting, not draining
    window(ctl, 0.0, 20, 400.0)
    assert ctl.limit == 18


def test_holds_while_app_limited() -> None:
    ctl = make()
    window(ctl, 0.0, 9, 200.0)  # max in-flight 9 < 20 / 2
    assert ctl.limit == 20


def test_cancellation_is_no_sample() -> None:
    ctl = make()
    window(ctl, 0.0, 20, 400.0, ttft=50.0, outcome=Outcome.CLIENT_CANCELLED)
    assert ctl.limit == 20


def test_window_waits_for_samples() -> None:
    ctl = make()
    window(ctl, 0.0, 20, 400.0, n=3)  # 3 < min_samples: the window stays open
    assert ctl._limit == 20.0
