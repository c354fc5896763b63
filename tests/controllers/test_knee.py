from __future__ import annotations

import json
import math
from collections.abc import Callable

import pytest
from helpers.controllers import make_sample, scrape, window

from kneegate.controllers import Knee, KneeConfig, Outcome


def make(**cfg: object) -> Knee:
    return Knee(KneeConfig(**{"initial": 16, "window": 5.0, "change": 0.25, **cfg}))


def engine_window(
    ctl: Knee, t: float, inflight: int, *, running: float, kv: float, **kw: float
) -> float:
    """One window in which the engine reports `running` sequences at `kv` KV-cache use."""
    for i in range(6):
        ctl.on_engine_stats(scrape(t + i, running=running, kv=kv, tokens=400.0 * (t + i), **kw))
    return window(ctl, t, inflight, 400.0)


def test_slow_start_doubles_once_each_level_is_measured() -> None:
    ctl = make()
    t = window(ctl, 0.0, 16, 400.0)
    assert ctl.limit == 32  # 16 x (1 + climb): one step past the initial limit
    t = window(ctl, t, 32, 800.0)
    assert ctl.limit == 32  # that window measured the move: no level past 16 is known yet
    window(ctl, t, 32, 800.0)
    assert ctl.limit == 64


@pytest.mark.parametrize(("ttft", "limit"), [(0.2, 32), (1.6, 20), (1.9, 16)])
def test_growth_stops_where_the_ttft_grown_in_step_would_break_its_objective(
    ttft: float, limit: int
) -> None:
    # TTFT p90 at 16 of 2 s: 16 x 2 / 1.6 = 20, not a doubling; 16 x 2 / 1.9 = 16.8 floors at 16
    ctl = make(ttft_objective=2.0)
    window(ctl, 0.0, 16, 400.0, ttft=ttft)
    assert ctl.limit == limit


@pytest.mark.parametrize(("tpot", "limit"), [(0.03, 32), (0.07, 19), (0.09, 16)])
def test_growth_stops_where_the_tpot_grown_in_step_would_pass_its_aim(
    tpot: float, limit: int
) -> None:
    # a window at 16 whose answers ran at `tpot` a token: 16 x 0.85 x 0.1 / 0.07 = 19.4, not a
    # doubling; 16 x 0.85 x 0.1 / 0.09 = 15.1 holds 16 (never a cut); 0.03 s leaves the doubling
    ctl = make(tpot_objective=0.1, tpot_aim=0.85)
    out, ttft = 100, 0.2
    window(ctl, 0.0, 16, 16 * out / (ttft + tpot * (out - 1)), out=out, ttft=ttft)
    assert ctl.limit == limit


@pytest.mark.parametrize(
    ("tpot", "limits"), [(0.085, [32, 32]), (0.09, [32, 30]), (0.095, [32, 28])]
)
def test_tpot_over_its_aim_brings_the_limit_back(tpot: float, limits: list[int]) -> None:
    # the first window measures the start: growth stops at the aim (`steps.in_step`), never a cut.
    # The second reads the level: 32 x 0.85 x 0.1 / 0.09 = 30.2; at 0.095 it would be 28.6,
    # but one window cuts by no more than `backoff` (0.9 x 32 = 28.8); at the aim it holds
    ctl = make(initial=32, tpot_objective=0.1, tpot_aim=0.85, probe_every=100)
    out, ttft = 100, 0.2
    tput = 32 * out / (ttft + tpot * (out - 1))
    seen = []
    t = 0.0
    for _ in range(2):
        t = window(ctl, t, 32, tput, out=out, ttft=ttft)
        seen.append(ctl.limit)
    assert seen == limits


@pytest.mark.parametrize(
    ("tpots", "limits"),
    [((0.085, 0.085, 0.085), [32, 32, 32]), ((0.085, 0.0825, 0.085), [32, 32, 31]),
     ((0.085, 0.0825, 0.0875), [32, 32, 29])],
)
def test_tpots_aim_sits_one_standard_deviation_of_the_noise_lower(
    tpots: tuple[float, ...], limits: list[int]
) -> None:
    # at the aim (0.085 s = 0.85 x 0.1) a steady 32 holds while its windows agree. Where the
    # second reads 382 tokens/s (0.0825 s a token) and the third 371 (0.085), one window
    # wanders by sqrt(ln(371 / 382)^2 / 2) = 2.1% (`Curve.noise`), and the aim sits that much
    # lower: 32 x exp(-0.021) = 31.3. At 0.0875: 31.1 x exp(-0.041) = 29.9 (31 without it)
    ctl = make(initial=32, tpot_objective=0.1, tpot_aim=0.85, probe_every=100)
    out, ttft = 100, 0.2
    seen = []
    t = 0.0
    for tpot in tpots:
        t = window(ctl, t, 32, 32 * out / (ttft + tpot * (out - 1)), out=out, ttft=ttft)
        seen.append(ctl.limit)
    assert seen == limits


