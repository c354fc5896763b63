"""Builders for controller tests: literal samples, whole windows, engine scrapes."""

from __future__ import annotations

from typing import Any

from kneegate.controllers import EngineStats, LimitController, Outcome, Sample


def make_sample(**overrides: Any) -> Sample:
    """A healthy 100-token request admitted at t=0 with 16 in flight; override any field."""
    fields: dict[str, Any] = {
        "admitted_at": 0.0,
        "duration": 2.0,
        "ttft": 0.2,
        "prompt_tokens": 100,
        "output_tokens": 100,
        "inflight_at_admit": 16,
        "outcome": Outcome.OK,
    }
    fields.update(overrides)
    return Sample(**fields)


def feed(ctl: LimitController, n: int, **overrides: Any) -> int:
    """Feed `n` identical samples; return the limit after the last one."""
    for _ in range(n):
        ctl.on_sample(make_sample(**overrides))
    return ctl.limit


def window(
    ctl: LimitController,
    t: float,
    inflight: int,
    throughput: float,
    *,
    n: int = 8,
    span: float = 5.0,
    ttft: float | None = 0.2,
    out: int = 100,
    **overrides: Any,
) -> float:
    """One whole window at `inflight` whose Little's-law throughput is `throughput` tok/s.

    Every sample has `out` tokens and lasts inflight * out / throughput seconds, so
    inflight * sum(tokens) / sum(duration) == throughput. Returns the window's end time.
    """
    duration = inflight * out / throughput
    ctl.on_tick(t, inflight)
    for i in range(n):
        end = t + span * (i + 1) / (n + 1)
        ctl.on_sample(
            make_sample(
                admitted_at=end - duration,
                duration=duration,
                ttft=ttft,
                output_tokens=out,
                inflight_at_admit=inflight,
                **overrides,
            )
        )
    ctl.on_tick(t + span, inflight)
    return t + span


def scrape(
    at: float,
    *,
    running: float = 8,
    waiting: float = 0,
    preemptions: float = 0,
    tokens: float = float("nan"),
    kv: float = 0.5,
    capacity: float = float("nan"),
) -> EngineStats:
    return EngineStats(
        at=at,
        running=running,
        waiting=waiting,
        kv_cache_usage=kv,
        preemptions_total=preemptions,
        generation_tokens_total=tokens,
        kv_capacity_tokens=capacity,
    )
