"""The process: one worker or N, signals, the admin port, the embedded engine.

`run(cfg, prepare=..., config_path=...)` binds the listening socket once, in this process;
with one worker it serves here (so the process you start is the one doing the work), with
N it forks N children that all accept on the same socket, each with its own admission
state and its share of fixed limits (`config.split_for_worker`). SIGHUP re-reads the
config file in every worker (the parent forwards it).

With `server.admin_port` set, a second socket is bound the same way and each worker serves
the admin endpoints on it (`admin_server`: a second uvicorn server in the worker's event
loop, beside the API one; like /metrics today, each worker answers for itself). Without
it, and without an admin token, start-up warns that the API port shows them to everyone (at
INFO when it listens on a loopback address: only this machine can reach it). A port that
cannot be bound (in use, privileged) raises `CannotListen`, which the CLI prints as one line.

Shutdown (SIGINT/SIGTERM, Ctrl-C) drains each worker (gateway/server/serving.py). With N
workers the parent forwards each signal once: the workers sit in their own process group,
so a terminal's Ctrl-C reaches them only through the parent (it used to arrive twice — the
terminal's and the forwarded one — which uvicorn reads as "force quit" and cut every
stream at once). A second Ctrl-C still forces quit. The parent kills workers still alive
10 s after the grace.

The embedded engine: when the config names no upstream, `run` serves the app its caller
passes as `engine` (the CLI passes the emulator, `kneegate.embedded`: the gateway package
never imports the load tools) on a loopback port — in this process and event loop with one
worker, in one extra process with more, which ignores SIGHUP and SIGINT and is stopped by
the parent after the workers — and `prepare` points an upstream called `embedded` at it.
"""

from __future__ import annotations

import asyncio
import gc
import ipaddress
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from multiprocessing.process import BaseProcess
from typing import Any

import uvicorn

from kneegate.gateway.app import build_app
from kneegate.gateway.config.gateway import GatewayConfig, Prepare, split_for_worker
from kneegate.gateway.observability.logs import EMBEDDED
from kneegate.gateway.server.serving import (
    CUT_MARGIN,
    GatewayServer,
    QuietServer,
    admin_server,
    bind,
    listening_url,
    uvicorn_config,
)

__all__ = ["embedded_upstream", "exposure_warning", "run"]

log = logging.getLogger("kneegate")

EngineApp = Callable[[], Any]  # builds the embedded engine's ASGI app (in its process)
# the parent kills workers still alive this long after the grace
KILL_AFTER = 10.0


def exposure_warning(cfg: GatewayConfig) -> str | None:
    """What start-up warns of when the API port shows what only operators should read."""
    if cfg.server.admin_port is not None or cfg.admin_token or cfg.admin_token_file:
        return None
    return ("/metrics and /kneegate/* are open to every client of the API port (tenant names "
            "and their use, upstream URLs): set server.admin_port, or admin_token")


def embedded_upstream(port: int) -> Callable[[GatewayConfig], GatewayConfig]:
    """`prepare` step: point a config without upstreams at the embedded emulator. It runs
    the default controller (`knee`) and is scraped from the start: it is known to serve
    vLLM's series, so there is nothing to detect."""
    from kneegate.gateway.config.upstream import UpstreamConfig

    def fill(cfg: GatewayConfig) -> GatewayConfig:
        if cfg.upstreams:
            return cfg
        up = UpstreamConfig(name="embedded", url=f"http://127.0.0.1:{port}",
                            metrics_url=f"http://127.0.0.1:{port}/metrics")
        return cfg.model_copy(update={"upstreams": [up]})

    return fill


async def _orphan_watch(server: uvicorn.Server, parent: int) -> None:
    """Drain `server` when the supervising parent is gone (killed with SIGKILL, say): a
    worker in its own process group would otherwise serve on, unseen, forever."""
    while not server.should_exit:
        if os.getppid() != parent:
            log.warning("the supervising process %d is gone: draining and exiting", parent)
            server.should_exit = True
            return
        await asyncio.sleep(1.0)