def test_a_window_without_latency_grows_no_further_than_its_levels_latency() -> None:
    # 32 answered at 0.085 s a token, the aim (32 x 0.85 x 0.1 / 0.085 = 32): held twice;
    # then a window whose answers carry no latency (as one closed on the engine's counters)
    # would double the limit unbounded, where the curve's point at its level says TPOT holds
    ctl = make(initial=32, tpot_objective=0.1, tpot_aim=0.85, probe_every=100)
    out, ttft = 100, 0.2
    tput = 32 * out / (ttft + 0.085 * (out - 1))
    t = window(ctl, 0.0, 32, tput, out=out, ttft=ttft)
    t = window(ctl, t, 32, tput, out=out, ttft=ttft)
    assert ctl.limit == 32
    window(ctl, t, 32, tput, out=out, ttft=None)
    assert ctl.limit == 32


def test_a_flat_plateau_is_a_knee_even_when_the_fit_does_not_bend() -> None:
    # doubling from 32 to 64 adds 0.5%: the step does not pay, so the knee is 32
    ctl = make(initial=16, power_floor=0.0, probe_every=100)
    t = window(ctl, 0.0, 16, 900.0)
    for c, tput in ((16, 900.0), (32, 1090.0), (32, 1090.0), (64, 1095.0)):
        t = window(ctl, t, c, tput)
    assert ctl.knee() == (32, False)
    assert ctl.limit == 64  # one window at 64 says so: a second must confirm it
    t = window(ctl, t, 64, 1095.0)
    assert ctl.knee() == (32, False)
    assert ctl.limit == 30  # 0.95 x 32, down from 64


def test_one_lucky_window_is_no_plateau() -> None:
    # 16 measured high once; 15, just under it, says the step up to 32 still pays
    ctl = make(initial=64, power_floor=0.0, probe_every=100)
    t = window(ctl, 0.0, 15, 940.0)
    for c, tput in ((15, 940.0), (16, 995.0), (32, 1061.0)):
        t = window(ctl, t, c, tput)
    # not 16: the fitted curve bends at 26.65, within its noise of 32, so at 32
    fit = ctl.fit()
    e_min = math.log1p(ctl.cfg.step_gain) / math.log(1.2)
    assert fit["intercept"] / fit["slope"] * (1 / e_min - 1) == pytest.approx(26.65, abs=0.01)
    assert ctl.knee() == (32, True)


def test_a_draining_window_is_no_plateau() -> None:
    # in-flight fell from 32 to 8 in the window: its mean, 20, is no level of its own
    ctl = make(initial=32, power_floor=0.0, probe_every=100)
    t = window(ctl, 0.0, 8, 400.0)
    for c, tput in ((8, 400.0), (16, 700.0)):
        t = window(ctl, t, c, tput)
    ctl.on_tick(t, 32)
    t = window(ctl, t, 20, 705.0)  # its first tick sees 32 in flight: max 32, mean ~20
    assert ctl.state()["curve"][-1]["concurrency"] == pytest.approx(20.0, abs=0.1)
    assert ctl.knee() == (None, True)


def test_holds_headroom_below_the_engines_room() -> None:
    # 16 running fill 40% of the KV cache: the engine has room for 40 (answers at 79 ms a
    # token at 32: an objective that does not bind, the room is what this test reads)
    ctl = make(tpot_objective=1.0)
    t = engine_window(ctl, 0.0, 16, running=16, kv=0.4)
    assert ctl.limit == 32  # one slow-start step, still under 0.95 x 40
    engine_window(ctl, t, 32, running=32, kv=0.8)
    assert ctl.knee_estimate == 40
    assert ctl.limit == 38  # 0.95 x 40


def test_a_queue_in_the_engine_caps_at_what_it_runs() -> None:
    ctl = make(initial=40)
    engine_window(ctl, 0.0, 40, running=30, kv=0.6, waiting=10)
    assert ctl.knee_estimate == 30  # its queue never emptied: 30 is all it holds
    assert ctl.limit == 28  # 0.95 x 30 x (40 / 40 in flight at the engine)


def test_fits_a_bending_curve_and_holds_below_its_knee() -> None:
    # tput = 50 c / (1 + c / 20): c / tput = 0.02 + 0.001 c, k = 20
    ctl = make(initial=64, step_gain=0.05, probe_every=100)
    t = window(ctl, 0.0, 8, 285.714)  # the first window measures the start, not a level
    for c, tput in ((8, 285.714), (16, 444.444), (32, 615.385)):
        t = window(ctl, t, c, tput)  # app-limited: learns, never grows
    knee, rising = ctl.knee()
    assert knee == pytest.approx(54.74, abs=0.01)  # where a 20% step adds 5%
    assert rising
    assert ctl.limit == 52  # 0.95 x 54.74: a decrease needs no proof of load


def test_probes_above_a_throughput_knee_every_few_windows() -> None:
    ctl = make(initial=64, step_gain=0.05, probe_every=2)
    t = window(ctl, 0.0, 8, 285.714)
    for c, tput in ((8, 285.714), (16, 444.444), (32, 615.385)):
        t = window(ctl, t, c, tput)
    assert ctl.limit == 52
    window(ctl, t, 52, 700.0, out=20, n=12)  # short answers, mostly admitted after the cut
    assert ctl.limit == 60  # 54.74 x 1.1: the second window at the knee probes above it


