"""The gateway's runtime: everything one process holds, built from a config.

    Gateway(config, config_path=..., prepare=..., registry=..., clock=...)

`Gateway` holds the pool, queue, gate, client, metrics, the tick task, the live page's
history (gateway/observability/history.py, sampled once a second by a task of its own),
`apply(config)` which swaps limits, timeouts, classes and upstreams in place without
touching requests in flight, `drain()`, the first step of a graceful shutdown, and the
watch of the config file (gateway/config/watch.py): a file changed on disk is reloaded like
SIGHUP. The ASGI app around it (gateway/app.py) and its own endpoints (gateway/endpoints.py)
read it; it imports neither.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any

from prometheus_client import CollectorRegistry

from kneegate.admission.affinity import PrefixMap
from kneegate.admission.demand import DemandEstimate
from kneegate.admission.pools import Pools
from kneegate.admission.queue import AdmissionQueue
from kneegate.admission.types import ClassPolicy
from kneegate.controllers.base import engine_ttft_objective
from kneegate.gateway.config.gateway import GatewayConfig, Prepare, parse_reload, read_admin_token
from kneegate.gateway.config.read import read_config
from kneegate.gateway.config.upstream import UpstreamConfig
from kneegate.gateway.config.watch import ConfigWatcher
from kneegate.gateway.errors import ConfigError
from kneegate.gateway.forwarding import ProxySettings
from kneegate.gateway.gate import Gate
from kneegate.gateway.observability.history import History
from kneegate.gateway.observability.metrics import GatewayMetrics
from kneegate.gateway.proxy import Proxy
from kneegate.gateway.types import Clock
from kneegate.gateway.upstream.client import UpstreamClient
from kneegate.gateway.upstream.pool import UpstreamPool

__all__ = ["Gateway"]

log = logging.getLogger("kneegate")

# Turns a freshly loaded file into what this process runs (CLI flags, the embedded
# upstream, this worker's share); applied on every reload too.


def _policies(cfg: GatewayConfig) -> dict[str, ClassPolicy]:
    return {
        name: ClassPolicy(name, c.priority, c.max_wait, c.queue_share, c.ttft_objective,
                          c.queue_budget)
        for name, c in cfg.classes.items()
    }


def _objectives(cfg: GatewayConfig) -> dict[str, float]:
    return {name: c.ttft_objective for name, c in cfg.classes.items()}


def _upstreams(cfg: GatewayConfig) -> list[UpstreamConfig]:
    """The upstreams as their controllers run them: a controller whose params leave out
    `ttft_objective` holds the engine (from dispatch) to `engine_ttft_objective` of the
    classes' (from arrival)."""
    objective = engine_ttft_objective(c.ttft_objective for c in cfg.classes.values())
    return [u if "ttft_objective" in u.params
            else u.model_copy(update={"params": {**u.params, "ttft_objective": objective}})
            for u in cfg.upstreams]


def _token_bytes(token: str | None) -> bytes | None:
    return None if token is None else token.encode()


