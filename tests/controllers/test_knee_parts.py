"""The knee controller's parts, each alone: literal readings in, exact state out."""

from __future__ import annotations

import math
from typing import Any

import pytest
from helpers.controllers import make_sample, scrape
from hypothesis import given
from hypothesis import strategies as st

from kneegate.controllers import knee
from kneegate.controllers.knee import KneeConfig, signals
from kneegate.controllers.knee.curve import Curve
from kneegate.controllers.knee.kv import KvEdge
from kneegate.controllers.knee.room import Room, Share, queued
from kneegate.controllers.knee.sizes import Epoch, PromptSizes
from kneegate.controllers.knee.tokens import Calibration
from kneegate.controllers.window import Summary


def summary(**overrides: Any) -> Summary:
    """A 5 s window at 16 in flight, saturated, with 8 healthy samples; override any field."""
    fields: dict[str, Any] = {
        "start": 0.0,
        "end": 5.0,
        "samples": 8,
        "inflight": 16.0,
        "max_inflight": 16,
        "saturated": 1.0,
        "throughput": 400.0,
        "ttft_p90": 0.2,
        "tpot_p50": 0.02,
        "ttft_mean": 0.2,
        "tpot_mean": 0.02,
        "drops": 0,
        "distress": False,
    }
    fields.update(overrides)
    return Summary(**fields)


def climbed(levels: list[tuple[float, float]], scrape_at: float | None = None) -> Curve:
    """A curve learnt from one steady window per (level, tokens/s), 5 s apart; the level
    `scrape_at` read by one scrape just after a rise (`signals.climbed`)."""
    curve = Curve(KneeConfig())
    for i, (c, tput) in enumerate(levels):
        w = summary(end=5.0 * (i + 1), inflight=c, max_inflight=c, throughput=tput)
        curve.learn(w, c, False, scrape=c == scrape_at)
    return curve


def calibrated(prompt: int = 100, answer: int = 100) -> Calibration:
    """One finished request of `prompt` + `answer` tokens: held answer = answer / 2."""
    cal = Calibration(learned=200)
    cal.finish(make_sample(prompt_tokens=prompt, output_tokens=answer))
    return cal


def test_the_package_exports_what_knee_py_did() -> None:
    assert knee.__all__ == ["Knee", "KneeConfig", "Point"]


def test_the_room_falls_at_once_and_rises_by_room_rise() -> None:
    room = Room()
    room.measure(summary(engine_running=30.0, engine_kv=0.5), False, False, 0.5)
    assert (room.value, room.grounded) == (60.0, True)  # 30 running in half the cache
    room.measure(summary(engine_running=30.0, engine_kv=1.0), False, False, 0.5)
    assert room.value == 30.0  # a fall is news
    room.measure(summary(engine_running=30.0, engine_kv=0.5), False, False, 0.5)
    assert room.value == 45.0  # a rise is smoothed
    room.measure(summary(engine_running=30.0, engine_kv=0.25), False, True, 0.5)
    assert room.value == 45.0  # no rise while a rescale's old requests drain


def test_a_full_engine_holds_what_runs_and_an_idle_one_reads_no_grounded_room() -> None:
    room = Room()
    room.measure(summary(engine_running=30.0, engine_kv=0.6), True, False, 0.5)
    assert (room.value, room.grounded) == (30.0, True)
    room.measure(summary(engine_running=1.0, engine_kv=0.01), False, False, 0.5)
    assert room.grounded is False  # 1 running in 1% of the cache is a guess of 100


def test_a_queue_under_the_jitter_is_no_full_engine() -> None:
    assert not queued(summary(engine_waiting=1.0, engine_running=200.0), 0.01)
    assert queued(summary(engine_waiting=3.0, engine_running=200.0), 0.01)
    assert queued(summary(engine_waiting=0.0, engine_running=200.0, engine_preempted=1.0), 0.01)


def test_the_share_is_learnt_only_from_settled_windows() -> None:
    share = Share()
    assert share.update(summary(inflight=10.0), 20.0, False, 0.5) == 0.5  # the first reading
    assert share.update(summary(inflight=20.0), 20.0, False, 0.5) == 0.5  # moved: not learnt
    assert share.update(summary(inflight=20.0), 20.0, True, 0.5) == 0.75
    assert not share.alone()