def test_holds_while_app_limited() -> None:
    ctl = make()
    t = 0.0
    for tput in (100.0, 200.0, 300.0):
        t = window(ctl, t, 4, tput)  # 4 in flight under a limit of 16: not saturated
    assert ctl.limit == 16


def test_an_idle_limit_waits_at_its_target_under_a_measured_room() -> None:
    # bursts: the first burst climbed 16 -> 32 and ended; the engine's room, measured at
    # 40% of its KV cache, is 40. Idle, the limit waits for the next burst at 0.95 x 40
    ctl = make(probe_every=100)
    t = engine_window(ctl, 0.0, 16, running=16, kv=0.4)
    assert ctl.limit == 32
    t = engine_window(ctl, t, 12, running=12, kv=0.3)
    assert ctl.limit == 32  # the window after a move measures the move: it holds
    engine_window(ctl, t, 8, running=8, kv=0.3)  # 8 / 0.3 = 27: a drain's reading, no news
    assert ctl.limit == 38 and ctl.fit()["room"] == 40


def test_an_idle_limit_does_not_rise_on_a_room_it_did_not_measure() -> None:
    # 16 running in 20% of the KV cache "read" room for 80: an extrapolation (under 1/4)
    ctl = make(probe_every=100)
    t = engine_window(ctl, 0.0, 16, running=16, kv=0.2)
    assert ctl.limit == 32
    for _ in range(3):
        t = engine_window(ctl, t, 8, running=8, kv=0.1)
    assert ctl.limit == 32 and ctl.fit()["room"] == 80


def test_ttft_breach_backs_off_below_in_flight() -> None:
    ctl = make()
    window(ctl, 0.0, 16, 400.0, ttft=5.0)  # p90 over the 2 s objective
    assert ctl.limit == 14  # 16 * 0.9


def test_a_breach_in_a_burst_cuts_from_what_the_burst_held() -> None:
    # a burst of 16 for 1.5 s of a 5 s window, then nothing: the gateway's mean is 3.2, the
    # engine's level over its scrapes 6.9, and the burst held 16 while it lasted
    ctl = make()
    ctl.on_engine_stats(scrape(0.0, running=16, kv=0.3, tokens=0.0))
    ctl.on_tick(0.0, 16)
    ctl.on_engine_stats(scrape(0.5, running=16, kv=0.3, tokens=200.0))
    for i in range(8):
        ctl.on_sample(make_sample(admitted_at=0.0, duration=0.6 + i * 0.05, ttft=5.0,
                                  inflight_at_admit=16))
    ctl.on_tick(1.0, 16)
    ctl.on_engine_stats(scrape(1.0, running=16, kv=0.3, tokens=400.0))
    ctl.on_tick(1.5, 0)
    for t in range(2, 6):
        ctl.on_engine_stats(scrape(float(t), running=0, kv=0.0, tokens=600.0))
        ctl.on_tick(float(t), 0)
    # the breach marks the engine's level (ceiling 0.9 x 6.9) and cuts from the burst's 16
    # (0.9 x 16), not from the window's mean (0.9 x 3.2 = 2.9)
    assert ctl.limit == 6 and ctl.ceiling() == pytest.approx(6.17, abs=0.01)


def test_objective_ceiling_caps_the_climb() -> None:
    ctl = make(initial=10)
    t = window(ctl, 0.0, 10, 250.0)
    assert ctl.limit == 20
    t = window(ctl, t, 20, 500.0, ttft=3.0)  # breach at 20: cut to 20 * 0.9
    assert ctl.limit == 18
    window(ctl, t, 18, 450.0)
    assert ctl.ceiling() == 18  # nothing good measured under 20: 0.9 x 20
    assert ctl.limit == 18  # would double, but 20 broke the objective


@pytest.mark.parametrize(("good", "ceiling", "limit"), [(2, 14.4, 14), (6, 6, 6)])
def test_a_good_level_more_than_two_climb_steps_under_a_breach_is_no_ceiling(
    good: int, ceiling: float, limit: int
) -> None:
    # a good level 8x under the breach at 16 was never climbed through (idle windows' means
    # read such levels on bursty traffic): the breach cuts by the backoff (0.9 x 16), not to
    # it; one within two climb steps (16 / 6 < 4) is the ceiling, and the cut goes there
    ctl = make()
    t = window(ctl, 0.0, good, 25.0 * good)  # the first window measures the start
    t = window(ctl, t, good, 25.0 * good)
    assert ctl.limit == 16 and ctl.ceiling() == math.inf
    window(ctl, t, 16, 400.0, ttft=3.0)  # TTFT p90 over the 2 s objective at 16
    assert ctl.ceiling() == pytest.approx(ceiling)
    assert ctl.limit == limit


def test_drop_and_engine_queue_back_off() -> None:
    ctl = make()
    window(ctl, 0.0, 16, 400.0, outcome=Outcome.UPSTREAM_OVERLOADED, ttft=None)
    assert ctl.limit == 14
    ctl.on_engine_stats(scrape(5.0, running=8, waiting=2))
    ctl.on_engine_stats(scrape(6.0, running=8, waiting=3))
    window(ctl, 6.0, 14, 400.0)
    assert ctl.limit == 7  # the engine queues past 8 running: 0.95 x 8