class Gateway:
    """Everything one gateway process holds, built from a config.

    `admin_token` is the token the admin endpoints compare against (bytes, or None: open),
    read from the config or its `admin_token_file` at start and at each reload."""

    def __init__(
        self,
        config: GatewayConfig,
        *,
        config_path: str | None = None,
        prepare: Prepare | None = None,
        registry: CollectorRegistry | None = None,
        clock: Clock = time.monotonic,
    ) -> None:
        self.config_path, self.prepare, self.clock = config_path, prepare, clock
        self.config = config
        self.admin_token = _token_bytes(read_admin_token(config, config_path or "<config>"))
        self.metrics = GatewayMetrics(registry if registry is not None else CollectorRegistry())
        self.pool = UpstreamPool(_upstreams(config), clock=clock,
                                 count_scrape=self.metrics.count_scrape)
        self.queue = Pools(list(self.pool.active), _policies(config), config.max_queue,
                           (config.retry_after_min, config.retry_after_max), self._configure)
        self.pool.on_models = self._regroup
        self.gate = Gate(self.queue, self.metrics, clock)
        self.pool.feed_engine = self.gate.engine_stats
        self.metrics.set_objectives(_objectives(config))
        self.client = UpstreamClient(
            config.timeouts.connect, max_header_bytes=config.limits.max_upstream_header_bytes)
        self.proxy = Proxy(ProxySettings.from_config(config), self.gate, self.pool, self.client,
                           clock)
        self.proxy.access.enabled = config.server.access_log
        self.metrics.bind_live(self.pool.all, self._depths, clock, self.demand)
        self.history = History(self.pool.all, self._depths, self.metrics)
        self._ticker: asyncio.Task[None] | None = None
        self.watcher = ConfigWatcher(config_path) if config_path is not None else None
        self._watching: asyncio.Task[None] | None = None
        self._sampler: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[None]] = set()
        self._fairness_at = -math.inf  # the fairness gauge's last reading
        self.draining = False
        self._cut_timer: asyncio.TimerHandle | None = None

    def _depths(self) -> list[tuple[str, int]]:
        return [(name, self.gate.depth(name)) for name in self.config.classes]

    def _configure(self, queue: AdmissionQueue) -> None:
        """A pool's queue as the config has it: its demand's half-life, its affinity."""
        queue.demand.half_life = self.config.scale.half_life
        r = self.config.routing
        wanted = (r.affinity and len(queue.upstreams) > 1
                  and not any(m in r.without_affinity for u in queue.upstreams
                              for m in u.models or ()))
        if not wanted:
            queue.affinity = None
        elif queue.affinity is None or queue.affinity.capacity != r.affinity_entries:
            queue.affinity = PrefixMap(r.affinity_entries)

    def _regroup(self) -> None:
        """What an upstream serves changed: the pools again, each configured."""
        self.queue.regroup()
        self.queue.configure()
        self.gate.pump()

    def demand(self, now: float) -> list[tuple[str, DemandEstimate | None]]:
        """The scale-out signal at `now`, per pool (named by its models, "" while they are
        unknown): offered load against its usable upstreams' limits."""
        target = self.config.scale.target
        return [(",".join(p.models),
                 p.queue.demand.estimate(now, [u.limit for u in p.upstreams if u.usable],
                                         target))
                for p in self.queue.pools]

    async def start(self) -> None:
        await self.pool.first_contact(self.client)  # so /ready knows who answers
        self._ticker = asyncio.create_task(self._tick_loop())
        interval = self.config.server.config_poll_interval
        if self.watcher is not None and interval > 0:
            self._watching = asyncio.create_task(self._watch_loop(self.watcher, interval))
        self._sampler = asyncio.create_task(self._history_loop())

    def drain(self) -> None:
        """Begin a graceful shutdown (the server calls this on SIGTERM/SIGINT, before it
        stops accepting): /ready answers 503; queued and later requests get 503
        shutting_down with Retry-After; requests in flight run on for
        `server.shutdown_grace` seconds, then are cut (`Proxy.cut`). Idempotent."""
        if self.draining:
            return
        self.draining = True
        refused = self.gate.close()
        grace = self.config.server.shutdown_grace
        # asked for, a shutdown is news; a warning when it turns requests away
        log.log(logging.WARNING if refused else logging.INFO,
                "shutting down: %d queued request(s) refused, %d in flight get %gs to finish",
                refused, len(self.proxy.active), grace)
        self._cut_timer = asyncio.get_running_loop().call_later(grace, self._cut)

    def _cut(self) -> None:
        cut = self.proxy.cut()
        if cut:
            log.warning("shutdown grace of %gs is over: cut %d request(s) still in flight "
                        "(counted as client_cancelled)", self.config.server.shutdown_grace, cut)

    async def stop(self) -> None:
        if self._cut_timer is not None:
            self._cut_timer.cancel()
        tasks = [t for t in (self._ticker, self._watching, self._sampler, *self._background)
                 if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.client.close()

    async def _tick_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.tick_interval)
            try:
                self.tick()
            except Exception:  # a controller bug must not stop admission
                log.exception("tick failed")

    async def _watch_loop(self, watcher: ConfigWatcher, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            if not watcher.poll():
                continue
            log.warning("config file %s changed on disk: reloading", watcher.path)
            try:
                self.reload()
            except Exception:  # `prepare` is the CLI's: a bug there must not stop the watch
                log.exception("config reload failed")

    async def _history_loop(self) -> None:
        while True:
            try:
                self.history.sample(self.clock())
            except Exception:  # the live page's history must not stop the gateway
                log.exception("history sample failed")
            await asyncio.sleep(self.history.interval)

    def tick(self) -> None:
        now = self.clock()
        self.gate.tick(self.pool.all())
        self.proxy.sweep(now)
        if now - self._fairness_at >= 1.0:  # a reading a second: the gauge's window
            self._fairness_at = now
            self.gate.fairness()
        for t in self.pool.background(self.client, now):
            self._background.add(t)
            t.add_done_callback(self._background.discard)

    # --- configuration ---------------------------------------------------------------

    def apply(self, new: GatewayConfig) -> None:
        """Swap in a validated config; requests in flight keep their slots and upstreams.
        Raises ConfigError, having changed nothing, when its admin token file cannot be read."""
        token = _token_bytes(read_admin_token(new, self.config_path or "<config>"))
        if new.server != self.config.server:
            log.warning("server settings changed; they take effect only after a restart")
            new = new.model_copy(update={"server": self.config.server})
        if new.limits != self.config.limits:  # the server's connections read them at start
            log.warning("client limits changed; they take effect only after a restart")
            new = new.model_copy(update={"limits": self.config.limits})
        ups = self.pool.reload(_upstreams(new))
        self.config = new  # what `_configure` reads for every pool
        self.queue.reconfigure(_policies(new), new.max_queue, list(ups),
                               (new.retry_after_min, new.retry_after_max))  # configures them
        self.metrics.set_objectives(_objectives(new))
        self.client.set_connect_timeout(new.timeouts.connect)
        self.proxy.settings = ProxySettings.from_config(new, self.proxy.settings)
        self.admin_token = token
        self.gate.pump()

    def reload(self) -> tuple[bool, str]:
        """Re-read the config file. A bad file keeps the old config, logs and counts it.

        A reload must give a config that could have started the gateway (see `_reloaded`).
        """
        if self.config_path is None:
            self.metrics.reloads.labels("error").inc()
            log.error("config reload asked for, but kneegate was started without --config")
            return False, "no config file to reload (started without --config)"
        if self.watcher is not None:
            self.watcher.loading()  # this version of the file is judged now, once
        try:
            cfg, notes = self._reloaded(self.config_path)
            self.apply(cfg)  # reads the admin token file again: a rotated Secret is taken
        except ConfigError as exc:  # its text never holds a secret (gateway/config/gateway.py)
            log.error("config reload rejected, keeping the old config: %s", exc)
            self.metrics.reloads.labels("error").inc()
            return False, str(exc)
        self.metrics.reloads.labels("ok").inc()
        for note in notes:
            log.warning("config reload: %s", note)
        log.warning("config reloaded from %s", self.config_path)
        return True, f"reloaded {self.config_path}"

    def _reloaded(self, path: str) -> tuple[GatewayConfig, list[str]]:
        # The file (never empty; secrets it leaves out kept), then this process's view of
        # it. No upstream after `prepare` would be a total outage: the embedded engine, when
        # it runs, is filled in by `prepare`, so only a file that drops every engine fails.
        cfg, notes = parse_reload(read_config(path), self.config, path)
        if self.prepare is not None:
            cfg = self.prepare(cfg)
        if not cfg.upstreams:
            raise ConfigError(path, "upstreams", "the new file names no upstream; a reload "
                              "cannot remove every engine (the running ones stay)")
        return cfg, notes

    def status(self) -> dict[str, Any]:
        """Each upstream (its controller's state: limit, knee estimate, learned curve; its
        engine's scraped figures), the queue, the completion rate and the demand (null
        until known: admission/demand.py); `pools`: each pool's models, upstreams, queued
        requests and demand (the live page shows them where there are several)."""
        now = self.clock()
        demands = self.demand(now)
        demand = demands[0][1] if len(demands) == 1 else None
        return {
            "upstreams": [u.status(now) for u in self.pool.all()],
            "queue": {name: self.gate.depth(name) for name in self.config.classes},
            "queue_total": self.queue.depth(),
            "completion_rate": round(self.queue.completion_rate, 3),
            "demand": None if demand is None else demand.as_dict(),
            "pools": [{"models": p.models, "upstreams": sorted(p.names),
                       "queue": p.queue.depth(), "affinity": p.queue.affinity is not None,
                       "demand": None if d is None else d.as_dict()}
                      for p, (_, d) in zip(self.queue.pools, demands, strict=True)],
        }
