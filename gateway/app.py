"""The ASGI application: proxied paths to the hot path, the rest to a small Starlette app.

    build_app(config) -> KneegateApp        # serve it with uvicorn (uvloop + httptools)

Dispatch is one string test per request: `/v1/*`, `/tokenize`, `/detokenize` and
`/version` go straight to `Proxy` as pure ASGI; everything else goes to Starlette, which
serves `/health`, `/ready`, `/metrics`, `/kneegate/status`, `POST /kneegate/reload` and
answers 404 (OpenAI-style body) for any other path: never an open proxy.

`Gateway` is the process's runtime: pool, queue, gate, client, metrics, the tick task, and
`apply(config)` which swaps limits, timeouts, classes and upstreams in place without
touching requests in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.admission import AdmissionQueue, ClassPolicy
from gateway.config import GatewayConfig, load_config
from gateway.errors import ConfigError, HTTPError, NotFound, Unauthorized, render
from gateway.gate import Gate
from gateway.metrics import GatewayMetrics
from gateway.proxy import Proxy, ProxySettings
from gateway.types import Clock, Receive, Scope, Send
from gateway.upstream_client import UpstreamClient
from gateway.upstreams import UpstreamPool

__all__ = ["Gateway", "KneegateApp", "build_app"]

log = logging.getLogger("kneegate")

PROXIED_EXACT = frozenset({"/tokenize", "/detokenize", "/version"})

# Turns a freshly loaded file into what this process runs (CLI flags, the embedded
# upstream, this worker's share); applied on every reload too.
Prepare = Callable[[GatewayConfig], GatewayConfig]


def _policies(cfg: GatewayConfig) -> dict[str, ClassPolicy]:
    return {
        name: ClassPolicy(name, c.priority, c.max_wait, c.queue_share)
        for name, c in cfg.classes.items()
    }


class Gateway:
    """Everything one gateway process holds, built from a config."""

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
        self.metrics = GatewayMetrics(registry if registry is not None else CollectorRegistry())
        self.pool = UpstreamPool(config.upstreams, clock=clock,
                                 count_scrape=self.metrics.count_scrape)
        self.queue = AdmissionQueue(
            list(self.pool.active), _policies(config), config.max_queue,
            config.retry_after_min, config.retry_after_max,
        )
        self.gate = Gate(self.queue, self.metrics, clock)
        self.client = UpstreamClient(config.timeouts.connect)
        self.proxy = Proxy(ProxySettings.from_config(config), self.gate, self.pool, self.client,
                           clock)
        self.metrics.bind_live(self.pool.all, self._depths, clock)
        self._ticker: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[None]] = set()

    def _depths(self) -> list[tuple[str, int]]:
        return [(name, self.queue.depth(name)) for name in self.config.classes]

    async def start(self) -> None:
        await self.client.start()
        await self.pool.first_contact(self.client)  # so /ready knows who answers
        self._ticker = asyncio.create_task(self._tick_loop())

    async def stop(self) -> None:
        tasks = [t for t in (self._ticker, *self._background) if t is not None]
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

    def tick(self) -> None:
        now = self.clock()
        self.gate.tick(self.pool.all())
        self.proxy.sweep(now)
        for t in self.pool.background(self.client, now):
            self._background.add(t)
            t.add_done_callback(self._background.discard)

    # --- configuration ---------------------------------------------------------------

    def apply(self, new: GatewayConfig) -> None:
        """Swap in a validated config; requests in flight keep their slots and upstreams."""
        if new.server != self.config.server:
            log.warning("server settings changed; they take effect only after a restart")
            new = new.model_copy(update={"server": self.config.server})
        ups = self.pool.reload(new.upstreams)
        self.queue.reconfigure(_policies(new), new.max_queue, list(ups))
        self.queue.retry_after_min = new.retry_after_min
        self.queue.retry_after_max = new.retry_after_max
        self.client.set_connect_timeout(new.timeouts.connect)
        self.proxy.settings = ProxySettings.from_config(new)
        self.config = new
        self.gate.pump()

    def reload(self) -> tuple[bool, str]:
        """Re-read the config file. A bad file keeps the old config, logs and counts it."""
        if self.config_path is None:
            self.metrics.reloads.labels("failed").inc()
            log.error("config reload asked for, but kneegate was started without --config")
            return False, "no config file to reload (started without --config)"
        try:
            cfg = load_config(self.config_path)
            if self.prepare is not None:
                cfg = self.prepare(cfg)
        except ConfigError as exc:
            log.error("config reload rejected, keeping the old config: %s", exc)
            self.metrics.reloads.labels("failed").inc()
            return False, str(exc)
        self.apply(cfg)
        self.metrics.reloads.labels("ok").inc()
        log.warning("config reloaded from %s", self.config_path)
        return True, f"reloaded {self.config_path}"

    def status(self) -> dict[str, Any]:
        """Each upstream (its controller's state: limit, knee estimate, learned curve; its
        engine's scraped figures), the queue and the completion rate."""
        now = self.clock()
        return {
            "upstreams": [u.status(now) for u in self.pool.all()],
            "queue": {name: self.queue.depth(name) for name in self.config.classes},
            "queue_total": self.queue.depth(),
            "completion_rate": round(self.queue.completion_rate, 3),
        }


class KneegateApp:
    """The ASGI callable uvicorn serves."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.proxy = gateway.proxy
        self.own = _own_endpoints(gateway)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path: str = scope["path"]
            if path.startswith("/v1/") or path in PROXIED_EXACT:
                await self.proxy(scope, receive, send)
                return
        await self.own(scope, receive, send)


def _json_safe(obj: Any) -> Any:
    """NaN and infinities (unknown engine figures, unset estimates) become null."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


def _error_response(exc: HTTPError) -> Response:
    status, headers, body = render(exc)
    return Response(body, status, headers={k.decode(): v.decode() for k, v in headers})


def _own_endpoints(gw: Gateway) -> Starlette:
    def admin_only(request: Request) -> None:
        token = gw.config.admin_token
        if token is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
            raise _Denied

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def ready(request: Request) -> Response:
        # usable and confirmed: an upstream never contacted is not known to work
        usable = [u.name for u in gw.pool.active if u.usable and u.confirmed]
        return JSONResponse({"ready": bool(usable), "usable": usable}, 200 if usable else 503)

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(gw.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def status(request: Request) -> Response:
        admin_only(request)
        return JSONResponse(_json_safe(gw.status()))

    async def reload(request: Request) -> Response:
        admin_only(request)
        ok, message = gw.reload()
        return JSONResponse({"reloaded": ok, "message": message}, 200 if ok else 400)

    async def denied(request: Request, exc: Exception) -> Response:
        return _error_response(Unauthorized("admin endpoint: send 'Authorization: Bearer <token>'"))

    async def not_found(request: Request, exc: Exception) -> Response:
        if isinstance(exc, HTTPException) and exc.status_code != 404:
            return Response(exc.detail, exc.status_code)
        return _error_response(NotFound(
            f"no route for {request.url.path}; kneegate proxies /v1/*, /tokenize, "
            "/detokenize and /version"))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await gw.start()
        try:
            yield
        finally:
            await gw.stop()

    routes = [
        Route("/health", health),
        Route("/ready", ready),
        Route("/metrics", metrics),
        Route("/kneegate/status", status),
        Route("/kneegate/reload", reload, methods=["POST"]),
    ]
    return Starlette(
        routes=routes, lifespan=lifespan,
        exception_handlers={_Denied: denied, HTTPException: not_found},
    )


class _Denied(Exception):
    pass


def build_app(
    config: GatewayConfig,
    *,
    config_path: str | None = None,
    prepare: Prepare | None = None,
    registry: CollectorRegistry | None = None,
    clock: Clock = time.monotonic,
) -> KneegateApp:
    """The ASGI app for `config`. Start-up work (client, tick task) runs in its lifespan."""
    gw = Gateway(config, config_path=config_path, prepare=prepare, registry=registry,
                 clock=clock)
    return KneegateApp(gw)
