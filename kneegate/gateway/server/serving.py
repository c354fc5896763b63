"""Serving one app: uvicorn (uvloop + httptools) on a bound socket, in this event loop.

    uvicorn_config(app) -> uvicorn.Config   # the settings the gateway runs with
    serving(app) -> base URL                # the demo and the tests: a free loopback port

`bind` takes the port once (workers inherit the socket; a port that cannot be bound raises
`CannotListen`), `GatewayServer` is uvicorn's server with the gateway's shutdown,
`admin_server` the second server of `server.admin_port`. The process around them — one
worker or N, signals, the embedded engine — is gateway/server/workers.py's.

Shutdown (SIGINT/SIGTERM, Ctrl-C): `GatewayServer` drains the gateway first
(`Gateway.drain`: /ready 503, queued requests 503 shutting_down), then uvicorn stops
accepting and closes idle connections, streams in flight run on for
`server.shutdown_grace` seconds and are cut after it; the worker exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import signal
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import uvicorn

from kneegate.gateway.app import KneegateApp
from kneegate.gateway.config.sections import LimitsConfig
from kneegate.gateway.errors import CannotListen
from kneegate.gateway.http.limits import ClientLimits
from kneegate.gateway.http.wire import KneegateHttpProtocol, WireConfig

__all__ = [
    "CUT_MARGIN", "GatewayServer", "QuietServer", "admin_server", "bind", "listening_url",
    "running", "serving", "uvicorn_config",
]

# uvicorn's own wait outlasts the grace by this much, so the gateway's cut (a clean abort,
# counted) comes first and uvicorn's cancellation (a traceback per task) only catches
# what is not a proxied request
CUT_MARGIN = 1.0


def uvicorn_config(
    app: Any, *, log_level: str = "warning",
    http: type[asyncio.Protocol] | str = KneegateHttpProtocol,
    limits: LimitsConfig | None = None,
) -> uvicorn.Config:
    """The uvicorn settings the gateway runs with (tests use the same).

    `http`: uvicorn's httptools protocol plus the body writer and client limits of
    gateway/http/wire.py; tests pass "httptools" to run the app the way any other ASGI server
    would. `limits`: default the gateway app's own `config.limits` (its rejections are
    counted in its metrics), else the defaults (the emulator). Read once, at start-up.
    """
    gw = app.gateway if isinstance(app, KneegateApp) else None
    if limits is None:
        limits = gw.config.limits if gw is not None else LimitsConfig()
    count = gw.metrics.count_client_rejection if gw is not None else None
    return WireConfig(
        app,
        client_limits=ClientLimits(limits, count),
        loop="uvloop",
        http=http,
        lifespan="on",
        ws="none",  # never a WebSocket: an Upgrade request is refused (gateway/http/limits.py)
        access_log=False,  # ours is written by the proxy (gateway/access.py), with its outcome
        # no handler of uvicorn's own: its records go to ours (gateway/observability/logs.py)
        log_config=None,
        proxy_headers=False,  # we are the proxy: the peer's address is the client's
        server_header=False,  # the upstream's own Server and Date headers pass through
        date_header=False,
        backlog=4096,
        timeout_keep_alive=limits.keepalive_timeout,  # typed int; call_later takes a float
        timeout_graceful_shutdown=25,  # then open streams are cancelled (and released)
        log_level=log_level,
    )


def bind(host: str, port: int, flag: str = "--port") -> socket.socket:
    """A socket bound to `host`:`port`, for uvicorn to listen on (workers inherit it).
    CannotListen says what to change when the port is taken or not ours to take (`flag`:
    the option that picks another)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise CannotListen(host, port, exc, flag) from exc
    sock.set_inheritable(True)
    return sock


class GatewayServer(uvicorn.Server):
    """uvicorn's server, draining a kneegate app on shutdown, exiting 0 after a signal.

    Serving a `KneegateApp`, its shutdown first calls `Gateway.drain()` and waits for
    connections up to the app's `server.shutdown_grace` (plus `CUT_MARGIN`) instead of
    uvicorn's `timeout_graceful_shutdown`. Unlike uvicorn it does not re-raise the signal
    once shut down: a drained worker exits 0, not by SIGTERM or a KeyboardInterrupt.
    """

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        app = config.app
        self.gateway = app.gateway if isinstance(app, KneegateApp) else None
        if self.gateway is not None:
            grace = self.gateway.config.server.shutdown_grace
            config.timeout_graceful_shutdown = math.ceil(grace + CUT_MARGIN)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self.gateway is not None:
            self.gateway.drain()
        await super().shutdown(sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield  # signals reach the main thread only (as in uvicorn)
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


class QuietServer(GatewayServer):
    """A server that leaves signal handling to its host (a second server, the demo)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@contextlib.asynccontextmanager
async def serving(
    app: Any, sock: socket.socket | None = None, *, log_level: str = "warning",
    start_timeout: float = 10.0, http: type[asyncio.Protocol] | str = KneegateHttpProtocol,
) -> AsyncIterator[str]:
    """Serve `app` in this event loop (loopback, a free port unless `sock` is given).

    Yields the base URL once uvicorn is accepting; stops it on exit (a kneegate app
    drains first). The demo and the tests run the gateway and the emulator side by side
    this way.
    """
    server = QuietServer(uvicorn_config(app, log_level=log_level, http=http))
    async with running(server, sock, start_timeout=start_timeout) as url:
        yield url


def admin_server(app: KneegateApp) -> QuietServer:
    """The uvicorn server of `server.admin_port`: the app's admin endpoints, its client
    limits, no lifespan (the API server's starts and stops the gateway) and no signals of
    its own. It runs in the same event loop as the API server, beside it."""
    assert app.admin is not None, "the app is built with server.admin_port set"
    config = uvicorn_config(app.admin, limits=app.gateway.config.limits)
    config.lifespan = "off"
    return QuietServer(config)


@contextlib.asynccontextmanager
async def running(
    server: uvicorn.Server, sock: socket.socket | None = None, *, start_timeout: float = 10.0,
) -> AsyncIterator[str]:
    """`serving` for a server built by the caller, who may set `server.should_exit` to
    begin its shutdown early (the shutdown tests do); exit waits for it, bounded."""
    own = sock is None
    sock = sock or bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        async with asyncio.timeout(start_timeout):
            while not server.started:
                if task.done():
                    task.result()  # start-up failed: raise its error
                await asyncio.sleep(0.01)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        grace = server.config.timeout_graceful_shutdown or 0
        async with asyncio.timeout(start_timeout + grace):  # uvicorn's wait is bounded by it
            await task
        if own:
            sock.close()


def listening_url(sock: socket.socket) -> str:
    """The base URL a bound socket serves (`http://127.0.0.1:8080`, `http://[::1]:8080`)."""
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


