"""The controller contract: samples and ticks in, one number (`limit`) out.

A controller never reads a clock, sleeps, or does I/O. Time arrives as data
(`Sample.admitted_at`, `on_tick(now)`), so the same object runs live in the
gateway and in virtual time inside `kneegate.sim`.

`LimitController` is a template (Netflix's AbstractLimit): subclasses implement
`_on_sample` / `_on_tick` and call `_set_limit`, which clamps to
[min_limit, max_limit] and rounds, so every algorithm honours the bounds by
construction.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = [
    "BaseControllerConfig",
    "Controller",
    "EngineStats",
    "LimitController",
    "Outcome",
    "Sample",
    "engine_ttft_objective",
    "is_distress",
]

def engine_ttft_objective(user_objectives: Iterable[float]) -> float:
    """The TTFT objective a controller holds the engine to (from dispatch), given the
    classes' objectives for their users (from arrival): the tightest of them. The gateway
    applies it where a controller's params leave `ttft_objective` out; so does the
    simulator. A user's first token comes after the wait and the engine's TTFT; the queue
    admits a request only if the predicted wait plus the engine's expected TTFT fits
    (admission/wait.py), so the wait has its own bound.

    The whole objective, not a share of it: held to a share, a drain window's answers,
    admitted at a burst's peak, read as a breach and cut the limit, and on real vLLM a
    share gained nothing beyond the runs' noise (measured: docs/history/benchmarks.md,
    "kneegate's limit at 3x on real vLLM")."""
    return min(user_objectives)


class Outcome(enum.Enum):
    """How one admitted request ended. Exactly one per admitted request."""

    OK = "ok"
    UPSTREAM_ERROR = "upstream_error"  # 5xx other than overload, broken connection
    TIMEOUT = "timeout"  # connect / first-byte / idle timeout
    CLIENT_CANCELLED = "client_cancelled"  # the caller went away: never a latency sample
    UPSTREAM_OVERLOADED = "upstream_overloaded"  # engine said 429/503: a drop signal
    CLIENT_STALLED = "client_stalled"  # the caller stopped reading: never a latency sample

    def __init__(self, value: str) -> None:
        # plain attributes, not properties: read on every request
        # True when the caller, not the engine, ended the request: never a sample
        self.is_client = value in ("client_cancelled", "client_stalled")
        # True for outcomes that mean the engine is past what it can take
        self.is_drop = value in ("timeout", "upstream_overloaded")


@dataclass(frozen=True, slots=True)
class Sample:
    """One finished request, as the gateway saw it. Times in seconds."""

    admitted_at: float  # when the request was dispatched to the upstream
    duration: float  # dispatch to last byte (or to the error)
    ttft: float | None  # dispatch to first token; None when not streamed
    prompt_tokens: int
    output_tokens: int
    inflight_at_admit: int  # in-flight count at this upstream, this request included
    outcome: Outcome = Outcome.OK

    @property
    def finished_at(self) -> float:
        return self.admitted_at + self.duration

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first: (duration - ttft) / (output_tokens - 1)."""
        if self.ttft is None or self.output_tokens < 2:
            return None
        return max(0.0, self.duration - self.ttft) / (self.output_tokens - 1)


@dataclass(frozen=True, slots=True)
class EngineStats:
    """What the engine reports about itself (vLLM's /metrics), scraped at `at`."""

    at: float
    running: float
    waiting: float
    kv_cache_usage: float  # 0..1
    preemptions_total: float  # monotonic counter
    generation_tokens_total: float = math.nan  # monotonic counter, NaN when unknown
    kv_capacity_tokens: float = math.nan  # the KV cache's size in tokens, NaN when unknown
    # vLLM's request_queue_time_seconds histogram: seconds its requests spent waiting in
    # its own queue, summed, and how many left it (monotonic; NaN when not exposed)
    queue_time_sum: float = math.nan
    queue_time_count: float = math.nan
    # vLLM's inter_token_latency_seconds histogram: the gaps between each request's
    # successive tokens (never its first: prefill is not in it), summed, and how many
    # (monotonic; NaN when not exposed)
    itl_sum: float = math.nan
    itl_count: float = math.nan


def is_distress(prev: EngineStats | None, cur: EngineStats) -> bool:
    """Engine distress between two scrapes: preemptions rose, or requests wait in the
    engine's own queue and that queue is not draining (waiting > 0 now and before, and
    not fewer than before). One scrape with a few waiting is admission jitter, not load."""
    if prev is None:
        return False
    if cur.preemptions_total > prev.preemptions_total:
        return True
    return cur.waiting > 0 and prev.waiting > 0 and cur.waiting >= prev.waiting