def test_a_shift_cuts_by_the_last_few_prompts_and_a_confirmation_cuts_deeper() -> None:
    cfg = KneeConfig(admit_recent=4, admit_last=2, admit_confirm=2)
    sizes, cal = PromptSizes(cfg), Calibration(learned=cfg.admit_learned)
    for _ in range(4):
        assert sizes.note(100, cal) is None
    # the slow mean reads 175 (x1.75), the last two 250: the cut is by 2.5
    assert sizes.note(400, cal) == (2.5, None)
    sizes.rebase(None)
    assert (sizes.learned, sizes.confirm) == (250.0, [])
    assert sizes.note(400, cal) is None  # learned follows: 275
    # the two after the cut average 400, x1.45 the 275 learned since: a second cut
    assert sizes.note(400, cal) == (pytest.approx(400 / 275), 400.0)
    sizes.rebase(400.0)
    assert (sizes.learned, sizes.confirm) == (400.0, None)


def test_smaller_prompts_only_rebase() -> None:
    cfg = KneeConfig(admit_recent=4)
    sizes, cal = PromptSizes(cfg), Calibration(learned=cfg.admit_learned)
    for _ in range(4):
        sizes.note(400, cal)
    assert sizes.note(1, cal) is None
    assert sizes.learned == sizes.recent == pytest.approx(300.25)


def test_a_wide_mix_of_lengths_is_no_shift_but_a_shift_within_it_is() -> None:
    """Lengths as wide as a production trace's (exponential: cv 1): a 20-request mean
    passes 1.3x the learned one often by chance, which the significance bound ignores;
    with `shift_z` 0 (the plain ratio test) the same draws cut; a real 4x shift still cuts."""
    import random

    def cuts(cfg: KneeConfig, mean_after: float) -> int:
        rng = random.Random(5)
        sizes, cal = PromptSizes(cfg), Calibration(learned=cfg.admit_learned)
        n = 0
        for i in range(4000):
            mean = 1000.0 if i < 3000 else mean_after
            cut = sizes.note(max(1, round(rng.expovariate(1 / mean))), cal)
            if cut is not None:
                n += 1
                sizes.rebase(cut[1])
        return n

    assert cuts(KneeConfig(), 1000.0) == 0
    assert cuts(KneeConfig(shift_z=0), 1000.0) >= 10
    assert cuts(KneeConfig(), 4000.0) >= 1


def test_a_second_rescale_within_max_window_keeps_the_first_ones_start() -> None:
    epoch = Epoch()
    assert not epoch.calibrated(1, 2)
    epoch.begin(10.0, 30.0)
    epoch.finish(make_sample(admitted_at=5.0, duration=10.0))  # admitted before: old
    assert (epoch.old_finish, epoch.dones_since) == (15.0, 1)
    epoch.begin(20.0, 30.0)
    assert (epoch.rescaled_at, epoch.old_finish, epoch.dones_since) == (10.0, 20.0, 1)
    assert epoch.draining(20.0) and not epoch.draining(20.5)
    assert not epoch.settled(39.0, 5.0, 30.0) and epoch.settled(41.0, 5.0, 30.0)
    epoch.finish(make_sample(admitted_at=12.0))
    assert epoch.calibrated(1, 2) and not epoch.calibrated(1, 3)  # after a rescale: `learned`


def test_the_kv_edge_fills_the_free_cache_and_a_finish_gives_back_its_tokens() -> None:
    kv, cal = KvEdge(KneeConfig()), calibrated()
    kv.scrape(scrape(1.0, running=10, kv=0.5), 100.0, cal, True)
    # capacity 10 x (100 + 50) / 0.5 = 3000; free (0.98 - 0.5) x 3000 - 100 - 0.5 x 200 = 1240
    assert (kv.learned, kv.limit) == (pytest.approx(3000.0), 10 + 6)
    kv.finish(2.0, 500.0)  # one of the 10 went and freed 500 tokens: 9 + (1240 + 500) // 200
    assert kv.limit == 9 + 8
    kv.reset()
    assert kv.limit is None