def _watch_parent(server: uvicorn.Server, parent: int | None) -> asyncio.Task[None] | None:
    return None if parent is None else asyncio.create_task(_orphan_watch(server, parent))


async def _serve_worker(
    sock: socket.socket, cfg: GatewayConfig, prepare: Prepare, config_path: str | None,
    engine_sock: socket.socket | None, parent: int | None = None,
    engine_app: EngineApp | None = None, admin_sock: socket.socket | None = None,
) -> None:
    engine: uvicorn.Server | None = None
    engine_task = None
    if engine_sock is not None:
        assert engine_app is not None, "an engine socket comes with its app"
        engine = QuietServer(uvicorn_config(engine_app()))
        engine_task = asyncio.create_task(_embedded(engine.serve(sockets=[engine_sock])))
    app = build_app(prepare(cfg), config_path=config_path, prepare=prepare)
    server = GatewayServer(uvicorn_config(app, log_level="info"))
    # start-up objects (modules, config, app) never die: keep them out of every later
    # full collection, which otherwise pauses the relay for milliseconds
    gc.collect()
    gc.freeze()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGHUP, app.gateway.reload)
    watch = _watch_parent(server, parent)
    admin = admin_task = None
    if admin_sock is not None and app.admin is not None:
        admin = admin_server(app)
        admin_task = asyncio.create_task(admin.serve(sockets=[admin_sock]))
    try:
        await server.serve(sockets=[sock])
    finally:
        if watch is not None:
            watch.cancel()
        if admin is not None and admin_task is not None:  # after the drain: /ready said 503
            admin.should_exit = True
            await admin_task
        if engine is not None and engine_task is not None:
            engine.should_exit = True
            await engine_task


async def _embedded(serve: Awaitable[None]) -> None:
    # the emulator's uvicorn logs through the same loggers as the gateway's: marked, so its
    # info lines ("Started server process" again) are dropped (gateway/observability/logs.py)
    EMBEDDED.set(True)
    await serve


def _worker_main(
    sock: socket.socket, cfg: GatewayConfig, prepare: Prepare, config_path: str | None,
    engine_sock: socket.socket | None, own_group: bool = False,
    engine_app: EngineApp | None = None, admin_sock: socket.socket | None = None,
) -> None:
    import uvloop

    parent = None
    if own_group:  # signals come from the parent only (see the module docstring)
        os.setpgid(0, 0)
        parent = os.getppid()
    uvloop.run(_serve_worker(sock, cfg, prepare, config_path, engine_sock, parent, engine_app,
                             admin_sock))


def _engine_main(sock: socket.socket, inherited: socket.socket, engine_app: EngineApp) -> None:
    import uvloop

    inherited.close()  # the gateway's listener: only the workers accept on it
    # SIGHUP (a reload, or a terminal's hang-up) and Ctrl-C are the workers' business:
    # the engine must outlive their drain. The parent stops it with SIGTERM afterwards.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    server = QuietServer(uvicorn_config(engine_app()))
    parent = os.getppid()
    EMBEDDED.set(True)

    async def serve() -> None:
        asyncio.get_running_loop().add_signal_handler(
            signal.SIGTERM, setattr, server, "should_exit", True)
        watch = _watch_parent(server, parent)
        await server.serve(sockets=[sock])
        if watch is not None:
            watch.cancel()

    uvloop.run(serve())


