"""knee at the KV-cache edge: arrivals lead, and the limit follows the engine's free KV."""

from __future__ import annotations

import pytest
from helpers.controllers import make_sample, scrape, window

from kneegate.controllers import Knee, KneeConfig

# These engines' answers run at ~50 ms a token (100 tokens over a 5 s life), within two
# climb steps of the default TPOT objective's aim (`steps.in_step`); the KV edge, not
# TPOT, is what these tests read, so their objective is one that does not bind.
LOOSE_TPOT = 1.0


def settled(initial: int = 40) -> Knee:
    """Two windows at `initial` (100-token prompts and answers), 200 arrivals of 100."""
    ctl = Knee(KneeConfig(initial=initial, max_limit=initial, window=5.0, probe_every=100))
    t = 0.0
    for _ in range(2):
        t = window(ctl, t, initial, 800.0, n=10)  # 20 finishes: tokens per estimate learnt
    for _ in range(200):
        ctl.on_admit(100)
        ctl.on_arrival(100)
    return ctl


def test_arrivals_tell_a_prompt_jump_before_any_admission() -> None:
    ctl = settled()
    limits = []
    for _ in range(5):
        ctl.on_arrival(400)
        limits.append(ctl.limit)
    # the same rule as at admission (footprint x3: 150 -> 450), seconds earlier under load
    assert limits == [40, 40, 40, 13, 13]


def test_admissions_are_not_read_twice_once_arrivals_are() -> None:
    ctl = settled()
    for _ in range(40):
        ctl.on_admit(400)  # the requests that arrived before the jump, now admitted
    assert ctl.limit == 40


def kv_ready() -> Knee:
    """A knee that knows 100-token prompts and answers and an engine whose KV holds 3000
    tokens: 10 running at half the cache, 10 x (100 + 50) / 0.5."""
    ctl = settled()
    ctl.on_engine_stats(scrape(1.0, running=10, kv=0.5))
    return ctl


def test_the_limit_fills_the_free_kv_with_new_requests() -> None:
    ctl = kv_ready()
    # free: (0.98 - 0.5) x 3000 - 100 (one answer's growth) - 100 (half a new request's
    # peak, kept in reserve) = 1240 tokens; a new request peaks at 100 + 100: 6 more than
    # the 10 running
    assert ctl.limit == 16
    ctl.on_engine_stats(scrape(2.0, running=10, kv=0.9))
    assert ctl.limit == 10  # (0.98 - 0.9) x 3000 - 100 - 100 = 40: no room for another


def test_a_finish_frees_its_own_footprint_before_the_next_scrape() -> None:
    ctl = kv_ready()
    ctl.on_sample(make_sample(admitted_at=0.0, duration=1.5))  # 100 + 100: one slot back
    assert ctl.limit == 16
    # a small one (20 + 30 tokens) frees a quarter of what a new request needs
    ctl.on_sample(make_sample(admitted_at=0.0, duration=1.6, prompt_tokens=20, output_tokens=30))
    assert ctl.limit == 15


def test_a_scrape_that_saw_a_preemption_teaches_no_capacity() -> None:
    ctl = kv_ready()
    for n in range(1, 11):  # a storm: 10 running fill the cache while preempting
        ctl.on_engine_stats(scrape(1.0 + n, running=10, kv=1.0, preemptions=n))
    ctl.on_engine_stats(scrape(12.0, running=10, kv=0.5, preemptions=10))
    # the capacity is still 3000 tokens (read from those scrapes it would fall toward 1500
    # and the limit to 14)
    assert ctl.limit == 16