def test_the_token_budget_counts_prompts_and_held_answers() -> None:
    kv, cal = KvEdge(KneeConfig()), calibrated()
    assert kv.fits(1000, 10**6, 10**6, cal)  # no reported size: no budget
    kv.scrape(scrape(1.0, running=10, kv=0.5, capacity=4000.0), 100.0, cal, True)
    assert kv.token_budget() == pytest.approx(0.95 * 4000)
    assert kv.fits(10, 1000, 100, cal)  # 1100 + 11 x 50 = 1650
    assert not kv.fits(20, 3000, 100, cal)  # 3100 + 21 x 50 = 4150 > 3800


@pytest.mark.parametrize(("top_tput", "tput"), [(0.0, 120.0), (120.0, -50.0)])
def test_a_climb_is_judged_only_from_throughput_that_was_measured(
        top_tput: float, tput: float) -> None:
    # the highest level read no tokens (the engine's counter stood still for a window), or
    # the window's counter went back (an engine restart): no climb is read from them; the
    # logarithm of the ratio raised ZeroDivisionError / ValueError and cost every window's
    # update until the level aged out
    from kneegate.controllers.knee import Knee, Point

    k = Knee(KneeConfig())
    k._moved_up, k._curve.engine_mode = True, True
    k._curve.points = {0: Point(4.0, top_tput, None, None, False, 0.0, True)}
    w = summary(inflight=10.0, max_inflight=10, engine_last=(10.0, tput))
    assert signals.climbed(w, k.cfg, k._curve, k._before, k._moved_up) is None


def test_a_climbs_tpot_is_scaled_from_the_level_its_answers_ended_at() -> None:
    # the window after a rise 64 -> 100 is read at its last scrape (100 in flight, 1,500
    # tokens/s: the rise kept pace), but its answers ended while it held 84 on average: their
    # TPOT, grown in step from 84, meets the aim at 84 x 0.085 / 0.06 = 119; scaled from 100
    # it would read 141, a climb past the aim (docs/design/knee.md, "Regions")
    from kneegate.controllers.knee import Knee

    k = Knee(KneeConfig(initial=100, tpot_objective=0.1, tpot_aim=0.85, probe_every=100))
    k._curve = climbed([(32.0, 700.0), (64.0, 1000.0)])
    k._curve.engine_mode = True
    k._moved, k._moved_up = True, True
    w = summary(start=25.0, end=30.0, inflight=84.0, max_inflight=100, throughput=1300.0,
                engine_inflight=84.0, engine_running=84.0, engine_throughput=1300.0,
                engine_first=64.0, engine_last=(100.0, 1500.0), tpot_p50=0.06)
    assert signals.climbed(w, k.cfg, k._curve, k._before, k._moved_up) is not None
    k._close(w)
    aim = 0.85 * 0.1 / 0.06  # the level's multiple at which TPOT meets the aim (no noise read)
    # from the level its answers ended at, not from the scrape's
    assert k.limit == math.floor(84.0 * aim) < 100.0 * aim


def test_an_app_limited_window_does_not_lower_the_room() -> None:
    room = Room()
    room.measure(summary(engine_running=40.0, engine_kv=0.8), False, False, 0.5)
    assert room.value == 50.0
    # a drain keeps the longest answers: 20 running in 55% of the cache reads 36
    room.measure(summary(engine_running=20.0, engine_kv=0.55), False, False, 0.5, idle=True)
    assert room.value == 50.0
    room.measure(summary(engine_running=30.0, engine_kv=0.5), False, False, 0.5, idle=True)
    assert room.value == 55.0  # a rise still counts, smoothed
    room.measure(summary(engine_running=20.0, engine_kv=0.55), False, False, 0.5)
    assert room.value == pytest.approx(20 / 0.55)  # at the limit a fall is news