def run(cfg: GatewayConfig, *, prepare: Prepare, config_path: str | None = None,
        engine: EngineApp | None = None) -> int:
    """Serve until SIGINT/SIGTERM. `prepare` turns a loaded file into this process's config;
    `engine` builds the app served as the embedded upstream when the config names none
    (without it, such a config is refused)."""
    workers = cfg.server.workers
    if not prepare(cfg).upstreams and engine is None:
        raise ValueError("the config names no upstream and no embedded engine was given")
    sock = bind(cfg.server.host, cfg.server.port)
    admin_sock = None
    if cfg.server.admin_port is not None:
        admin_sock = bind(cfg.server.admin_host or cfg.server.host, cfg.server.admin_port,
                          "--admin-port")
    engine_sock = None
    if not prepare(cfg).upstreams:
        engine_sock = bind("127.0.0.1", 0)
        # listening from now on: a worker's first request waits in the backlog while the
        # engine starts, instead of being refused (a 502, and the upstream marked failed)
        engine_sock.listen(128)
        prepare = _then(prepare, embedded_upstream(engine_sock.getsockname()[1]))
        log.info("no upstream configured: serving the built-in emulator (cpu-tiny) on %s",
                 listening_url(engine_sock))
    log.info("kneegate listening on %s (%d worker%s)", listening_url(sock), workers,
             "" if workers == 1 else "s")
    if admin_sock is not None:
        log.info("admin endpoints (/metrics, /kneegate/*) on %s only", listening_url(admin_sock))
    elif (exposed := exposure_warning(cfg)) is not None:
        # on a loopback address only this machine's processes are its clients: a note
        level = logging.INFO if _loopback(cfg.server.host) else logging.WARNING
        log.log(level, "%s", exposed)
    if workers == 1:
        _worker_main(sock, cfg, prepare, config_path, engine_sock, engine_app=engine,
                     admin_sock=admin_sock)
        return 0
    return _supervise(sock, cfg, prepare, config_path, engine_sock, workers, engine, admin_sock)


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _then(first: Prepare, second: Prepare) -> Prepare:
    return lambda cfg: second(first(cfg))


def _share(index: int, count: int) -> Prepare:
    return lambda cfg: split_for_worker(cfg, index, count)


def _supervise(
    sock: socket.socket, cfg: GatewayConfig, prepare: Prepare, config_path: str | None,
    engine_sock: socket.socket | None, workers: int, engine_app: EngineApp | None = None,
    admin_sock: socket.socket | None = None,
) -> int:
    ctx = multiprocessing.get_context("fork")
    engine = None
    if engine_sock is not None:
        engine = ctx.Process(target=_engine_main, args=(engine_sock, sock, engine_app),
                             daemon=True)
        engine.start()
        engine_sock.close()  # forked before the workers, so they never hold the engine's port
    procs = []
    for i in range(workers):
        # the share is computed from each freshly loaded file, on reload too
        share = _then(prepare, _share(i, workers))
        procs.append(ctx.Process(target=_worker_main,
                                 args=(sock, cfg, share, config_path, None, True),
                                 kwargs={"admin_sock": admin_sock}, daemon=True))
    for p in procs:
        p.start()
    sock.close()  # the workers hold it: once they all closed it, new connections are refused
    if admin_sock is not None:
        admin_sock.close()
    stopping: list[float] = []  # when the first SIGINT/SIGTERM came

    def forward(sig: int, _frame: object) -> None:
        if sig != signal.SIGHUP and not stopping:
            stopping.append(time.monotonic())
        for p in procs:
            if p.pid is not None and p.is_alive():
                os.kill(p.pid, sig)

    for sig in (signal.SIGHUP, signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, forward)
    _join(procs, stopping, cfg.server.shutdown_grace + CUT_MARGIN + KILL_AFTER)
    if engine is not None:
        engine.terminate()
        engine.join(KILL_AFTER)
        if engine.is_alive():
            engine.kill()
            engine.join()
        procs.append(engine)
    return 0 if all(p.exitcode in (0, -signal.SIGTERM) for p in procs) else 1


def _join(procs: Sequence[BaseProcess], stopping: list[float], patience: float) -> None:
    """Wait for every worker to exit; kill those still alive `patience` seconds after the
    shutdown began (`stopping` gets its time when it does)."""
    while alive := [p for p in procs if p.is_alive()]:
        if stopping and time.monotonic() - stopping[0] > patience:
            log.error("%d worker(s) still running %gs after shutdown began: killing them",
                      len(alive), patience)
            for p in alive:
                p.kill()
                p.join(KILL_AFTER)
            return
        multiprocessing.connection.wait([p.sentinel for p in alive], timeout=0.5)