@runtime_checkable
class Controller(Protocol):
    """What the gateway and the simulator need from any concurrency limiter."""

    @property
    def limit(self) -> int: ...

    # where the controller believes the throughput curve bends (requests in flight), or
    # None when it has no estimate (or learns no curve): shown in status and metrics
    knee_estimate: float | None

    def on_sample(self, sample: Sample) -> None: ...

    def on_tick(self, now: float, inflight: int) -> None: ...

    def on_engine_stats(self, stats: EngineStats) -> None: ...

    def on_admit(self, prompt_tokens: int) -> None:
        """A request was admitted to this upstream with about this many prompt tokens.

        An estimate (the gateway's is its body's bytes / 4, JSON included): use ratios of
        sizes, or put it into tokens by a learned ratio (finished requests' prompt tokens,
        from the engine's usage, over their estimates), never the raw number alone."""
        ...

    def on_arrival(self, prompt_tokens: int) -> None:
        """A request that this upstream may serve joined the gateway's queue (or was admitted
        at once), with about this many prompt tokens: the same estimate as `on_admit`, seconds
        earlier under overload, when the queue ahead still holds older requests."""
        ...

    def fits(self, inflight: int, inflight_tokens: int, tokens: int) -> bool:
        """May one more request of about `tokens` prompt tokens join the `inflight` requests
        (whose estimates sum to `inflight_tokens`) on this upstream? A token budget beside
        `limit`, for a controller that knows what the engine's memory holds; the same
        estimates as `on_admit`. Asked only while in-flight is under `limit` and not zero."""
        ...

    def state(self) -> dict[str, Any]: ...


class BaseControllerConfig(BaseModel):
    """Bounds and objectives every controller shares."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    initial: int = Field(16, ge=1, description="limit before any evidence")
    min_limit: int = Field(1, ge=1, description="never go below this")
    max_limit: int = Field(1024, ge=1, description="never go above this")
    ttft_objective: float = Field(2.0, gt=0, description="TTFT target, seconds")
    tpot_objective: float = Field(0.1, gt=0, description="time per output token target, seconds")

    @model_validator(mode="after")
    def _bounds_are_ordered(self) -> BaseControllerConfig:
        if not self.min_limit <= self.initial <= self.max_limit:
            raise ValueError(
                f"need min_limit <= initial <= max_limit, got "
                f"{self.min_limit} <= {self.initial} <= {self.max_limit}"
            )
        return self


class LimitController:
    """Template base: clamping, rounding and the cancelled-is-no-sample rule live here."""

    name = "base"
    # learns its limit from traffic: a gateway may admit past it until the engine shows
    # saturation (`admission.slow_start`)
    adaptive = True

    def __init__(self, cfg: BaseControllerConfig) -> None:
        self.cfg = cfg
        self._limit = float(cfg.initial)
        self.knee_estimate: float | None = None

    @property
    def limit(self) -> int:
        return max(self.cfg.min_limit, min(self.cfg.max_limit, math.floor(self._limit)))

    def _set_limit(self, value: float) -> None:
        self._limit = max(float(self.cfg.min_limit), min(float(self.cfg.max_limit), value))

    def on_sample(self, sample: Sample) -> None:
        # A cancellation says nothing about the engine (Netflix's onIgnore).
        if sample.outcome.is_client:
            return
        self._on_sample(sample)

    def on_tick(self, now: float, inflight: int) -> None:
        self._on_tick(now, inflight)

    def on_engine_stats(self, stats: EngineStats) -> None:
        self._on_engine_stats(stats)

    def on_admit(self, prompt_tokens: int) -> None:
        """An admission's prompt size estimate; ignored unless a subclass uses it."""

    def on_arrival(self, prompt_tokens: int) -> None:
        """An arrival's prompt size estimate; ignored unless a subclass uses it."""

    def fits(self, inflight: int, inflight_tokens: int, tokens: int) -> bool:
        """No token budget unless a subclass keeps one: `limit` alone decides."""
        return True

    def state(self) -> dict[str, Any]:
        return {"name": self.name, "limit": self.limit, "knee_estimate": self.knee_estimate}

    def breaches(self, s: Sample) -> bool:
        """True when the sample misses the TTFT or TPOT objective."""
        if s.ttft is not None and s.ttft > self.cfg.ttft_objective:
            return True
        tpot = s.tpot
        return tpot is not None and tpot > self.cfg.tpot_objective

    # Hooks for subclasses; the defaults ignore the signal.
    def _on_sample(self, sample: Sample) -> None:
        pass

    def _on_tick(self, now: float, inflight: int) -> None:
        pass

    def _on_engine_stats(self, stats: EngineStats) -> None:
        pass