def test_preemptions_mean_the_engine_is_full() -> None:
    ctl = make(initial=20)
    ctl.on_engine_stats(scrape(0.0, running=12, preemptions=3))
    ctl.on_engine_stats(scrape(1.0, running=12, preemptions=5))
    window(ctl, 1.0, 20, 400.0)
    assert ctl.knee_estimate == 12
    assert ctl.limit == 11  # 0.95 x 12


def test_cancellation_is_no_sample() -> None:
    ctl = make()
    window(ctl, 0.0, 16, 400.0, ttft=50.0, outcome=Outcome.CLIENT_CANCELLED)
    assert ctl.limit == 16
    assert ctl.state()["curve"] == []


def test_not_fooled_by_the_false_second_peak() -> None:
    ctl = make(initial=64, ttft_objective=10.0, tpot_objective=1.0, probe_every=100)
    t = window(ctl, 0.0, 8, 200.0)
    for level, tput, ttft in ((8, 200.0, 0.2), (16, 400.0, 0.3), (24, 300.0, 2.0)):
        t = window(ctl, t, level, tput, ttft=ttft)
    for _ in range(2):  # the first window at 32 measures the move there
        t = window(ctl, t, 32, 420.0, ttft=4.0, out=20, n=12)
    assert [p["concurrency"] for p in ctl.state()["curve"]] == [8, 16, 24, 32]
    # 32 in flight yields more than 16 did, but only after the collapse at 24
    assert ctl.knee() == (16, False)


def test_a_changed_engine_resets_the_curve() -> None:
    ctl = make(initial=64)
    t = window(ctl, 0.0, 16, 400.0)
    for c, tput in ((16, 400.0), (20, 500.0), (25, 520.0)):
        t = window(ctl, t, c, tput)
    assert len(ctl.state()["curve"]) == 3
    window(ctl, t, 16, 200.0)  # the same level now gives half: a slower GPU
    assert [p["throughput"] for p in ctl.state()["curve"]] == [200.0]


def test_a_change_keeps_the_breach_measured_after_it() -> None:
    # the e2e test's 13 <-> 26: a slowdown breaks the objective at 24, then a window at 16
    # contradicts the 16 measured before it; clearing the whole curve lost the ceiling
    ctl = make(initial=8, max_limit=64, tpot_objective=1.0)
    t = 0.0
    for c, tput in ((8, 200.0), (12, 300.0), (16, 400.0)):
        t = window(ctl, t, c, tput)
    t = window(ctl, t, 24, 150.0, ttft=4.0, out=20)  # slower now: a breach at 24
    assert (ctl.ceiling(), ctl.limit) == (16, 15)
    for _ in range(3):  # the first is the move's; 16 now reads a quarter of its 400
        t = window(ctl, t, 16, 100.0, out=10)
    assert [p["throughput"] for p in ctl.state()["curve"]] == [100.0, 150.0]
    assert (ctl.ceiling(), ctl.limit) == (16, 16)  # was inf and 30: the climb doubled


def test_a_probe_stays_within_a_climb_step_of_the_levels_measured() -> None:
    # tput = 50 c / (1 + c / 100): measured up to 64, the fit puts the knee at 274
    ctl = make(initial=8, step_gain=0.05, probe_every=2)
    t = 0.0
    for _ in range(7):
        c = ctl.limit
        t = window(ctl, t, c, 50 * c / (1 + c / 100), out=20, n=12)
    assert ctl.limit == 103
    window(ctl, t, 103, 50 * 103 / (1 + 103 / 100), out=20, n=12)
    assert ctl.limit == 128  # 2 x 64, the climb's bound; a probe went to 1.1 x 274 = 301


def engine_climb(ctl: Knee, windows: int, tput: Callable[[int], float]) -> list[int]:
    """Windows at the limit, the engine's counters reading `tput(limit)`; the limits after."""
    t, tokens, limits = 0.0, 0.0, []
    for _ in range(windows):
        c = ctl.limit
        for i in range(6):
            ctl.on_engine_stats(scrape(t + i, running=c, kv=0.01, tokens=tokens + tput(c) * i))
        tokens += tput(c) * 5
        t = window(ctl, t, c, tput(c))
        limits.append(ctl.limit)
    return limits


def test_a_rise_the_engine_keeps_pace_with_is_measured_at_once() -> None:
    # the demo's ramp: each window after a rise filled the new level and still paid
    limits = engine_climb(make(initial=8), 5, lambda c: 25.0 * c)
    # one level per two windows: 16, 16, 32, 32, 64; read at the rise's last scrape a linear
    # engine reads linear (its window means mixed the baseline scrape from before the rise),
    # and the first rise is judged against the first window's last scrape (no level is
    # measured before it): 16, 16, 32, 64, 128 with the first alone
    assert limits == [16, 32, 64, 128, 256]


