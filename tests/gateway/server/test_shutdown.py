"""Graceful shutdown (issue 11, defect 8): drain, grace, cut; workers and the embedded engine.

In-process tests start shutdown the way a signal does (`server.should_exit = True`) or
call `Gateway.drain()` directly; the process tests send the signals themselves.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anyio
import httpx
import pytest
from helpers.gateway import (
    FakeEngine,
    assert_conserved,
    gw_config,
    scrape,
    serve,
    total,
    until,
)
from helpers.process import free_port, until_up
from prometheus_client import generate_latest

from kneegate.gateway.app import KneegateApp, build_app
from kneegate.gateway.server.serving import QuietServer, running, uvicorn_config

pytestmark = pytest.mark.anyio

STREAM = {"max_tokens": 20, "stream": True}


class Rig:
    def __init__(self, engine: FakeEngine, app: KneegateApp, server: QuietServer, gw: str,
                 client: httpx.AsyncClient) -> None:
        self.engine, self.app, self.server, self.gw = engine, app, server, gw
        self.client = client

    def metrics(self) -> dict[Any, float]:
        """Read from the registry: after shutdown there is no /metrics to ask."""
        return scrape(generate_latest(self.app.gateway.metrics.registry).decode())

    def stream(self, **body: Any) -> asyncio.Task[tuple[int, bytes]]:
        return asyncio.create_task(_stream(self.client, self.gw, {**STREAM, **body}))


async def _stream(client: httpx.AsyncClient, gw: str, body: dict[str, Any]
                  ) -> tuple[int, bytes]:
    """Status and body of one streamed request; a stream cut short ends with b'<cut>'."""
    out = b""
    async with client.stream("POST", gw + "/v1/completions", json=body) as r:
        try:
            async for chunk in r.aiter_raw():
                out += chunk
        except httpx.RemoteProtocolError:  # closed before the last chunk: a cut
            out += b"<cut>"
        return r.status_code, out


@contextlib.asynccontextmanager
async def rig(engine: FakeEngine, grace: float, limit: int = 1) -> AsyncIterator[Rig]:
    async with serve(engine) as up:
        app = build_app(gw_config(up, limit=limit, server={"shutdown_grace": grace}))
        server = QuietServer(uvicorn_config(app))
        async with running(server) as gw, httpx.AsyncClient(timeout=10) as client:
            yield Rig(engine, app, server, gw, client)


def assert_idle(m: dict[Any, float]) -> None:
    assert_conserved(m)
    assert total(m, "kneegate_in_flight") == 0 and total(m, "kneegate_queue_depth") == 0


def assert_shutting_down(r: httpx.Response) -> None:
    assert r.status_code == 503
    assert int(r.headers["retry-after"]) >= 1
    assert r.headers["x-kneegate-reject-reason"] == "shutting_down"
    err = r.json()["error"]
    assert err["code"] == "shutting_down" and err["type"] == "server_error"


async def test_shutdown_refuses_the_queue_and_lets_streams_finish() -> None:
    async with rig(FakeEngine(interval=0.03), grace=5) as g:
        streaming = g.stream()  # ~0.6 s
        await until(g.engine.started.is_set)
        queued = asyncio.create_task(g.client.post(g.gw + "/v1/completions", json={}))
        await until(lambda: g.app.gateway.queue.depth() == 1)
        started = time.monotonic()
        g.server.should_exit = True  # what SIGTERM does
        assert_shutting_down(await queued)
        status, body = await streaming
        assert status == 200 and body.endswith(b"data: [DONE]\n\n")
    assert time.monotonic() - started < 3  # the grace is an upper bound, not a wait
    m = g.metrics()
    assert total(m, "kneegate_requests_shed_total", reason="shutting_down") == 1
    assert total(m, "kneegate_requests_finished_total", outcome="completed") == 1
    assert_idle(m)


async def test_ready_is_503_and_arrivals_are_refused_while_draining() -> None:
    async with rig(FakeEngine(interval=0.03), grace=5) as g:
        assert (await g.client.get(g.gw + "/ready")).status_code == 200
        streaming = g.stream()
        await until(g.engine.started.is_set)
        g.app.gateway.drain()
        r = await g.client.get(g.gw + "/ready")
        assert r.status_code == 503 and r.json()["draining"] is True
        assert_shutting_down(await g.client.post(g.gw + "/v1/completions", json={}))
        status, body = await streaming
        assert status == 200 and body.endswith(b"data: [DONE]\n\n")
        m = scrape((await g.client.get(g.gw + "/metrics")).text)
        assert total(m, "kneegate_requests_shed_total", reason="shutting_down") == 1
        assert_idle(m)


async def test_requests_past_the_grace_are_cut_and_counted() -> None:
    engine = FakeEngine(interval=0.05)
    async with rig(engine, grace=0.5, limit=2) as g:
        long_stream = g.stream(max_tokens=1000)  # 50 s
        await until(engine.started.is_set)
        engine.first_delay = 30  # the next one gets no answer at all
        silent = asyncio.create_task(g.client.post(g.gw + "/v1/completions", json={}))
        await until(lambda: engine.running == 2)
        started = time.monotonic()
        g.server.should_exit = True
        status, body = await long_stream
        assert status == 200 and body.endswith(b"<cut>") and b"[DONE]" not in body
        assert_shutting_down(await silent)  # an answer, not a bare 500
        assert 0.4 < time.monotonic() - started < 3
        with anyio.fail_after(5):  # the engine hears of both: it can stop generating
            while engine.aborts < 2:
                await asyncio.sleep(0.01)
    m = g.metrics()
    assert total(m, "kneegate_requests_finished_total", outcome="client_cancelled") == 2
    assert_idle(m)


# --- `kneegate serve` as a process ---------------------------------------------------


@contextlib.contextmanager
def kneegate(*args: str) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """The gateway in a session of its own: a signal to its group is what a terminal's
    Ctrl-C does, and never reaches pytest."""
    port = free_port()
    with subprocess.Popen([sys.executable, "-m", "kneegate", "serve", "--port", str(port),
                           *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          start_new_session=True) as proc:
        try:
            yield proc, f"http://127.0.0.1:{port}"
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


async def wait_exit(proc: subprocess.Popen[bytes], seconds: float) -> int:
    with anyio.fail_after(seconds):
        while proc.poll() is None:
            await asyncio.sleep(0.02)
    return proc.returncode


async def test_ctrl_c_drains_every_worker() -> None:
    engine = FakeEngine(interval=0.05)
    async with serve(engine) as up, httpx.AsyncClient(timeout=10) as client:
        with kneegate("--upstream", up, "--workers", "2", "--controller", "fixed",
                      "--limit", "16") as (proc, url):
            await until_up(client, url, proc)
            # fresh connections, so the kernel spreads the streams over both workers (8
            # slots each: all 6 are admitted however they are spread)
            async with contextlib.AsyncExitStack() as stack:
                clients = [await stack.enter_async_context(httpx.AsyncClient(timeout=10))
                           for _ in range(6)]
                streams = [asyncio.create_task(_stream(c, url, {**STREAM, "max_tokens": 30}))
                           for c in clients]
                await until(lambda: engine.running == 6)
                os.killpg(proc.pid, signal.SIGINT)  # the terminal's Ctrl-C: the whole group
                results = await asyncio.gather(*streams)
            assert all(s == 200 and b.endswith(b"data: [DONE]\n\n") for s, b in results)
            assert await wait_exit(proc, 5) == 0
            assert engine.aborts == 0


async def test_sighup_keeps_the_embedded_engine_with_workers() -> None:
    pytest.importorskip("kneegate.emulator.server")
    req = {"model": "cpu-tiny", "prompt": "hi", "max_tokens": 2}
    async with httpx.AsyncClient(timeout=5) as client:
        with kneegate("--workers", "2") as (proc, url):
            await until_up(client, url, proc)
            assert (await client.post(url + "/v1/completions", json=req)).status_code == 200
            proc.send_signal(signal.SIGHUP)  # no --config: each worker counts a failed reload
            with anyio.fail_after(5):
                while "reloads_total{result=" not in (await client.get(url + "/metrics")).text:
                    await asyncio.sleep(0.05)
            for _ in range(4):  # fresh connections: both workers, each to the engine
                async with httpx.AsyncClient(timeout=5) as fresh:
                    r = await fresh.post(url + "/v1/completions", json=req)
                    assert r.status_code == 200
            proc.send_signal(signal.SIGTERM)
            assert await wait_exit(proc, 10) == 0


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


async def test_workers_and_engine_exit_when_the_supervisor_is_killed() -> None:
    # Workers run in their own process groups (one Ctrl-C each): a SIGKILLed supervisor
    # must not leave them serving on, unseen (helpers' runs left 28 such processes).
    async with httpx.AsyncClient(timeout=5) as client:
        with kneegate("--workers", "2") as (proc, url):
            await until_up(client, url, proc)
            kids = _children(proc.pid)
            assert len(kids) == 3  # the embedded engine and two workers
            proc.kill()
            with anyio.fail_after(10):
                while any(_alive(k) for k in kids):
                    await asyncio.sleep(0.05)
