"""The metrics' hot-path children (gateway/observability/metrics.py `_fast`): the same samples as
prometheus_client's own `inc` and `observe`, or prometheus' own child when its inside is
not what `_fast` was written against."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram

from kneegate.controllers.base import Outcome
from kneegate.gateway.observability.metrics import (
    GatewayMetrics,
    _fast,
    _FastCounter,
    _FastHistogram,
)

BOUNDS = (0.01, 0.05, 1.0)
VALUES = (0.0, 0.01, 0.010001, 0.05, 0.3, 1.0, 7.0, math.inf, -1.0)


def _samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in registry.collect():
        for s in family.samples:
            if not s.name.endswith("_created"):
                out[s.name, tuple(sorted(s.labels.items()))] = s.value
    return out


def _pair(kind: type[Counter] | type[Histogram]) -> tuple[CollectorRegistry, object,
                                                           CollectorRegistry, object]:
    regs = CollectorRegistry(), CollectorRegistry()
    kw = {"buckets": BOUNDS} if kind is Histogram else {}
    plain = kind("x", "x", ["up"], registry=regs[0], **kw).labels("a")
    fast = _fast(kind("x", "x", ["up"], registry=regs[1], **kw).labels("a"))
    return regs[0], plain, regs[1], fast


def test_a_fast_histogram_child_has_prometheus_samples_at_bounds_and_beyond() -> None:
    plain_reg, plain, fast_reg, fast = _pair(Histogram)
    assert isinstance(fast, _FastHistogram)
    for v in VALUES:
        plain.observe(v)  # type: ignore[attr-defined]
        fast.observe(v)
    assert _samples(fast_reg) == _samples(plain_reg)


def test_nan_goes_to_the_sum_only_as_in_prometheus() -> None:
    plain_reg, plain, fast_reg, fast = _pair(Histogram)
    plain.observe(math.nan)  # type: ignore[attr-defined]
    fast.observe(math.nan)
    p, f = _samples(plain_reg), _samples(fast_reg)
    assert p.keys() == f.keys()
    for key, value in p.items():
        assert math.isnan(f[key]) if math.isnan(value) else f[key] == value, key


def test_a_fast_counter_child_counts_like_prometheus_and_refuses_a_decrease() -> None:
    plain_reg, plain, fast_reg, fast = _pair(Counter)
    assert isinstance(fast, _FastCounter)
    for amount in (1, 2.5, 0):
        plain.inc(amount)  # type: ignore[attr-defined]
        fast.inc(amount)
    assert _samples(fast_reg) == _samples(plain_reg)
    with pytest.raises(ValueError):
        fast.inc(-1)


def test_a_child_of_another_inside_is_left_as_prometheus_made_it() -> None:
    child = Counter("x", "x", ["up"], registry=CollectorRegistry()).labels("a")
    child._value = object()  # say, the multiprocess value, or a newer prometheus_client
    assert _fast(child) is child


def test_count_finished_moves_the_series_of_its_upstream_and_outcome() -> None:
    reg = CollectorRegistry()
    m = GatewayMetrics(reg)
    m.count_finished("up", Outcome.OK, 0.2, 0.01, 16)
    m.count_finished("up", Outcome.TIMEOUT, None, None, 0)
    m.count_finished("up", Outcome.OK, 0.3, None, 4)
    get = reg.get_sample_value
    assert get("kneegate_requests_finished_total", {"upstream": "up", "outcome": "completed"}) == 2
    assert get("kneegate_requests_finished_total",
               {"upstream": "up", "outcome": "upstream_error"}) == 1
    assert get("kneegate_upstream_failures_total", {"upstream": "up", "kind": "timeout"}) == 1
    assert get("kneegate_upstream_failures_total", {"upstream": "up", "kind": "error"}) is None
    assert get("kneegate_ttft_seconds_count", {"upstream": "up"}) == 2
    assert get("kneegate_ttft_seconds_sum", {"upstream": "up"}) == pytest.approx(0.5)
    assert get("kneegate_ttft_seconds_bucket", {"upstream": "up", "le": "0.25"}) == 1
    assert get("kneegate_tpot_seconds_count", {"upstream": "up"}) == 1
    assert get("kneegate_output_tokens_total", {"upstream": "up"}) == 20