def test_the_kv_edge_lifts_the_limit_only_where_the_cache_is_nearly_full() -> None:
    # a 3000-token cache, 150 tokens a request: 6 running use 30%, the engine holds 20
    ctl = Knee(KneeConfig(
        initial=6, max_limit=40, window=5.0, probe_every=100, tpot_objective=LOOSE_TPOT
    ))
    t = 0.0
    for _ in range(2):
        ctl.on_engine_stats(scrape(t + 1, running=6, kv=0.3))
        t = window(ctl, t, 6, 120.0, n=10)
    for _ in range(200):
        ctl.on_arrival(100)
        ctl.on_admit(100)
    ctl.on_engine_stats(scrape(t + 1, running=6, kv=0.3))
    base = ctl.limit
    assert base == 12  # the window's climb
    # 10 running at half the cache: 6 more fit, but a cache this empty is not what holds
    # the engine back (H100: a queue of prefills at 37% KV read as room for 500 more)
    ctl.on_engine_stats(scrape(t + 2, running=10, kv=0.5))
    assert ctl.limit == base
    # at 76% the cache is the edge: its free KV sets the limit, past the window's
    ctl.on_engine_stats(scrape(t + 3, running=15, kv=0.76))
    assert ctl.limit == 17


def test_the_token_budget_weighs_each_request_by_its_own_prompt() -> None:
    ctl = kv_ready()
    assert ctl.fits(10, 10_000, 10_000)  # the engine has not said how large its cache is
    assert ctl.state()["token_budget"] is None
    ctl.on_engine_stats(scrape(2.0, running=10, kv=0.5, capacity=3000))
    assert ctl.state()["token_budget"] == 2850
    # 0.95 x 3000 = 2850 tokens: prompts as estimated (100 estimated per 100 finished) plus
    # the 50 tokens of answer each running request holds (E[o^2] / 2 E[o], all answers 100)
    assert ctl.fits(10, 1000, 100)  # 1100 + 11 x 50 = 1650
    assert ctl.fits(10, 2000, 300)  # 2300 + 550 = 2850: at the budget
    assert not ctl.fits(10, 2000, 301)
    assert not ctl.fits(10, 1200, 1200)  # one large prompt where ten small ones run
    assert ctl.fits(3, 1200, 1200)  # the same beside three


def test_with_a_token_budget_the_kv_edge_keeps_no_reserve_for_large_requests() -> None:
    # at 85% of the cache, after the last finish: (0.98 - 0.85) x 3000 - 100 (an answer's
    # growth) = 290 tokens free. Blind, a new request counts its peak (200) and half a peak
    # in reserve (100): none fits. With the budget it counts what it holds on average, as
    # the budget does (100 + 50 held), and no reserve: one fits
    blind, budgeted = kv_ready(), kv_ready()
    blind.on_engine_stats(scrape(11.0, running=10, kv=0.85))
    budgeted.on_engine_stats(scrape(11.0, running=10, kv=0.85, capacity=3000))
    assert (blind.limit, budgeted.limit) == (10, 11)
    # a finish since the scrape frees its whole 200 tokens: blind, 390 free take one peak
    # in its place (10); with the budget, 490 free take three of 150 (12)
    for ctl in (blind, budgeted):
        ctl.on_sample(make_sample(admitted_at=9.0, duration=3.0))
    assert (blind.limit, budgeted.limit) == (10, 12)


def test_a_cache_holding_more_than_the_prompts_add_up_to_widens_the_budget() -> None:
    # prefix caching: the engine reports 1500 tokens of cache, yet 10 running requests of
    # 100 + 50 tokens fill only half of it (they share their prompts' prefix): the learned
    # capacity reads 10 x 150 / 0.5 = 3000. The budget counts what exceeds the noise of that
    # reading, 3000 / 1.25 = 2400 tokens of cache, not the 1500 the sizes would fill
    ctl = kv_ready()
    ctl.on_engine_stats(scrape(2.0, running=10, kv=0.5, capacity=1500))
    assert ctl.state()["token_budget"] == pytest.approx(0.95 * 2400)
    assert ctl.fits(10, 1000, 100)  # 1650 of 2280 (of 0.95 x 1500 = 1425 it would not)
    # a learned capacity within its noise of the reported size leaves the reported size
    ctl.on_engine_stats(scrape(3.0, running=10, kv=0.5, capacity=2500))
    assert ctl.state()["token_budget"] == pytest.approx(0.95 * 2500)