def test_a_rise_is_read_at_its_last_scrape_past_the_scrape_lag_and_the_prefills() -> None:
    # H100, seed 7: the scrapes come 1.5 s late, so the window after the rise from 32 to 64
    # held two scrapes from before it and one of its prefills; its mean read 45 in flight at
    # 3300 tokens/s against 2956 at 32 (elasticity 0.33) and the climb waited a window
    ctl, tokens = make(), 0.0

    def engine(t: float, rows: list[tuple[int, float]]) -> None:
        nonlocal tokens
        for i, (running, tput) in enumerate(rows):
            tokens += tput
            ctl.on_engine_stats(scrape(t + i, running=running, kv=0.05, tokens=tokens))

    t = 0.0
    for c in (16, 32):  # the start, then the first rise, measured at once
        engine(t, [(c, 92.0 * c)] * 5)
        t = window(ctl, t, c, 92.0 * c)
    assert ctl.limit == 64
    engine(t, [(32, 2956.0), (32, 2956.0), (63, 2509.0), (64, 4794.0)])
    window(ctl, t, 64, 3300.0)
    assert ctl.limit == 128  # 64 measured at once: 4794 at its last scrape, elasticity 0.70
    assert [(round(p.concurrency), round(p.throughput)) for p in ctl._curve.points.values()] == [
        (32, 2944),
        (64, 4794),
    ]


def test_a_rise_that_reads_flat_waits_a_window() -> None:
    # flat from 16: the window after the rise to 32 may be its burst of prefills
    # and the first window that reads 32 as flat is one window at the top: a second at 32
    # confirms the plateau before the limit leaves it
    limits = engine_climb(make(initial=8), 6, lambda c: 25.0 * min(c, 16))
    assert limits == [16, 32, 32, 32, 15, 15]


def test_engine_curve_is_shared_by_gateways() -> None:
    # this gateway holds 4 of the engine's 16; the engine's tokens/s come from its counter
    ctl = make(initial=4)
    t = 0.0
    for _ in range(3):  # the first measures the start, the second moves the limit to 7
        for i in range(6):
            ctl.on_engine_stats(scrape(t + i, running=16, kv=0.5, tokens=400.0 * (t + i)))
        t = window(ctl, t, 4, 100.0)
    curve = ctl.state()["curve"]
    assert [(p["concurrency"], p["throughput"]) for p in curve] == [(16.0, 400.0)]
    assert ctl.state()["curve_of"] == "engine"
    assert ctl.knee_estimate == 32  # 16 running in half the KV cache
    assert ctl.limit == 7  # 0.95 x 32 x this gateway's share 1/4


def test_state_is_json() -> None:
    ctl = make(initial=64)
    t = window(ctl, 0.0, 16, 400.0)
    t = window(ctl, t, 16, 400.0)
    window(ctl, t, 20, 500.0)
    state = json.loads(json.dumps(ctl.state()))
    assert state["name"] == "knee"
    assert state["limit"] == 64
    assert [p["concurrency"] for p in state["curve"]] == [16.0, 20.0]
    assert set(state["curve"][0]) == {"concurrency", "throughput", "ttft_p90", "tpot_p50"}


def test_engine_counters_close_a_window_before_any_request_finishes() -> None:
    # requests last tens of seconds: three scrapes measure the level without waiting for them
    ctl = make()
    for i in range(7):
        ctl.on_engine_stats(scrape(float(i), running=16, kv=0.4, tokens=400.0 * i))
    ctl.on_tick(0.0, 16)
    ctl.on_tick(6.0, 16)
    assert ctl.limit == 32  # one slow-start step at 6 s, not at max_window (30 s)


@pytest.mark.parametrize(("tput", "inflight", "limit"), [
    (160.0, 32, 28),  # 32 running at 160 tokens/s: 0.2 s a token, over 0.1 s: cut 32 x 0.9
    (800.0, 32, 64),  # 0.04 s a token: the level is good, slow start doubles
    (160.0, 16, 32),  # under the limit (a burst's prefills read so): no judgement, held
])
def test_a_window_no_answer_ended_in_is_judged_by_the_engines_tpot(
    tput: float, inflight: int, limit: int
) -> None:
    # every step slowed down: requests outlast the window, none ends in it
    ctl = make(initial=32, tpot_objective=0.1, probe_every=100)
    for i in range(7):
        ctl.on_engine_stats(scrape(float(i), running=inflight, kv=0.4, tokens=tput * i))
    ctl.on_tick(0.0, inflight)
    ctl.on_tick(6.0, inflight)
    assert ctl.limit == limit


def test_a_level_without_latency_does_not_end_the_curve() -> None:
    # 8 and 16 measured by counters alone (no latency), then 24 with latency: one rising curve
    ctl = make(initial=64, probe_every=100)
    t = window(ctl, 0.0, 8, 200.0, ttft=None)
    for c, tput in ((8, 200.0), (16, 400.0)):
        t = window(ctl, t, c, tput, ttft=None)  # no TTFT: no TPOT either
    t = window(ctl, t, 24, 600.0, ttft=0.2)  # power 600 / (0.2 + 0.038 x 100) tok/s^2
    assert [p["concurrency"] for p in ctl.state()["curve"]] == [8, 16, 24]
    assert ctl.knee() == (None, True)  # still linear: no decline, no knee


