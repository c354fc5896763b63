"""The gateway's own endpoints: small Starlette apps beside the proxied paths.

    own_endpoints(gateway) -> Starlette      # KneegateApp sends it every path it does not proxy
    admin_endpoints(gateway) -> Starlette    # served on `server.admin_port`, when set

The probes are `/health` and `/ready`, on both ports (Kubernetes probes the serving port).
The admin endpoints are `/metrics`, `/kneegate/status` (`Gateway.status()` as JSON, NaN and
infinities as null), `/kneegate/history`, `POST /kneegate/reload` and the live page at
`/kneegate/` (gateway/observability/livepage.py): what they show (tenant names, upstream
URLs, the curves learned) is the operator's, not the API's clients'. So with
`server.admin_port` set they are served there only, and the API port answers them 404;
without it they share the API port.
With `admin_token` set, status, history and reload need `Authorization: Bearer <token>`
on either port, and so does `/metrics` on the API port (Prometheus sends it from
`authorization: credentials_file`); `/metrics` on the admin port is open, like any
exporter's. Any other path gets 404 (OpenAI-style body): never an open proxy.
"""

from __future__ import annotations

import contextlib
import hmac
import math
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from kneegate.gateway.errors import HTTPError, MethodNotAllowed, NotFound, Unauthorized, render
from kneegate.gateway.observability.livepage import live_page_routes

if TYPE_CHECKING:
    from kneegate.gateway.runtime import Gateway

__all__ = ["NO_ROUTE", "admin_endpoints", "own_endpoints"]

Lifespan = Callable[[Starlette], AbstractAsyncContextManager[None]]

NO_ROUTE = ("no route for {}; kneegate proxies /v1/*, /tokenize, /detokenize and "
            "/version")


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


def own_endpoints(gw: Gateway) -> Starlette:
    """The API port's own endpoints (KneegateApp sends it every path it does not proxy):
    /health and /ready; with no `server.admin_port`, the admin endpoints too, /metrics then
    behind the admin token when one is set. Its lifespan starts and stops the `Gateway`."""
    probes, admin = _routes(gw, guard_metrics=True)
    routes = probes if gw.config.server.admin_port is not None else [*probes, *admin]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await gw.start()
        try:
            yield
        finally:
            await gw.stop()

    return _app(gw, routes, lifespan)


def admin_endpoints(gw: Gateway) -> Starlette:
    """The admin port's app: /health, /ready, /metrics (no token: the port is the boundary,
    like any exporter's) and the admin endpoints (the token when one is set)."""
    probes, admin = _routes(gw, guard_metrics=False)
    return _app(gw, [*probes, *admin], None)


def _routes(gw: Gateway, *, guard_metrics: bool) -> tuple[list[BaseRoute], list[BaseRoute]]:
    """(the probes, the admin endpoints) of `gw`."""

    def admin_only(request: Request) -> None:
        token = gw.admin_token
        if token is None:
            return
        # RFC 9110 §11.1: the scheme is case-insensitive; the token is compared in constant time
        scheme, _, given = request.headers.get("authorization", "").strip().partition(" ")
        ok = hmac.compare_digest(given.strip().encode("latin-1"), token)
        if not ok or scheme.lower() != "bearer":
            raise _Denied

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def ready(request: Request) -> Response:
        if gw.draining:
            return JSONResponse({"ready": False, "draining": True, "usable": []}, 503)
        # usable and confirmed: an upstream never contacted is not known to work
        usable = [u.name for u in gw.pool.active if u.usable and u.confirmed]
        return JSONResponse({"ready": bool(usable), "usable": usable}, 200 if usable else 503)

    async def metrics(request: Request) -> Response:
        if guard_metrics:  # tenant names and their use: not for every client of the API
            admin_only(request)
        return Response(generate_latest(gw.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def status(request: Request) -> Response:
        admin_only(request)
        return JSONResponse(_json_safe(gw.status()))

    async def history(request: Request) -> Response:
        admin_only(request)
        try:  # only points after `since` (the page asks for what it has not drawn yet)
            since: float | None = float(request.query_params.get("since", ""))
        except ValueError:
            since = None
        return JSONResponse(_json_safe(gw.history.view(gw.clock(), since)))

    async def reload(request: Request) -> Response:
        admin_only(request)
        ok, message = gw.reload()
        return JSONResponse({"reloaded": ok, "message": message}, 200 if ok else 400)

    probes: list[BaseRoute] = [Route("/health", health), Route("/ready", ready)]
    admin: list[BaseRoute] = [
        Route("/metrics", metrics),
        Route("/kneegate/status", status),
        Route("/kneegate/reload", reload, methods=["POST"]),
        Route("/kneegate/history", history),
        *live_page_routes(),
    ]
    return probes, admin


def _app(gw: Gateway, routes: list[BaseRoute], lifespan: Lifespan | None) -> Starlette:
    async def denied(request: Request, exc: Exception) -> Response:
        return _error_response(Unauthorized("admin endpoint: send 'Authorization: Bearer <token>'"))

    async def not_found(request: Request, exc: Exception) -> Response:
        # counted like every other refusal before admission
        if isinstance(exc, HTTPException) and exc.status_code == 405:
            gw.metrics.count_client_rejection("method_not_allowed")
            allow = (exc.headers or {}).get("Allow", "")
            return _error_response(MethodNotAllowed(
                f"method {request.method} is not allowed on {request.url.path}; "
                f"allowed: {allow}", allow.encode()))
        if isinstance(exc, HTTPException) and exc.status_code != 404:
            return Response(exc.detail, exc.status_code)
        gw.metrics.count_client_rejection("not_found")
        return _error_response(NotFound(NO_ROUTE.format(request.url.path)))

    return Starlette(
        routes=routes, lifespan=lifespan,
        exception_handlers={_Denied: denied, HTTPException: not_found},
    )


class _Denied(Exception):
    pass