def test_the_share_reads_this_gateway_at_each_scrapes_own_time() -> None:
    # four gateways ramp together; the scrapes arrive 1.5 s late: at the window's close this
    # gateway holds 12 while the engine's scrapes read 2 x 4 and 6 x 4 of seconds before
    # (read side by side, 12 / 16 = 0.75, three times the share it has)
    share = Share()
    for t, n in ((0.0, 1), (0.5, 2), (1.0, 4), (1.5, 6), (2.0, 9), (2.5, 12)):
        share.tick(t, n, keep=30.0)
    share.scrape(0.5, 8.0)  # the engine held 8 at 0.5 s, when this gateway held 2
    share.scrape(1.6, 24.0)  # 24 at 1.6 s: the tick before it, 6
    assert share.update(summary(inflight=12.0), 16.0, True, 0.5) == pytest.approx(0.25)
    # ticks older than `keep` are forgotten: a scrape before them reads nothing
    share.tick(40.0, 3, keep=30.0)
    share.scrape(1.0, 10.0)
    assert share.update(summary(inflight=3.0), 3.0, False, 0.5) == pytest.approx(0.25)


def test_a_gateway_alone_applies_no_share() -> None:
    # alone (a share of 0.9 or more), a reading of 0.95 is the ticks' noise, not another
    # gateway: the KV edge and the token budget act on its own requests instead
    share = Share()
    assert share.update(summary(inflight=19.0), 20.0, True, 0.5) == 1.0
    assert share.alone()


def test_a_decline_far_above_the_last_level_kept_is_halved_not_taken_as_the_knee() -> None:
    # vLLM's CPU build: one window of prefills at 14.8 read 101 tokens/s against 133 at 2.0;
    # the knee read 2.0 and the limit held 1-2 where a direct sweep's knee was 8-16
    curve = Curve(KneeConfig())

    def level(at: float, c: float, tput: float) -> None:
        curve.learn(summary(end=at, inflight=c, max_inflight=c, throughput=tput), c, False)

    level(5.0, 2.0, 133.0)
    level(10.0, 14.8, 101.0)
    assert curve.knee() == (pytest.approx((2.0 * 14.8) ** 0.5), False)
    level(15.0, 5.44, 300.0)  # the middle pays: the gap above it is halved again
    assert curve.knee() == (pytest.approx((5.44 * 14.8) ** 0.5), False)
    # where the middle reads the decline too, the gap under it is halved, down to a climb
    # step (x2 at `climb` 1), where the last level kept is the knee as before
    curve.clear()
    level(5.0, 2.0, 133.0)
    level(10.0, 14.8, 101.0)
    level(15.0, 5.44, 90.0)
    assert curve.knee() == (pytest.approx((2.0 * 5.44) ** 0.5), False)
    level(20.0, 3.3, 95.0)
    assert curve.knee() == (2.0, False)


def test_a_level_read_by_one_scrape_after_a_rise_is_no_plateaus_foot() -> None:
    # H100, seed 1: the scrape just after the rise to 193 read 9,503 tokens/s (a fixed limit
    # of 193 holds 8,143); the next window's mean at 387 read 9,976, +5% for twice the level
    def curve_with(foot_is_scrape: bool) -> Curve:
        levels = [(32.0, 2925.0), (64.0, 5063.0), (128.0, 7484.0), (193.0, 9503.0), (387.0, 9976.0)]
        return climbed(levels, 193.0 if foot_is_scrape else None)

    assert curve_with(foot_is_scrape=False).knee() == (193.0, False)
    knee, rising = curve_with(foot_is_scrape=True).knee()
    assert knee is not None and knee > 387.0 and rising  # the fit: still rising at the top
    # a window's mean at the level replaces the scrape's reading and makes it a foot again
    curve = curve_with(foot_is_scrape=True)
    window = summary(end=30.0, inflight=193.0, max_inflight=193, throughput=9503.0)
    curve.learn(window, 193.0, False)
    assert curve.knee() == (193.0, False)