def test_a_burst_and_its_drain_do_not_bend_the_curve() -> None:
    # levels whose in-flight swung within the window (bursts) are no levels of the fit
    ctl = make(initial=64, probe_every=100, power_floor=0.0)
    t = 0.0
    for c, tput in ((8, 400.0), (8, 400.0), (12, 520.0), (18, 600.0)):
        ctl.on_tick(t, 40)  # a burst's peak at the window's start: mean far under the max
        t = window(ctl, t, c, tput)
    assert ctl.knee() == (None, True)
    assert ctl.limit == 64


def engine_level(
    ctl: Knee,
    t: float,
    running: float,
    tput: float,
    *,
    waiting: float = 0,
    kv: float = 0.3,
    ttft: float = 0.2,
    duration: float = 4.0,
    total: list[float],
) -> float:
    """One window: the engine runs `running` (+ `waiting`) at `tput` tokens/s by its counter;
    its requests take `duration` s, `ttft` of it before the first token. `total` carries the
    engine's generation counter from one window to the next."""
    for i in range(6):
        total[0] += tput if i else 0.0
        ctl.on_engine_stats(scrape(t + i, running=running, waiting=waiting, kv=kv, tokens=total[0]))
    c = round(running + waiting)
    return window(ctl, t, c, c * 100 / duration, ttft=ttft)


def test_a_window_the_engine_ramped_through_is_no_level() -> None:
    # H100, seed 7: the KV edge lifted the limit from 503 to ~630 a second into a window
    # that had not moved it; the rise's prefills read 2600 tokens/s at one scrape, and the
    # window's 577 at 8839 against 7578 at 128 read as a plateau from 128 (the window's
    # limit fell to 122, hidden only by the KV edge)
    ctl = make(initial=100, probe_every=100)
    total = [0.0]
    t = engine_level(ctl, 0.0, 64, 4000.0, total=total)  # app-limited: the limit holds
    t = engine_level(ctl, t, 64, 4000.0, total=total)  # and waits at 0.95 x the room, 64 / 0.3
    t = engine_level(ctl, t, 64, 4000.0, total=total)  # after that move it holds: the next
    # window (the ramp) follows no move, so only the ramp's own exception keeps it
    assert [(p["concurrency"], p["throughput"]) for p in ctl.state()["curve"]] == [
        (64.0, 4000.0)
    ]
    waiting = ctl.limit
    assert waiting == math.floor(0.95 * 64 / 0.3)  # headroom x the room: 64 in 30% of the cache
    for i, (running, tput) in enumerate([(64, 4000), (76, 1500), (80, 4300), (80, 4300)]):
        total[0] += tput
        ctl.on_engine_stats(scrape(t + i, running=running, kv=0.3, tokens=total[0]))
    window(ctl, t, 80, 2000.0)
    assert ctl.limit == waiting  # neither cut by a false plateau nor moved by the ramp's room
    assert [(p["concurrency"], p["throughput"]) for p in ctl.state()["curve"]] == [
        (64.0, 4000.0)
    ]  # 72.8 at 4700 tokens/s by the window's means, a ramp: no point


def test_a_level_whose_last_scrape_collapsed_does_not_grow() -> None:
    # the 4x slowdown of test_knee_slowdown_sim at seed 7 struck in the window in which the
    # breach at 64 faded: its mean read 881 tokens/s at 32 (-20%), its last scrape 225 (-80%),
    # and the limit doubled into the slowdown (89 a window later); the samples of those
    # requests, admitted before the cuts that followed, measured nothing for ~30 s, and the
    # limit held 27 at 75-90 s where the other seeds held 15-18
    ctl = make(initial=16, probe_every=100, objective_memory=12.0)
    total, t = [0.0], 0.0
    for running, tput, ttft in ((16, 400.0, 0.2), (32, 800.0, 0.2), (64, 1200.0, 5.0),
                                (32, 800.0, 0.2), (32, 800.0, 0.2)):
        t = engine_level(ctl, t, running, tput, ttft=ttft, total=total)
    assert (ctl.limit, ctl.ceiling()) == (32, 32.0)  # the breach at 64 holds it
    for i, tput in enumerate([800.0, 800.0, 800.0, 800.0, 800.0, 160.0]):
        total[0] += tput if i else 0.0
        ctl.on_engine_stats(scrape(t + i, running=32, kv=0.3, tokens=total[0]))
    window(ctl, t, 32, 800.0)  # the breach fades here: the window would double the limit
    assert (ctl.limit, ctl.ceiling()) == (32, math.inf)


def _climb_to_a_measured_room(knee_at: float) -> Knee:
    """Levels 8, 16, 32 of tput = 50 c / (1 + c / `knee_at`) measured app-limited under a
    limit of 64 (the KV cache 5% full: no room measured), then a saturated window at 64 that
    fills 30% of the cache: a measured room of ~225, within two climb steps of 64."""
    ctl = make(initial=64, probe_every=100)
    total, t = [0.0], 0.0
    for c in (8, 8, 16, 32, 64):
        t = engine_level(ctl, t, c, 50 * c / (1 + c / knee_at), kv=0.05 if c < 64 else 0.3,
                         total=total)
    assert ctl.fit()["room"] == pytest.approx(224.9, abs=0.1)
    return ctl