def test_beside_another_gateway_the_kv_edge_and_the_token_budget_are_its_share() -> None:
    # this gateway holds 10 of the engine's 20: its share is 1/2 (four gateways each held
    # the engine at 0.95 x its room by the share alone, and each floor lost half a request)
    ctl = Knee(KneeConfig(
        initial=10, max_limit=40, window=5.0, probe_every=100, tpot_objective=LOOSE_TPOT
    ))
    t = 0.0
    for _ in range(3):
        for i in range(5):
            ctl.on_engine_stats(scrape(t + i + 0.5, running=20, kv=0.5))
        t = window(ctl, t, 10, 200.0, n=10)
    for _ in range(200):
        ctl.on_arrival(100)
        ctl.on_admit(100)
    assert ctl.limit == 19  # 0.95 x the room of 40 x 1/2
    # 36 running fill a 5400-token cache: (0.98 - 1.0) x 5400 - 100 (an answer's growth)
    # = -208 tokens free, two requests of 100 + 50 too many: 34 in the engine at the edge,
    # this gateway's half of them 17 (before: the window's 19, the edge ignored)
    ctl.on_engine_stats(scrape(t + 0.5, running=36, kv=1.0, capacity=5400))
    assert ctl.limit == 17
    # the budget: half of 0.95 x 5400 = 2565 tokens, each request 100 + 50 held
    assert ctl.fits(16, 1600, 100)  # 1700 + 17 x 50 = 2550
    assert not ctl.fits(17, 1700, 100)  # 1800 + 18 x 50 = 2700: every request fitted before


def measured(capacity: float = 3000) -> tuple[Knee, float]:
    """A knee whose engine's room was measured: three windows of 10 running in half of a
    `capacity`-token cache (room 20), each request 100 + 100 tokens over a 5 s life."""
    ctl = Knee(KneeConfig(
        initial=10, max_limit=40, window=5.0, probe_every=100, tpot_objective=LOOSE_TPOT
    ))
    t = 0.0
    for _ in range(3):
        for i in range(5):
            ctl.on_engine_stats(scrape(t + i + 0.5, running=10, kv=0.5, capacity=capacity))
        t = window(ctl, t, 10, 200.0, n=10)  # 10 x 100 / 200 tok/s: each lives 5 s
    for _ in range(200):
        ctl.on_arrival(100)
        ctl.on_admit(100)
    return ctl, t


def test_after_the_engine_drains_a_burst_may_fill_the_whole_cache_for_one_life() -> None:
    ctl, t = measured()
    assert ctl.limit == 19  # 0.95 x the room of 20
    assert ctl.state()["token_budget"] == 2850  # 0.95 x 3000: no drain yet
    # demand fell away: 4 in flight under a limit of 19. The requests that come next are a
    # burst's, younger than the mix the budget's held answer (50 tokens each) stands for
    ctl.on_tick(t + 1, 4)
    assert ctl.state()["token_budget"] == 3000
    assert ctl.fits(10, 2000, 450)  # 2450 + 11 x 50 = 3000: the whole cache
    assert not ctl.fits(10, 2000, 451)
    # one life (5 s) later every request in flight came after the drain: the mix again
    ctl.on_tick(t + 6.5, 10)
    assert ctl.state()["token_budget"] == 2850
    assert not ctl.fits(10, 2000, 450)
    assert ctl.fits(10, 2000, 300)


def test_a_start_is_no_drain() -> None:
    # before the engine's room was measured (no scrape in a window yet), few in flight under
    # the limit is the start: the budget keeps its margin
    ctl = kv_ready()
    ctl.on_engine_stats(scrape(2.0, running=10, kv=0.5, capacity=3000))
    ctl.on_tick(3.0, 1)  # 1 in flight under a limit of 16
    assert ctl.state()["token_budget"] == 2850
    assert not ctl.fits(10, 2000, 301)
