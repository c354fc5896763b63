"""`Knee.fit()`: the learned curve as the live page draws it, read without changing anything."""

from __future__ import annotations

import json

import pytest
from helpers.controllers import scrape, window

from kneegate.controllers import Knee, KneeConfig


def make(**cfg: object) -> Knee:
    return Knee(KneeConfig(**{"initial": 16, "window": 5.0, "change": 0.25, **cfg}))


def test_the_fitted_line_is_the_saturating_curve() -> None:
    # tput = 50 c / (1 + c / 100): c / tput = 1/50 + c / 5000
    ctl = make(initial=8, step_gain=0.05, probe_every=100)
    t = 0.0
    for _ in range(7):  # levels 16, 32 and 64, each measured after the move to it
        c = ctl.limit
        t = window(ctl, t, c, 50 * c / (1 + c / 100), out=20, n=12)
    fit = ctl.fit()
    assert fit["intercept"] == pytest.approx(1 / 50, rel=1e-3)
    assert fit["slope"] == pytest.approx(1 / 5000, rel=1e-3)
    assert fit["kept"] == [16, 32, 64]
    assert fit["decline_from"] is None
    assert fit["curve_knee"] == ctl.knee()[0]
    assert json.loads(json.dumps(ctl.state()))["fit"] == fit


def test_a_curve_without_a_bend_has_no_fit_and_no_knee() -> None:
    ctl = make()
    t = window(ctl, 0.0, 16, 400.0)
    window(ctl, t, 16, 400.0)
    fit = ctl.fit()
    assert (fit["intercept"], fit["slope"], fit["curve_knee"], fit["room"]) == (
        None, None, None, None)


def test_the_decline_starts_at_the_first_level_past_it() -> None:
    # as test_not_fooled_by_the_false_second_peak: 24 falls 25% under 16's throughput
    ctl = make(initial=64, ttft_objective=10.0, tpot_objective=1.0, probe_every=100)
    t = window(ctl, 0.0, 8, 200.0)
    for level, tput, ttft in ((8, 200.0, 0.2), (16, 400.0, 0.3), (24, 300.0, 2.0)):
        t = window(ctl, t, level, tput, ttft=ttft)
    for _ in range(2):
        t = window(ctl, t, 32, 420.0, ttft=4.0, out=20, n=12)
    before = ctl.state()
    fit = ctl.fit()
    assert (fit["kept"], fit["decline_from"], fit["curve_knee"]) == ([8, 16], 24, 16)
    assert ctl.state() == before  # reading it changed nothing


def test_a_level_that_measured_no_throughput_is_no_decline() -> None:
    # the engine's counter stood still at 16 (a stalled engine): a point with throughput 0,
    # which the curve leaves out; reading the fit used to index past the levels (a 500 on
    # /kneegate/status)
    ctl = make(initial=16)
    t = 0.0
    for _ in range(3):
        for i in range(6):
            ctl.on_engine_stats(scrape(t + i, running=16, kv=0.1, tokens=1000.0))
        t = window(ctl, t, 16, 400.0)
    assert [p["throughput"] for p in ctl.state()["curve"]] == [0.0]
    fit = ctl.fit()
    assert (fit["kept"], fit["decline_from"], fit["curve_knee"]) == ([], None, None)
