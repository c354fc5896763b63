from __future__ import annotations

import json

from ctl_helpers import scrape, window

from controllers import Knee, KneeConfig, Outcome


def make(**cfg: object) -> Knee:
    return Knee(
        KneeConfig(**{"initial": 16, "window": 5.0, "probe_step": 0.25, "change": 0.25, **cfg})
    )


def test_climbs_while_rising_then_holds_headroom_below_the_knee() -> None:
    ctl = make()
    t = window(ctl, 0.0, 16, 400.0)  # one point: no knee yet, look higher
    assert ctl.limit == 20  # 16 * 1.25
    t = window(ctl, t, 20, 500.0)  # +25%: still linear
    assert ctl.limit == 25
    window(ctl, t, 25, 520.0)  # +4%: under the 5% rule, the knee is 20
    assert ctl.knee_estimate == 20
    assert ctl.limit == 16  # 0.8 * 20


def test_probes_above_the_knee_every_few_windows() -> None:
    ctl = make(probe_every=2)
    t = window(ctl, 0.0, 16, 400.0)
    t = window(ctl, t, 20, 500.0)
    t = window(ctl, t, 25, 520.0)  # third window: probe is due (2 since the last)
    assert ctl.limit == 25  # 20 * 1.25
    window(ctl, t, 25, 520.0)
    assert ctl.limit == 16


def test_holds_while_app_limited() -> None:
    ctl = make()
    t = 0.0
    for tput in (100.0, 200.0, 300.0):
        t = window(ctl, t, 4, tput)  # 4 in flight under a limit of 16: not saturated
    assert ctl.limit == 16


def test_ttft_breach_backs_off_below_in_flight() -> None:
    ctl = make()
    window(ctl, 0.0, 16, 400.0, ttft=5.0)  # p90 over the 2 s objective
    assert ctl.limit == 14  # 16 * 0.9


def test_objective_ceiling_caps_the_climb() -> None:
    ctl = make(initial=10)
    t = window(ctl, 0.0, 10, 250.0)
    assert ctl.limit == 12
    t = window(ctl, t, 12, 300.0, ttft=3.0)  # breach at 12: cut to 12 * 0.9
    assert ctl.limit == 10
    t = window(ctl, t, 10, 250.0)
    assert ctl.ceiling() == 10
    assert ctl.limit == 10  # would climb to 12.5, but 12 broke the objective


def test_drop_and_distress_back_off() -> None:
    ctl = make()
    window(ctl, 0.0, 16, 400.0, outcome=Outcome.UPSTREAM_OVERLOADED, ttft=None)
    assert ctl.limit == 14
    ctl.on_engine_stats(scrape(5.0, waiting=2))
    ctl.on_engine_stats(scrape(6.0, waiting=3))
    t = window(ctl, 6.0, 16, 400.0)
    assert ctl.limit == 14  # distress right after a cut: the engine is still draining
    ctl.on_engine_stats(scrape(t, waiting=4))
    window(ctl, t, 16, 400.0)
    assert ctl.limit == 12  # still distressed a window later: 14.4 * 0.9 = 12.96


def test_cancellation_is_no_sample() -> None:
    ctl = make()
    window(ctl, 0.0, 16, 400.0, ttft=50.0, outcome=Outcome.CLIENT_CANCELLED)
    assert ctl.limit == 16
    assert ctl.state()["curve"] == []


def test_not_fooled_by_the_false_second_peak() -> None:
    ctl = make(initial=4, ttft_objective=10.0, tpot_objective=1.0)
    t = 0.0
    for level, tput, ttft in (
        (8, 200.0, 0.2),
        (16, 400.0, 0.3),
        (24, 300.0, 2.0),
        (32, 420.0, 4.0),
    ):
        t = window(ctl, t, level, tput, ttft=ttft)
    # 32 in flight yields more than 16 did, but only after the collapse at 24
    assert ctl.knee() == (16, False)


def test_a_changed_engine_resets_the_curve() -> None:
    ctl = make()
    t = window(ctl, 0.0, 16, 400.0)
    t = window(ctl, t, 20, 500.0)
    t = window(ctl, t, 25, 520.0)  # limit back to 16
    assert len(ctl.state()["curve"]) == 3
    window(ctl, t, 16, 200.0)  # the same level now gives half: a slower GPU
    assert [p["throughput"] for p in ctl.state()["curve"]] == [200.0]


def test_engine_curve_is_shared_by_gateways() -> None:
    # this gateway holds 4 of the engine's 16; the engine's tokens/s come from its counter
    ctl = make(initial=4)
    ctl.on_tick(0.0, 4)
    for i in range(6):
        ctl.on_engine_stats(scrape(float(i), running=16, tokens=400.0 * i))
    window(ctl, 0.0, 4, 100.0)
    curve = ctl.state()["curve"]
    assert curve == [
        {
            "concurrency": 16.0,
            "throughput": 400.0,
            "ttft_p90": 0.2,
            "tpot_p50": curve[0]["tpot_p50"],
        }
    ]
    assert ctl.state()["curve_of"] == "engine"
    assert ctl.limit == 5  # engine target 16 * 1.25 = 20, times this gateway's share 1/4


def test_state_is_json() -> None:
    ctl = make()
    t = window(ctl, 0.0, 16, 400.0)
    window(ctl, t, 20, 500.0)
    state = json.loads(json.dumps(ctl.state()))
    assert state["name"] == "knee"
    assert state["limit"] == 25
    assert [p["concurrency"] for p in state["curve"]] == [16.0, 20.0]
    assert set(state["curve"][0]) == {"concurrency", "throughput", "ttft_p90", "tpot_p50"}