def test_a_curve_that_rises_through_the_measured_room_climbs_a_full_step() -> None:
    # as on H100, the fitted knee (1952) lies past the room (225); the room, not the curve's
    # elasticity at 64 (0.79: 64 x 1.79 = 115), bounds the climb
    ctl = _climb_to_a_measured_room(200.0)
    fitted = ctl.knee()[0]
    assert fitted is not None and fitted > ctl.fit()["room"]
    assert ctl.limit == (1 + ctl.cfg.climb) * 64  # a full climb step
    assert ctl.limit > 64 * (1 + ctl.cfg.climb * ctl._curve.elasticity(64))  # not the elasticity's


def test_a_curve_that_bends_under_the_measured_room_climbs_by_its_elasticity() -> None:
    # the fitted knee (163) lies under the room: a step past 64 adds less (elasticity
    # 0.24), and the climb is weighed by it: 64 x 1.24 = 79, where a full step would go to
    # the target (0.95 x 163 x this gateway's share of the engine, read 3/4 here: 116)
    ctl = _climb_to_a_measured_room(20.0)
    fitted = ctl.knee()[0]
    assert fitted is not None and fitted < ctl.fit()["room"]
    step = 64 * (1 + ctl.cfg.climb * ctl._curve.elasticity(64))
    assert ctl.limit == math.floor(step) < (1 + ctl.cfg.climb) * 64  # weighed by the elasticity


def test_a_queue_of_one_beside_hundreds_running_is_jitter() -> None:
    # 400 running at 40% of the KV cache: room for 1000; one prefill waits for the next step
    ctl = make(initial=401, max_limit=2048)
    engine_level(ctl, 0.0, 400, 8000.0, waiting=1, kv=0.4, total=[0.0])
    assert ctl.knee_estimate == pytest.approx(1000)  # not capped at the 400 it runs
    assert ctl.limit == 802  # one slow-start step


def test_a_queue_of_one_beside_a_few_running_is_a_full_engine() -> None:
    ctl = make(initial=41)
    engine_level(ctl, 0.0, 40, 400.0, waiting=1, kv=0.9, total=[0.0])
    assert ctl.knee_estimate == 40
    assert ctl.limit == 38  # 0.95 x 40


def test_latency_in_proportion_to_the_level_does_not_end_the_curve() -> None:
    # 4x the level, latency x 3 (Little's law), throughput +20% (a step still pays): one curve
    ctl = make(initial=1024, max_limit=2048, probe_every=100, step_gain=0.01)
    t = window(ctl, 0.0, 32, 3000.0, n=40)
    for c, tput, ttft in ((32, 3000.0, 0.2), (64, 5000.0, 0.3), (128, 7500.0, 0.5)):
        t = window(ctl, t, c, tput, ttft=ttft, n=40, out=256)
    t = window(ctl, t, 512, 9000.0, ttft=1.5, n=40, out=256)
    assert [p["concurrency"] for p in ctl.state()["curve"]][-1] == 512
    knee, _ = ctl.knee()
    assert knee is not None and knee > 128  # the curve reaches past the level of peak power


def test_latency_far_beyond_the_level_ends_the_curve() -> None:
    # the engine: 16 -> 20 running, its tokens/s flat; requests 4 s -> 14 s, 12 s of it TTFT
    ctl = make(initial=48, ttft_objective=20.0, tpot_objective=1.0, probe_every=100)
    total = [0.0]
    t = engine_level(ctl, 0.0, 8, 200.0, kv=8 / 64, total=total)  # measures the start
    t = engine_level(ctl, t, 8, 200.0, kv=8 / 64, total=total)
    t = engine_level(ctl, t, 16, 400.0, kv=16 / 64, ttft=0.3, total=total)
    engine_level(ctl, t, 20, 410.0, kv=20 / 64, ttft=12.0, duration=14.0, total=total)
    # each level's mean counts the last scrape of the window before: ~15 and ~19.4
    levels = [p["concurrency"] for p in ctl.state()["curve"]]
    assert len(levels) == 3
    assert ctl.knee() == (pytest.approx(levels[1], abs=0.01), False)  # power 99 -> 29, tput +2%


def test_a_probe_leaves_a_flat_plateau() -> None:
    # on a flat plateau the fit's elasticity is ~0: a climb step would never leave the knee
    ctl = make(initial=16, power_floor=0.0, probe_every=3)
    t = window(ctl, 0.0, 16, 900.0)
    for c, tput in ((16, 900.0), (32, 1090.0), (32, 1090.0), (64, 1095.0)):
        t = window(ctl, t, c, tput)
    assert ctl.limit == 64  # one window at 64: a second confirms the plateau
    t = window(ctl, t, 64, 1095.0)
    assert ctl.limit == 30  # 0.95 x 32
    t = window(ctl, t, 30, 1085.0)  # admitted before the cut: it measures nothing
    assert ctl.limit == 30
    window(ctl, t, 30, 1085.0)  # the third window with a knee (the second at 64 was one)
    assert ctl.knee() == (32, False)
    assert ctl.limit == 35  # a probe goes to 32 x 1.1 at once, not by the fit's elasticity ~0


