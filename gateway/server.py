"""Serving: uvicorn (uvloop + httptools) on one port, N worker processes, SIGHUP reloads.

`run(cfg, prepare=..., config_path=...)` binds the listening socket once, in this process;
with one worker it serves here (so the process you start is the one doing the work), with
N it forks N children that all accept on the same socket, each with its own admission
state and its share of fixed limits (`config.split_for_worker`). SIGHUP re-reads the
config file in every worker (the parent forwards it); SIGINT/SIGTERM stop gracefully.

The embedded engine: when the config names no upstream, `run` serves the emulator
(`benchmarks.engine.server.build_app("cpu-tiny")`, imported here, lazily) on a loopback
port — in this process and event loop with one worker, in one extra process with more —
and `prepare` points an upstream called `embedded` at it.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import multiprocessing
import os
import signal
import socket
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import uvicorn

from gateway.app import KneegateApp, build_app
from gateway.config import GatewayConfig, LimitsConfig, split_for_worker
from gateway.wire import ClientLimits, KneegateHttpProtocol, WireConfig

__all__ = ["QuietServer", "bind", "embedded_upstream", "run", "serving", "uvicorn_config"]

log = logging.getLogger("kneegate")

Prepare = Callable[[GatewayConfig], GatewayConfig]


def uvicorn_config(
    app: Any, *, log_level: str = "warning",
    http: type[asyncio.Protocol] | str = KneegateHttpProtocol,
    limits: LimitsConfig | None = None,
) -> uvicorn.Config:
    """The uvicorn settings the gateway runs with (tests use the same).

    `http`: uvicorn's httptools protocol plus the body writer and client limits of
    gateway/wire.py; tests pass "httptools" to run the app the way any other ASGI server
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
        access_log=False,  # a log line per request would cost more than the relay
        proxy_headers=False,  # we are the proxy: the peer's address is the client's
        server_header=False,  # the upstream's own Server and Date headers pass through
        date_header=False,
        backlog=4096,
        timeout_keep_alive=limits.keepalive_timeout,  # typed int; call_later takes a float
        timeout_graceful_shutdown=25,  # then open streams are cancelled (and released)
        log_level=log_level,
    )


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


class QuietServer(uvicorn.Server):
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

    Yields the base URL once uvicorn is accepting; stops it on exit. The demo and the
    tests run the gateway and the emulator side by side this way.
    """
    own = sock is None
    sock = sock or bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    server = QuietServer(uvicorn_config(app, log_level=log_level, http=http))
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
        async with asyncio.timeout(start_timeout + 25):  # graceful shutdown is bounded at 25
            await task
        if own:
            sock.close()


def _emulator_app() -> Any:
    # lazy: a production image never loads the benchmarks package
    from benchmarks.engine.server import build_app as build_engine

    return build_engine("cpu-tiny")


def embedded_upstream(port: int) -> Callable[[GatewayConfig], GatewayConfig]:
    """`prepare` step: point a config without upstreams at the embedded emulator."""
    from gateway.config import UpstreamConfig

    def fill(cfg: GatewayConfig) -> GatewayConfig:
        if cfg.upstreams:
            return cfg
        up = UpstreamConfig(name="embedded", url=f"http://127.0.0.1:{port}",
                            metrics_url=f"http://127.0.0.1:{port}/metrics")
        return cfg.model_copy(update={"upstreams": [up]})

    return fill


async def _serve_worker(
    sock: socket.socket, cfg: GatewayConfig, prepare: Prepare, config_path: str | None,
    engine_sock: socket.socket | None,
) -> None:
    engine: uvicorn.Server | None = None
    engine_task = None
    if engine_sock is not None:
        engine = QuietServer(uvicorn_config(_emulator_app()))
        engine_task = asyncio.create_task(engine.serve(sockets=[engine_sock]))
    app = build_app(prepare(cfg), config_path=config_path, prepare=prepare)
    server = uvicorn.Server(uvicorn_config(app, log_level="info"))
    # start-up objects (modules, config, app) never die: keep them out of every later
    # full collection, which otherwise pauses the relay for milliseconds
    gc.collect()
    gc.freeze()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGHUP, app.gateway.reload)
    try:
        await server.serve(sockets=[sock])
    finally:
        if engine is not None and engine_task is not None:
            engine.should_exit = True
            await engine_task


def _worker_main(
    sock: socket.socket, cfg: GatewayConfig, prepare: Prepare, config_path: str | None,
    engine_sock: socket.socket | None,
) -> None:
    import uvloop

    uvloop.run(_serve_worker(sock, cfg, prepare, config_path, engine_sock))


def _engine_main(sock: socket.socket) -> None:
    import uvloop

    uvloop.run(uvicorn.Server(uvicorn_config(_emulator_app())).serve(sockets=[sock]))


def run(cfg: GatewayConfig, *, prepare: Prepare, config_path: str | None = None) -> int:
    """Serve until SIGINT/SIGTERM. `prepare` turns a loaded file into this process's config."""
    workers = cfg.server.workers
    sock = bind(cfg.server.host, cfg.server.port)
    engine_sock = None
    if not prepare(cfg).upstreams:
        engine_sock = bind("127.0.0.1", 0)
        prepare = _then(prepare, embedded_upstream(engine_sock.getsockname()[1]))
        log.warning("no upstream configured: serving the built-in emulator (cpu-tiny) on %s",
                    engine_sock.getsockname())
    host, port = sock.getsockname()[:2]
    log.warning("kneegate listening on http://%s:%d (%d worker%s)", host, port, workers,
                "" if workers == 1 else "s")
    if workers == 1:
        _worker_main(sock, cfg, prepare, config_path, engine_sock)
        return 0
    return _supervise(sock, cfg, prepare, config_path, engine_sock, workers)


def _then(first: Prepare, second: Prepare) -> Prepare:
    return lambda cfg: second(first(cfg))


def _share(index: int, count: int) -> Prepare:
    return lambda cfg: split_for_worker(cfg, index, count)


def _supervise(
    sock: socket.socket, cfg: GatewayConfig, prepare: Prepare, config_path: str | None,
    engine_sock: socket.socket | None, workers: int,
) -> int:
    ctx = multiprocessing.get_context("fork")
    procs = []
    if engine_sock is not None:
        procs.append(ctx.Process(target=_engine_main, args=(engine_sock,), daemon=True))
    for i in range(workers):
        # the share is computed from each freshly loaded file, on reload too
        share = _then(prepare, _share(i, workers))
        procs.append(ctx.Process(target=_worker_main, args=(sock, cfg, share, config_path, None),
                                 daemon=True))
    for p in procs:
        p.start()

    def forward(sig: int, _frame: object) -> None:
        for p in procs:
            if p.pid is not None and p.is_alive():
                os.kill(p.pid, sig)

    for sig in (signal.SIGHUP, signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, forward)
    for p in procs[1:] if engine_sock is not None else procs:
        p.join()
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(5)
    return 0 if all(p.exitcode in (0, -signal.SIGTERM) for p in procs) else 1
