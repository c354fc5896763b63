"""`Windowed`, the window template `gradient` and `knee` share."""

from __future__ import annotations

from dataclasses import replace

import pytest
from helpers.controllers import make_sample, scrape

from kneegate.controllers import BaseControllerConfig, GradientConfig, Outcome
from kneegate.controllers.window import Summary, Window, Windowed


class Recorder(Windowed):
    """Keeps every closed window's summary."""

    def __init__(self, **spans: float) -> None:
        super().__init__(BaseControllerConfig(), GradientConfig(**spans))
        self.closed: list[Summary] = []

    def _close(self, w: Summary) -> None:
        self.closed.append(w)


class Eager(Recorder):
    """Closes on two scrapes without a sample, as `knee` does on three."""

    def _quorum(self, w: Window) -> int:
        return 0 if len(w.stats) >= 2 else 10


class EagerKeeper(Eager):
    keeps_scrapes = True


def test_a_window_closes_once_old_enough_and_with_its_quorum() -> None:
    ctl = Recorder(window=5.0, min_samples=2, max_window=30.0)
    ctl.on_sample(make_sample(admitted_at=0.0, duration=1.0))  # opens the window at 1
    ctl.on_tick(5.0, 4)
    ctl.on_sample(make_sample(admitted_at=0.0, duration=5.5))
    assert ctl.closed == []  # 4 s old
    ctl.on_tick(6.0, 4)
    assert [(w.start, w.end, w.samples) for w in ctl.closed] == [(1.0, 6.0, 2)]


def test_without_a_quorum_a_window_waits_until_max_window_unless_trouble_came() -> None:
    ctl = Recorder(window=5.0, min_samples=10, max_window=30.0)
    ctl.on_tick(0.0, 4)
    ctl.on_tick(10.0, 4)
    assert ctl.closed == []
    ctl.on_sample(make_sample(admitted_at=9.0, duration=2.0, outcome=Outcome.TIMEOUT))
    ctl.on_tick(11.0, 4)
    assert [(w.end, w.drops) for w in ctl.closed] == [(11.0, 1)]


def test_distress_marks_the_open_window_and_plain_scrapes_open_none() -> None:
    ctl = Recorder(window=5.0, min_samples=10, max_window=30.0)
    ctl.on_engine_stats(scrape(0.0, waiting=2))
    ctl.on_engine_stats(scrape(1.0, waiting=3))  # a queue that is not draining: distress
    ctl.on_tick(6.0, 4)
    assert [(w.start, w.distress, w.engine_running) for w in ctl.closed] == [(1.0, True, None)]


def test_a_keeper_keeps_the_scrapes_led_by_the_last_one_before_its_window() -> None:
    ctl = Eager(window=5.0, min_samples=10, max_window=30.0)
    ctl.on_engine_stats(scrape(0.0, running=4))
    ctl.on_tick(6.0, 4)
    assert ctl.closed == []  # a plain scrape opens no window without keeps_scrapes

    keeper = EagerKeeper(window=5.0, min_samples=10, max_window=30.0)
    keeper.on_engine_stats(scrape(0.0, running=4))
    keeper.on_engine_stats(scrape(1.0, running=8))
    keeper.on_tick(5.0, 4)  # two scrapes: the quorum is 0
    keeper.on_engine_stats(scrape(7.0, running=12))
    keeper.on_tick(12.0, 4)
    assert [(w.start, w.engine_running) for w in keeper.closed] == [(0.0, 6.0), (7.0, 10.0)]


def test_the_last_reading_spans_at_least_three_quarters_of_a_second() -> None:
    # at 0.25 s a scrape's tokens/s swings with each step's batch: the last reading reaches
    # back to the last scrape 0.75 s before the last one; at 1 s, to the one before it
    keeper = EagerKeeper(window=5.0, min_samples=10, max_window=30.0)
    for i, tokens in enumerate([0.0, 10.0, 40.0, 50.0, 80.0, 90.0]):
        keeper.on_engine_stats(scrape(i * 0.25, running=8 + i, tokens=tokens))
    keeper.on_tick(5.0, 4)
    # from 0.5 s (40 tokens) to 1.25 s (90): 50 / 0.75 s; its last interval alone read 40
    assert keeper.closed[0].engine_last == (13, pytest.approx(50 / 0.75))


def test_busy_in_flight_is_the_mean_over_the_time_any_was_in_flight() -> None:
    w = Window(start=0.0, last_tick=0.0)
    w.tick(1.0, 6, 6)  # 6 in flight for 1 s
    w.tick(4.0, 0, 6)  # then 3 s empty
    s = w.summary(4.0)
    assert s.inflight == 1.5 and s.busy_inflight == 6.0
    steady = Window(start=0.0, last_tick=0.0)
    steady.tick(4.0, 5, 6)
    assert steady.summary(4.0).busy_inflight == steady.summary(4.0).inflight == 5.0


def test_the_engines_tpot_is_its_token_gaps_where_it_reports_them_else_running_per_token() -> None:
    # 8 running, 80 tokens/s: 0.1 s a token by the running count, although one of the 8 is
    # a long prompt still prefilling (no token yet) and the 7 decoding get one each 0.0875 s
    def window(gaps: tuple[float, float] | None) -> Summary:
        w = Window(start=0.0, last_tick=0.0)
        for at, tokens, n in ((0.0, 0.0, 0.0), (1.0, 80.0, 70.0)):
            st = scrape(at, running=8, tokens=tokens)
            if gaps is not None:
                st = replace(st, itl_sum=n * gaps[0], itl_count=n * gaps[1])
            w.stats.append(st)
        w.tick(1.0, 8, 8)
        return w.summary(1.0)

    assert window(None).engine_tpot == pytest.approx(0.1)
    assert window((0.0875, 1.0)).engine_tpot == pytest.approx(0.0875)
    # no gap between the first scrape and the last: the running count's reading
    assert window((0.0875, 0.0)).engine_tpot == pytest.approx(0.1)
