"""The soak, opt-in (`pytest -m slow tests/bench/test_soak.py`, about two minutes)."""

from __future__ import annotations

import pytest

from kneegate_bench.soak import parser, report, run_soak

pytestmark = pytest.mark.slow


def test_ten_times_overload_for_90_s_leaks_nothing_and_counts_everything() -> None:
    res = run_soak(parser().parse_args(["--seconds", "90", "--sample-every", "10"]))
    report(res)
    assert res.failures == []
    assert res.answers.get("200", 0) > 0 and res.answers.get("hung_up", 0) > 0
    assert res.answers.get("429", 0) + res.answers.get("503", 0) > res.answers["200"]
    assert res.scrapes >= 80