def test_a_level_read_by_one_scrape_is_no_reference_for_a_decline() -> None:
    # vLLM's CPU build at 3x: a window's mean read 939 tokens/s at 30.5, the scrape after
    # the rise to 61 read 1,394 (one second's counters; windows' means there read ~1,000),
    # and the next window's mean at 113 read 977: a decline of 30% from the scrape put the
    # knee at 61, where the engine ran 1,100-1,200 at ~100-135 behind vLLM's own valve
    def curve_with(rise_is_scrape: bool, at_113: float = 977.0) -> Curve:
        levels = [(30.5, 939.0), (61.0, 1394.0), (113.0, at_113)]
        return climbed(levels, 61.0 if rise_is_scrape else None)

    # a window's mean of 1,394 at 61 is a reference: 977 at 113 is a decline from it
    assert curve_with(rise_is_scrape=False).knee() == (61.0, False)
    curve = curve_with(rise_is_scrape=True)
    assert curve.view(math.inf)["decline_from"] is None
    assert [p.concurrency for p in curve.kept()[0]] == [30.5, 61.0, 113.0]
    # a decline from a window's mean still is one: 700 at 113, 25% under 939 at 30.5
    curve = curve_with(rise_is_scrape=True, at_113=700.0)
    assert curve.view(math.inf)["decline_from"] == 113.0
    assert curve.knee() == (61.0, False)


def test_a_window_near_a_level_read_by_one_scrape_measures_it() -> None:
    # vLLM's CPU build, the knee test that failed: the scrape just after the rise to 8 read
    # 342 tokens/s (8 clients direct read 205), the next window's mean at 12.83 read 221, a
    # decline of 35% from 8 that put the knee there and the limit at 7-8, where no window
    # measured the bin of 8 again for the point's memory (300 s). Now the scrape is no
    # decline's reference (`Curve._until_decline`), and the fit, with its 342 in it, bends
    # under 12.83 (11.39), too far from its points to tell its knee from 12.83
    # (`_fit_knee`): the knee lies in the direct sweep's region, 8..16, at 12.83
    climb = [(2.0, 133.0), (4.0, 175.0), (8.0, 342.0), (12.83, 221.0)]
    curve = climbed(climb, scrape_at=8.0)
    knee, rising = curve.knee()
    assert curve.view(math.inf)["decline_from"] is None
    a, b = curve.view(math.inf)["intercept"], curve.view(math.inf)["slope"]
    assert a / b * (1 / curve.e_min() - 1) == pytest.approx(11.39, abs=0.01)
    assert (knee, rising) == (12.83, True)
    # the limit under that knee: a window's mean at 7.6, within `pair` of 8, measures it
    curve.learn(summary(end=30.0, inflight=7.6, max_inflight=8, throughput=205.0), 7.6, False)
    assert sorted(p.concurrency for p in curve.points.values()) == [2.0, 4.0, 7.6, 12.83]
    knee, rising = curve.knee()
    assert knee is not None and knee > 12.83 and rising  # the fit: still rising at the top
    # a window's mean further than `pair` from such a level leaves it as it was
    far = climbed(climb[:3], scrape_at=8.0)
    far.learn(summary(end=30.0, inflight=6.9, max_inflight=7, throughput=200.0), 6.9, False)
    assert 8.0 in [p.concurrency for p in far.points.values()]


def test_levels_closer_than_half_again_are_no_plateau() -> None:
    # vLLM's CPU build at 3x: windows' means read 951 tokens/s at 25.7, 811 at 27.2 and 957
    # at 30.0 (783-957 in the run's windows held at 27-30), where a closed-loop sweep reads
    # 60 in flight 15% above 30; a 17% step's gain is noise, and a plateau from 25.7 held
    # the limit at 24 for the rest of the run
    close = [(25.7, 951.0), (27.2, 811.0), (30.0, 957.0)]
    assert climbed(close).knee() == (None, True)
    # twice the level, +13%: it pays, and the fitted curve's knee lies past it
    assert climbed([*close, (59.2, 1079.0)]).knee() == (pytest.approx(100.74, abs=0.01), True)
    # a step of half again or more that adds nothing is still a plateau where the close
    # levels agree (their windows measure the noise, as neighbours: `Curve._reread`)
    agree = [(25.7, 951.0), (27.2, 945.0), (30.0, 957.0)]
    assert climbed([*agree, (59.2, 960.0)]).knee() == (25.7, False)
    # but one window's reading is no plateau within the noise the close levels measured
    # (811-957 tokens/s at 25.7-30: ~11% a window)
    noisy = climbed([*close, (59.2, 960.0)])
    assert noisy.noise() == pytest.approx(0.0128, abs=1e-4)
    assert noisy.knee() == (59.2, True)


