"""The pool of engines: one `Upstream` each, with its controller, health and engine stats.

`Upstream` extends admission's `UpstreamState` (name, controller, in-flight, usable) with
what the proxy and the status page need, so the pure queue hands the proxy the very object
it dispatched to.

Health: a connect failure marks an upstream unusable at once (admission stops choosing
it); the tick then probes `health_path` with growing back-off (0.5 s doubling to 8 s) and
a 2xx makes it usable again. A reload that removes an upstream keeps it *draining*: its
in-flight requests finish against it and it leaves the pool when the last one does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Any

from controllers.base import EngineStats, LimitController
from controllers.registry import build_controller
from gateway.admission import UpstreamState
from gateway.config import UpstreamConfig
from gateway.errors import UpstreamError
from gateway.telemetry import parse_engine_metrics
from gateway.upstream_client import UpstreamClient

__all__ = ["Upstream", "UpstreamPool"]

log = logging.getLogger("kneegate.upstreams")

_PROBE_TIMEOUT = 2.0
_BACKOFF_MIN, _BACKOFF_MAX = 0.5, 8.0


@dataclass(slots=True, eq=False)
class Upstream(UpstreamState):
    """One engine: admission state plus URL, config, health and the engine's own stats."""

    url: str = ""
    config: UpstreamConfig | None = None
    backoff: float = _BACKOFF_MIN
    next_probe_at: float = 0.0
    next_scrape_at: float = 0.0
    engine: EngineStats | None = None
    busy: bool = False  # a probe or scrape is running

    @property
    def limit(self) -> int:
        return self.controller.limit

    @property
    def knee_estimate(self) -> float | None:
        knee = getattr(self.controller, "knee_estimate", None)
        return None if knee is None else float(knee)

    def status(self) -> dict[str, Any]:
        state = self.controller.state()
        return {
            "name": self.name,
            "url": self.url,
            "usable": self.usable,
            "limit": self.limit,
            "in_flight": self.inflight,
            "controller": state,
            "engine": None if self.engine is None else {
                "running": self.engine.running, "waiting": self.engine.waiting,
                "kv_cache_usage": self.engine.kv_cache_usage,
            },
        }


def _build(cfg: UpstreamConfig) -> Upstream:
    ctl: LimitController = build_controller(cfg.controller, cfg.params)
    return Upstream(name=cfg.name, controller=ctl, url=cfg.url, config=cfg)


class UpstreamPool:
    """The configured upstreams plus the ones a reload removed that still have requests."""

    def __init__(self, configs: list[UpstreamConfig]) -> None:
        self.active: list[Upstream] = [_build(c) for c in configs]
        self.draining: list[Upstream] = []

    def all(self) -> list[Upstream]:
        self.draining = [u for u in self.draining if u.inflight > 0]
        return self.active + self.draining

    def reload(self, configs: list[UpstreamConfig]) -> list[Upstream]:
        """Apply a new upstream list; keep controller state where name and controller match."""
        old = {u.name: u for u in self.active}
        new: list[Upstream] = []
        for cfg in configs:
            up = old.pop(cfg.name, None)
            if up is None:
                new.append(_build(cfg))
                continue
            prev = up.config
            if prev is None or (prev.controller, prev.params) != (cfg.controller, cfg.params):
                up.controller = build_controller(cfg.controller, cfg.params)
            up.url, up.config = cfg.url, cfg
            new.append(up)
        self.draining.extend(u for u in old.values() if u.inflight > 0)
        self.active = new
        return new

    def mark_failed(self, up: Upstream, now: float) -> None:
        if up.usable:
            log.warning("upstream %s unusable: connect failed; probing %s", up.name, up.url)
            up.backoff = _BACKOFF_MIN
        up.usable = False
        up.next_probe_at = now + up.backoff

    def background(self, client: UpstreamClient, now: float) -> list[asyncio.Task[None]]:
        """Start due health probes and engine scrapes (called from the tick)."""
        tasks = []
        for up in self.active:
            if up.busy:
                continue
            if not up.usable and now >= up.next_probe_at:
                up.busy = True
                tasks.append(asyncio.create_task(self._probe(client, up, now)))
            elif up.config and up.config.metrics_url and now >= up.next_scrape_at:
                up.busy = True
                up.next_scrape_at = now + up.config.scrape_interval
                tasks.append(asyncio.create_task(self._scrape(client, up, now)))
        return tasks

    async def _probe(self, client: UpstreamClient, up: Upstream, now: float) -> None:
        assert up.config is not None
        try:
            status, _ = await client.get_text(up.url + up.config.health_path, _PROBE_TIMEOUT)
            ok = 200 <= status < 300
        except UpstreamError:
            ok = False
        finally:
            up.busy = False
        if ok:
            log.warning("upstream %s usable again", up.name)
            up.usable = True
        else:
            up.backoff = min(_BACKOFF_MAX, up.backoff * 2)
            up.next_probe_at = now + up.backoff

    async def _scrape(self, client: UpstreamClient, up: Upstream, now: float) -> None:
        assert up.config is not None and up.config.metrics_url is not None
        try:
            with contextlib.suppress(UpstreamError):
                status, text = await client.get_text(up.config.metrics_url, _PROBE_TIMEOUT)
                stats = parse_engine_metrics(text, now) if status == 200 else None
                if stats is not None:
                    up.engine = stats
                    up.controller.on_engine_stats(stats)
        finally:
            up.busy = False

