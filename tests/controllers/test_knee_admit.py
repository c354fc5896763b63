"""knee's leading signal: prompt sizes at admission rescale the limit before samples say so."""

from __future__ import annotations

import random

import pytest
from helpers.controllers import make_sample, window

from kneegate.controllers import (
    CONTROLLERS,
    Controller,
    EngineStats,
    Knee,
    KneeConfig,
    build_controller,
)


def settled(initial: int = 40) -> Knee:
    """A knee past two windows at `initial` (100-token prompts and answers) and 200
    admissions of 100-token prompts: the learned prompt size is 100."""
    ctl = Knee(KneeConfig(initial=initial, max_limit=initial, window=5.0, probe_every=100))
    t = 0.0
    for _ in range(2):
        t = window(ctl, t, initial, 800.0)
    for _ in range(200):
        ctl.on_admit(100)
    return ctl


def test_a_4x_prompt_jump_cuts_the_limit_within_a_few_admissions() -> None:
    ctl = settled()
    before = ctl.limit
    limits = []
    for _ in range(6):
        ctl.on_admit(400)
        limits.append(ctl.limit)
    # footprint (prompt + half the 100-token answer) grows from 150 to 450: x3. Over a
    # learned mean of 200 admissions the 20-admission mean tells the shift on the 4th; the
    # plain mean of the last 4 (all 400) sizes it (an EWMA over 4 cut x2.26; a learned
    # mean of 30, which moved with the new sizes, cut on the 5th by x2.6)
    assert before == 40
    assert limits == [40, 40, 40, 13, 13, 13]
    for _ in range(40):
        ctl.on_admit(400)
    assert ctl.limit == 13  # the next 8 admissions are the size the cut used: no second cut


def test_samples_admitted_before_the_rescale_are_no_measurement() -> None:
    ctl = settled()
    ctl.on_tick(10.0, 40)
    for _ in range(10):
        ctl.on_admit(400)
    assert ctl.limit < 40
    cut = ctl.limit
    # a window of old, small requests finishing fast says nothing of the new sizes
    window(ctl, 10.0, 40, 800.0)
    assert ctl.limit <= cut


@pytest.mark.parametrize("jitter", [0.0, 0.2])
def test_constant_or_jittering_prompts_never_move_the_limit(jitter: float) -> None:
    ctl = settled()
    rng = random.Random(3)
    for _ in range(5000):
        ctl.on_admit(round(100 * rng.uniform(1 - jitter, 1 + jitter)))
        assert ctl.limit == 40


def test_twenty_admissions_20pct_larger_in_a_row_are_no_shift() -> None:
    ctl = settled()
    for _ in range(200):
        ctl.on_admit(120)
    assert ctl.limit == 40


def test_one_huge_prompt_is_no_shift() -> None:
    ctl = settled()
    ctl.on_admit(100_000)
    for _ in range(5):
        ctl.on_admit(100)
    assert ctl.limit == 40


def test_shrinking_prompts_leave_the_limit_to_probing() -> None:
    ctl = settled()
    for _ in range(100):
        ctl.on_admit(25)
    assert ctl.limit == 40  # no jump up: growth needs evidence the engine takes more


def test_estimates_twice_the_tokens_cut_as_deep_as_tokens() -> None:
    # the gateway's bytes/4 reads 2x the engine's count; finished prompts put it into tokens
    true = settled()
    ctl = Knee(KneeConfig(initial=40, max_limit=40, window=5.0, probe_every=100))
    t = 0.0
    for _ in range(2):
        t = window(ctl, t, 40, 800.0)
    for _ in range(200):
        ctl.on_admit(200)
    for _ in range(10):
        ctl.on_sample(make_sample(prompt_tokens=100))
    for _ in range(30):
        ctl.on_admit(800)
        true.on_admit(400)
    assert ctl.limit == true.limit == 13


def test_a_cut_sized_short_is_cut_deeper_by_the_next_admissions() -> None:
    ctl = settled()
    for p in (400, 400, 400, 100, 100, 100, 100):
        ctl.on_admit(p)
    assert ctl.limit == 40  # a short run of large prompts: the slow mean stays under x1.3
    limits = []
    for _ in range(10):
        ctl.on_admit(400)
        limits.append(ctl.limit)
    # the first cut is sized by a last-4 mean that still holds two 100s (x1.9); the 8
    # admissions after it are all 400: the footprint they show is x1.5 the one it assumed
    assert limits == [40, 21, 21, 21, 21, 21, 21, 21, 21, 14]


def test_admissions_smaller_than_the_cut_assumed_never_raise_it() -> None:
    ctl = settled()
    for _ in range(5):
        ctl.on_admit(400)
    assert ctl.limit == 13
    for _ in range(9):
        ctl.on_admit(150)
        assert ctl.limit == 13  # growth needs evidence the engine takes more: probing


def _settled_long_answers() -> tuple[Knee, float]:
    """As `settled`, but answers are 300 tokens: the footprint is prompt + 150."""
    ctl = Knee(KneeConfig(initial=40, max_limit=40, window=5.0, probe_every=100))
    t = 0.0
    for _ in range(2):
        t = window(ctl, t, 40, 800.0, out=300)
    for _ in range(200):
        ctl.on_admit(100)
    return ctl, t


@pytest.mark.parametrize("engine_windows", [False, True])
def test_windows_without_samples_leave_the_answer_length(engine_windows: bool) -> None:
    ctl, t = _settled_long_answers()
    if engine_windows:
        # 20 s of engine scrapes and no request finished: windows close on the counters
        # alone; their mean answer is no reading (it read 0 and halved the answer length)
        gen = 0.0
        for _ in range(40):
            t, gen = t + 0.5, gen + 400.0
            ctl.on_engine_stats(EngineStats(t, 40, 0, 0.5, 0, gen))
            ctl.on_tick(t, 40)
    limits = []
    for _ in range(12):
        ctl.on_admit(400)
        limits.append(ctl.limit)
    # (400 + 150) / (100 + 150): the shift shows on the 8th admission either way (x2.1: the
    # admitted mean that puts estimates into tokens already holds 8 of the 400s)
    assert limits == [40] * 7 + [19] * 5


@pytest.mark.parametrize("name", sorted(CONTROLLERS))
def test_every_controller_takes_on_admit(name: str) -> None:
    ctl = build_controller(name, {})
    assert isinstance(ctl, Controller)
    if name != "knee":
        before = ctl.limit
        for p in (100, 400, 1600, 6400):
            ctl.on_admit(p)
        assert ctl.limit == before
