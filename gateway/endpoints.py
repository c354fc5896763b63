"""The gateway's own endpoints: a small Starlette app beside the proxied paths.

    own_endpoints(gateway) -> Starlette      # KneegateApp sends it every path it does not proxy

It serves `/health`, `/ready`, `/metrics`, `/kneegate/status` (`Gateway.status()` as JSON,
NaN and infinities as null), `/kneegate/history`, `POST /kneegate/reload` and the live page
at `/kneegate/` (gateway/livepage.py), and answers 404 (OpenAI-style body) for any other
path: never an open proxy. Status, history and reload are admin endpoints: with
`admin_token` set they need `Authorization: Bearer <token>`. Its lifespan starts and stops
the `Gateway`.
"""

from __future__ import annotations

import contextlib
import hmac
import math
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kneegate.gateway.errors import HTTPError, MethodNotAllowed, NotFound, Unauthorized, render
from kneegate.gateway.livepage import live_page_routes

if TYPE_CHECKING:
    from kneegate.gateway.app import Gateway

__all__ = ["NO_ROUTE", "own_endpoints"]

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
    def admin_only(request: Request) -> None:
        token = gw.config.admin_token
        if token is None:
            return
        # RFC 9110 §11.1: the scheme is case-insensitive; the token is compared in constant time
        scheme, _, given = request.headers.get("authorization", "").strip().partition(" ")
        ok = hmac.compare_digest(given.strip().encode("latin-1"), token.encode())
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
        Route("/kneegate/history", history),
        *live_page_routes(),
    ]
    return Starlette(
        routes=routes, lifespan=lifespan,
        exception_handlers={_Denied: denied, HTTPException: not_found},
    )


class _Denied(Exception):
    pass