def test_a_fit_with_an_intercept_near_zero_has_a_bounded_knee() -> None:
    # noisy-cpu-3x at seed 13 (under a try): a curve flat from ~57 whose fitted intercept is
    # ~0, so a / b's relative error is ~417 times itself; raised on a log scale, its knee
    # (0.11) overflowed exp() and the window raised. Its error added: a knee of ~45
    flat = [(28.0, 989.8445403556516), (30.0, 1053.013827905542), (32.0, 1079.693203376095),
            (57.0, 1166.0034662231196), (60.0, 1058.1093065439097), (64.0, 1055.5467578189014),
            (83.0, 1038.7096017071958)]
    curve = climbed(flat)
    fit = curve.view(math.inf)
    assert fit["intercept"] / fit["slope"] < 0.02  # the fit's knee: ~0.11
    knee, rising = curve.knee()
    assert knee == pytest.approx(45.24, abs=0.01) and not rising
    # the same throughput at every level: the intercept is exactly 0 (a relative error
    # divided by it); a plateau from the lowest level
    assert climbed([(c, 1000.0) for c in (8.0, 16.0, 32.0, 64.0)]).knee() == (8.0, False)


levels = st.lists(st.floats(1.0, 2000.0), min_size=1, max_size=12)


@given(levels, st.one_of(st.just(None), st.floats(1.0, 1e5)),
       st.lists(st.floats(1.0, 1e5), min_size=12, max_size=12))
def test_any_windows_read_a_bounded_knee(
    cs: list[float], flat: float | None, tputs: list[float]
) -> None:
    # whatever the windows read (`flat`: the same throughput at every level), the curve
    # reads a knee without raising: None, or a level no lower than the lowest kept
    curve = climbed([(c, flat or t) for c, t in zip(cs, tputs, strict=False)])
    knee, _ = curve.knee()
    kept, _ = curve.kept()
    assert knee is None or (math.isfinite(knee) and knee >= min(p.concurrency for p in kept))
    assert 0.0 <= curve.elasticity(cs[0]) <= 1.0
    curve.view(math.inf)


def test_windows_near_a_point_measure_the_noise() -> None:
    # noisy-gentle-3x, seed 49: 32 read in a fast spell, 64 twice in a slow one; the two
    # readings of 64 agree, so the noise reads 0 and the step that added 2% is a plateau
    steps = [(32.0, 1063.0), (64.0, 1083.0), (64.0, 1083.0)]
    curve = climbed(steps)
    assert curve.noise() == pytest.approx(0.0, abs=1e-6)
    assert curve.knee() == (32.0, False)
    # the limit under that knee reads levels within two bins of 32, each a bin of its own:
    # how far each lies from its neighbour, less the fitted slope between them, is noise
    curve = climbed([*steps, (30.0, 905.0), (28.0, 1020.0)])
    assert [p.windows for p in sorted(curve.points.values(), key=lambda p: p.concurrency)] == [
        1, 1, 1, 2
    ]
    assert curve.noise() == pytest.approx(0.00454, abs=1e-5)
    # and within it the step from 32 to 64 does not prove a plateau: the curve runs on
    assert curve.knee() == (64.0, True)
    # a window further than two bins from any point measures nothing
    far = climbed([*steps, (26.0, 905.0)])
    assert far.noise() == pytest.approx(0.0, abs=1e-6)


