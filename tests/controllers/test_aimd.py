from __future__ import annotations

import pytest
from helpers.controllers import feed, make_sample, scrape
from pydantic import ValidationError

from kneegate.controllers import Aimd, AimdConfig, Outcome


def make(**cfg: object) -> Aimd:
    return Aimd(AimdConfig(**{"initial": 30, **cfg}))


def test_grows_by_one_per_healthy_sample() -> None:
    ctl = make()
    assert feed(ctl, 3, inflight_at_admit=30) == 33


def test_backs_off_on_ttft_breach() -> None:
    ctl = make()
    ctl.on_sample(make_sample(ttft=5.0, inflight_at_admit=30))  # objective is 2.0 s
    assert ctl.limit == 27


def test_backs_off_on_tpot_breach_not_on_long_answers() -> None:
    ctl = make()
    # 1000 tokens in 20 s is 20 ms per token: a long answer, not congestion
    ctl.on_sample(make_sample(duration=20.0, output_tokens=1000, inflight_at_admit=30))
    assert ctl.limit == 31
    # 100 tokens in 20 s is 200 ms per token: over the 100 ms objective
    ctl.on_sample(make_sample(duration=20.0, output_tokens=100, inflight_at_admit=30))
    assert ctl.limit == 27


@pytest.mark.parametrize(
    "outcome", [Outcome.TIMEOUT, Outcome.UPSTREAM_OVERLOADED, Outcome.UPSTREAM_ERROR]
)
def test_backs_off_on_drop_or_error(outcome: Outcome) -> None:
    ctl = make()
    ctl.on_sample(make_sample(outcome=outcome, ttft=None))
    assert ctl.limit == 27


def test_one_decrease_per_round() -> None:
    ctl = make()
    ctl.on_sample(make_sample(admitted_at=0.0, duration=5.0, ttft=5.0))  # cut at t=5
    ctl.on_sample(make_sample(admitted_at=1.0, duration=5.0, ttft=5.0))  # admitted before: no cut
    assert ctl.limit == 27
    ctl.on_sample(make_sample(admitted_at=6.0, duration=5.0, ttft=5.0))  # a new round
    assert ctl.limit == 24


def test_holds_while_app_limited() -> None:
    ctl = make()
    assert feed(ctl, 10, inflight_at_admit=14) == 30  # 14 * 2 < 30


def test_cancellation_is_no_sample() -> None:
    ctl = make()
    assert feed(ctl, 5, outcome=Outcome.CLIENT_CANCELLED, ttft=9.0, inflight_at_admit=30) == 30


def test_clamps_to_bounds() -> None:
    ctl = make(initial=21, max_limit=21, min_limit=20)
    assert feed(ctl, 1, inflight_at_admit=21) == 21
    ctl.on_sample(make_sample(ttft=5.0))
    assert ctl.limit == 20


def test_distress_cuts_once_per_cooldown() -> None:
    ctl = make()
    ctl.on_engine_stats(scrape(0.0, waiting=2))
    ctl.on_engine_stats(scrape(1.0, waiting=3))  # waiting and not draining: cut
    assert ctl.limit == 27
    ctl.on_engine_stats(scrape(2.0, waiting=4))  # within the 2 s cooldown
    assert ctl.limit == 27
    ctl.on_engine_stats(scrape(3.0, waiting=5, preemptions=1))
    assert ctl.limit == 24


def test_draining_engine_queue_is_not_distress() -> None:
    ctl = make()
    ctl.on_engine_stats(scrape(0.0, waiting=5))
    ctl.on_engine_stats(scrape(1.0, waiting=2))
    assert ctl.limit == 30


def test_backoff_range_is_checked() -> None:
    with pytest.raises(ValidationError, match="backoff"):
        AimdConfig(backoff=0.3)
