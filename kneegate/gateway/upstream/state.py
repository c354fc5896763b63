"""One engine as the pool holds it: `Upstream`, admission's `UpstreamState` (name,
controller, in-flight, usable) plus what the proxy, the probes and the status page need —
URL, config, health, the engine's scraped figures and the models it serves — so the pure
queue hands the proxy the very object it dispatched to.

What its states mean (healthy, confirmed, stalled, frozen, scraping) and what moves them:
gateway/upstream/pool.py, which owns them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kneegate.admission.types import UpstreamState
from kneegate.gateway.config.upstream import UpstreamConfig, public_url
from kneegate.gateway.upstream.telemetry import Progress, Telemetry

__all__ = ["BACKOFF_MAX", "BACKOFF_MIN", "Upstream"]

# a failed upstream is probed again after BACKOFF_MIN seconds, doubling to BACKOFF_MAX
BACKOFF_MIN, BACKOFF_MAX = 0.5, 8.0


@dataclass(slots=True, eq=False)
class Upstream(UpstreamState):
    """One engine: admission state plus URL, config, health and the engine's own stats."""

    url: str = ""
    config: UpstreamConfig | None = None
    backoff: float = BACKOFF_MIN
    next_probe_at: float = 0.0
    next_scrape_at: float = 0.0
    progress: Progress | None = None  # None when this upstream is not scraped
    scraping: bool | None = False  # scraped; None: detecting (see the module docstring)
    healthy: bool = True  # connects and answers /health
    stalled: bool = False  # scrapes show running requests and no new tokens for stall_after
    busy: bool = False  # a probe or scrape is running
    handing: int = 0  # slots dispatched whose caller has not resumed yet (see Gate)
    confirmed: bool = False  # answered a probe, a scrape or a request since start-up
    probe_error: str = ""  # why the last probe failed ("" when it answered 2xx)
    answered_at: float = -math.inf  # the last response byte from it (tick granularity)
    idle_at: float = -math.inf  # the last tick at which it had nothing in flight
    scrape_failures: int = 0  # scrapes in a row that timed out or failed
    frozen: bool = False  # failing scrapes and silent requests: see the module docstring
    models_stale: bool = False  # `models` to be read again at the next probe (it failed)

    @property
    def knee_estimate(self) -> float | None:
        knee = self.controller.knee_estimate
        return None if knee is None else float(knee)

    def telemetry(self, now: float) -> Telemetry | None:
        """The engine's scraped figures at `now`; None when this upstream is not scraped."""
        return None if self.progress is None else self.progress.view(now, self.stalled)

    def refresh_usable(self) -> None:
        self.usable = self.healthy and not self.stalled and not self.frozen

    def answered(self, now: float) -> None:
        """A response head arrived from it: it is reachable and making progress."""
        self.answered_at = now
        self.confirmed = True

    def status(self, now: float) -> dict[str, Any]:
        return {
            "name": self.name,
            "url": public_url(self.url),
            "usable": self.usable,
            "healthy": self.healthy,
            "confirmed": self.confirmed,
            "frozen": self.frozen,
            "limit": self.limit,
            "in_flight": self.inflight,
            "in_flight_tokens": self.inflight_tokens,  # prompt-size estimates, summed
            "controller": self.controller.state(),
            "slow_start": None if self.slow_start is None else self.slow_start.status(),
            "scrape": self.scrape_state,
            "engine": _engine_status(self.telemetry(now)),
        }

    @property
    def scrape_state(self) -> str:
        """on, detecting, not_vllm (its /metrics has no vLLM series) or off (scrape: false)."""
        if self.scraping is None:
            return "detecting"
        if self.scraping:
            return "on"
        return "off" if self.config is None or self.config.scrape_url is None else "not_vllm"


def _engine_status(t: Telemetry | None) -> dict[str, Any] | None:
    if t is None:
        return None
    out: dict[str, Any] = {"stale": t.stale, "stalled": t.stalled,
                           "age": None if t.age is None else round(t.age, 3)}
    if t.stats is not None:
        out.update(running=t.stats.running, waiting=t.stats.waiting,
                   kv_cache_usage=t.stats.kv_cache_usage,
                   generation_tokens_total=t.stats.generation_tokens_total)
    return out