def test_a_fitted_knee_within_its_noise_of_the_top_is_the_top() -> None:
    # tput = 50 c / (1 + c / 14) read at 8..128: the fit is the curve, and its knee, where a
    # 20% step adds 2%, 14 x (1 / e_min - 1), lies under 128, where the step from 64 still
    # paid (elasticity 0.136)
    levels = [8.0, 16.0, 32.0, 64.0, 128.0]
    exact = climbed([(c, 50 * c / (1 + c / 14)) for c in levels])
    knee = 14 * (1 / exact.e_min() - 1)
    assert knee == pytest.approx(114.9, abs=0.1)
    assert exact.knee() == (pytest.approx(knee), False)
    # the same levels read by windows that wander by a few percent: the fit bends under 128
    # still, but it cannot tell its knee from 128, the highest level, which is the knee
    wander = [1.0, 1.04, 0.96, 1.0, 1.0]
    noisy = climbed([(c, 50 * c / (1 + c / 14) * f) for c, f in zip(levels, wander, strict=True)])
    fit = noisy.view(math.inf)
    plain = fit["intercept"] / fit["slope"] * (1 / noisy.e_min() - 1)
    assert plain == pytest.approx(115.9, abs=0.1)
    assert noisy.knee() == (128.0, True)


def test_a_step_that_lost_less_than_the_measured_noise_is_no_decline() -> None:
    # the same points, 32: 1,000, 64: 1,400 (one window), 128: 1,300 (two windows) with
    # latency grown 4x at 128 (power down to 1/5 of 64's): a decline from 64 where the two
    # readings at 128 agree; where they read 1,500 and 1,100, one window wanders by ~22%
    # (ln(1100 / 1500)^2 / 2 = 0.048), the step's gain of -0.11 has a standard error of
    # sqrt(0.048 x 1.5) / ln 2 = 0.39, and the curve runs on past 64
    def curve(at_128: tuple[float, float]) -> Curve:
        c = Curve(KneeConfig())
        readings = [(32.0, 1000.0, 0.2), (64.0, 1400.0, 0.2), (128.0, at_128[0], 1.0),
                    (128.0, at_128[1], 1.0)]
        for i, (lvl, tput, ttft) in enumerate(readings):
            w = summary(end=5.0 * (i + 1), inflight=lvl, max_inflight=lvl, throughput=tput,
                        ttft_p90=ttft, tpot_p50=0.02 if lvl < 100 else 0.1)
            c.learn(w, lvl, False)
        return c

    agreeing, wandering = curve((1300.0, 1300.0)), curve((1500.0, 1100.0))
    assert [p.throughput for p in wandering.kept()[0]] == [1000.0, 1400.0, 1300.0]
    assert agreeing.noise() == 0.0
    assert wandering.noise() == pytest.approx(math.log(1100 / 1500) ** 2 / 2)
    assert agreeing.kept() == (agreeing.kept()[0][:2], True)
    assert agreeing.knee() == (64.0, False)
    knee, _ = wandering.knee()
    assert knee is not None and knee > 64.0


def test_a_decline_holds_from_the_levels_just_under_its_reference() -> None:
    # noisy-gentle-3x, seed 44: 32 read once in a fast spell (1,000 here), 64 twice in a slow
    # one (1,000 and 900) with latency doubled: power fell under half of 32's and the step
    # did not pay by one standard error of the noise the two readings at 64 measured, a
    # decline that held the knee at 32 (the limit at 30) for the whole run
    def curve(readings: list[tuple[float, float, float, float]]) -> Curve:
        c = Curve(KneeConfig())
        for i, (lvl, tput, ttft, tpot) in enumerate(readings):
            w = summary(end=5.0 * (i + 1), inflight=lvl, max_inflight=lvl, throughput=tput,
                        ttft_p90=ttft, tpot_p50=tpot)
            c.learn(w, lvl, False)
        return c

    by_power = [(32.0, 1000.0, 0.08, 0.03), (64.0, 1000.0, 0.3, 0.065), (64.0, 900.0, 0.3, 0.065)]
    assert curve(by_power).knee() == (32.0, False)
    # the limit under that knee reads 30, within `pair` of 32, at 850: from there the step to
    # 64 paid (elasticity 0.15), so 32 alone was a lucky window, and the curve runs on
    lucky = curve([*by_power, (30.0, 850.0, 0.08, 0.03)])
    assert [p.concurrency for p in lucky.kept()[0]] == [30.0, 32.0, 64.0]
    assert lucky.knee() == (64.0, True)
    # where 30 reads as 32 did, the decline holds from both
    agreeing = curve([*by_power, (30.0, 1000.0, 0.08, 0.03)])
    assert agreeing.kept() == ([agreeing.kept()[0][0], agreeing.kept()[0][1]], True)
    assert agreeing.knee() == (32.0, False)
    # the same for a decline by throughput: 23% under a once-read 1,300, but not under 1,100
    # read just under it (the step from there does not pay either: a plateau, no decline)
    by_tput = [(32.0, 1300.0, 0.08, 0.03), (64.0, 1000.0, 0.08, 0.03)]
    assert curve(by_tput).kept()[1] is True
    assert curve([*by_tput, (30.0, 1100.0, 0.08, 0.03)]).kept()[1] is False
    assert curve([*by_tput, (30.0, 1300.0, 0.08, 0.03)]).kept()[1] is True