def test_a_faster_reading_beside_a_breach_does_not_lift_it() -> None:
    # a CI run of the e2e test swung 16 <-> 29: after the slowdown's breach, a window two
    # bins under it read +35% against the breach point itself (the transition's low
    # reading); that "change" dropped every point measured no later than it, the breach
    # included, and the climb doubled the limit again
    ctl = make(initial=8, max_limit=64, tpot_objective=1.0)
    t = 0.0
    for c, tput in ((8, 200.0), (12, 300.0), (16, 400.0)):
        t = window(ctl, t, c, tput)
    t = window(ctl, t, 24, 150.0, ttft=4.0, out=20)  # a breach at 24, read low
    assert ctl.ceiling() == 16
    for _ in range(3):  # the first two follow moves; the third reads 250 at 22: +67%
        t = window(ctl, t, 22, 250.0, out=10)
    # the stale 16 is gone, 22 is clean, the breach at 24 still caps: ceiling 22 (was inf)
    assert [p["concurrency"] for p in ctl.state()["curve"]] == [22, 24]
    assert (ctl.ceiling(), ctl.limit) == (22, 20)


def test_an_idle_engine_publishes_no_knee_estimate() -> None:
    # 1 running in 0.06% of the KV cache "reads" room for 1600: an extrapolation, not a knee
    # (kneegate_knee_estimate showed ~1,600 idle against ~27 under load)
    ctl = make(initial=8)
    total = [0.0]
    t = 0.0
    for _ in range(3):
        t = engine_level(ctl, t, 1, 20.0, kv=0.000625, total=total)
    assert ctl.knee_estimate is None
    assert ctl.state()["knee_estimate"] is None


def drain_window(ctl: Knee, t: float, inflight: int, running: float, kv: float,
                 total: list[float]) -> float:
    """One window in which the engine runs `running` at `kv` KV use, 10 tokens/s each (a
    drain's throughput follows its level), and this gateway holds `inflight`."""
    for i in range(6):
        total[0] += 10.0 * running if i else 0.0
        ctl.on_engine_stats(scrape(t + i, running=running, kv=kv, tokens=total[0]))
    return window(ctl, t, inflight, inflight * 100 / 4.0)


def test_a_drain_while_app_limited_pulls_nothing_down() -> None:
    # bursts: between them the engine drains, keeping the longest answers (more KV each:
    # running / KV use falls from 50 to 30) and its scrapes lag the gateway's in-flight
    ctl = make(initial=40, probe_every=100)
    total, t = [0.0], 0.0
    for _ in range(2):
        t = drain_window(ctl, t, 40, 40, 0.8, total)
    assert ctl.limit == 47  # 0.95 x the room of 40 / 0.8
    for running, kv in ((30, 0.7), (20, 0.55), (12, 0.4)):
        t = drain_window(ctl, t, running - 4, running, kv, total)
    assert ctl.limit == 47
    assert ctl.fit()["room"] == pytest.approx(50.0)
    # at the limit, a full cache is news again: the room falls to what runs in it
    t = drain_window(ctl, t, 47, 47, 1.0, total)
    assert ctl.fit()["room"] < 47


def test_a_burst_the_engine_has_not_yet_seen_is_no_level() -> None:
    # the gateway filled to 28 at once, the engine's scrapes (a lag behind) averaged 17 at
    # a prefill's throughput: read as a level it ended the curve there (a 'decline')
    ctl = make(initial=32, probe_every=100, power_floor=0.0)
    total, t = [0.0], 0.0
    for running in (8, 12, 16, 24):
        t = drain_window(ctl, t, running, running, 0.3, total)
    before = ctl.knee()
    for i in range(6):
        total[0] += 60.0 if i else 0.0  # a sixth of the level's throughput: prefills
        ctl.on_engine_stats(scrape(t + i, running=17, kv=0.3, tokens=total[0]))
    ctl.on_tick(t, 20)
    window(ctl, t, 28, 700.0)
    assert ctl.knee() == before == (None, True)


def test_a_drain_beside_another_gateway_keeps_the_share() -> None:
    # another gateway holds as many as this one: the engine runs twice its in-flight
    ctl = make(initial=20, probe_every=100)
    total, t = [0.0], 0.0
    for _ in range(3):
        t = drain_window(ctl, t, 20, 40, 0.8, total)
    assert ctl.limit == 23  # 0.95 x the room of 50 x 1/2
    # this gateway drains first: 10 of 36, then 6 of 30 would read a share of 0.2-0.3
    for mine, running in ((10, 36), (6, 30)):
        t = drain_window(ctl, t, mine, running, 0.7, total)
    # idle, the limit waits at its target: the room rose a little (36 / 0.7 = 51.4, smoothed)
    room = ctl.fit()["room"]
    assert 50 < room < 51.5
    assert ctl.limit == math.floor(0.95 * room / 2) == 24  # the share held at a half