def test_a_decline_read_by_one_window_fades_as_a_breach_does() -> None:
    # noisy-gentle-3x, seed 94: 118 read once in a slow spell, 24% under 60's fast spell,
    # held the knee at 64 and the limit under it for the run: nothing read 118 again
    def curve(readings: list[tuple[float, float, float]]) -> Curve:
        c = Curve(KneeConfig())
        for lvl, tput, end in readings:
            c.learn(summary(end=end, inflight=lvl, max_inflight=lvl, throughput=tput), lvl, False)
        return c

    once = [(60.0, 1341.0, 5.0), (64.0, 1247.0, 10.0), (118.0, 1017.0, 15.0)]
    assert curve(once).kept()[1] is True
    # windows under it, within `objective_memory` (30 s) of its reading, keep it
    within = curve([*once, (60.0, 1300.0, 45.0)])
    assert within.kept()[1] is True
    assert within.knee() == (64.0, False)
    # past it, it fades: the curve runs on, and the limit may measure 118 again
    after = curve([*once, (60.0, 1300.0, 45.1)])
    assert after.kept()[1] is False
    assert [p.concurrency for p in after.kept()[0]] == [60.0, 64.0]
    # a decline read by two windows stays for `memory`
    twice = curve([*once, (118.0, 1017.0, 20.0), (60.0, 1300.0, 60.0)])
    assert twice.kept()[1] is True


def test_a_decline_is_judged_from_references_read_within_objective_memory() -> None:
    # noisy-gentle-3x, seed 22: 30 and 32 read early in a fast spell, the levels near 64 read
    # for 100 s after with TPOT doubled: power under half of 30's, a decline that held the
    # limit at 63-73 while a fixed 110 serves best. Nothing read 30 or 32 again
    lo, hi, top = (0.08, 0.03), (0.3, 0.065), (0.5, 0.1)  # (TTFT p90, TPOT p50)

    def curve(readings: list[tuple[float, float, tuple[float, float], float]]) -> Curve:
        c = Curve(KneeConfig())
        for lvl, tput, (ttft, tpot), end in readings:
            w = summary(end=end, inflight=lvl, max_inflight=lvl, throughput=tput,
                        ttft_p90=ttft, tpot_p50=tpot)
            c.learn(w, lvl, False)
        return c

    # 64 declined by power from 32 (and from 30 under it); 110, one window, paid from 64
    climb = [(30.0, 1000.0, lo, 5.0), (32.0, 1000.0, lo, 10.0), (64.0, 1000.0, hi, 15.0),
             (110.0, 1250.0, top, 20.0)]
    # the limit under the knee re-reads 64; 32, read 30 s before, is still a reference
    within = curve([*climb, (64.0, 1000.0, hi, 40.0)])
    assert within.knee() == (32.0, False)
    # past `objective_memory` 30 and 32 are kept levels, no reference: 64's power is the best,
    # 110's is not under half of it, and the curve runs on (the fit's knee past 110)
    after = curve([*climb, (64.0, 1000.0, hi, 40.1)])
    assert [p.concurrency for p in after.kept()[0]] == [30.0, 32.0, 64.0, 110.0]
    knee, rising = after.knee()
    assert knee is not None and knee > 110.0 and rising
    # a fresh reading at 32 is a reference again, and the decline holds
    reread = curve([*climb, (64.0, 1000.0, hi, 40.1), (32.0, 1000.0, lo, 45.0)])
    assert reread.knee() == (32.0, False)
