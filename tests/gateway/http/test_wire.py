"""The push relay (gateway/http/wire.py + UpstreamClient.pipe): order, back-pressure, fallback.

Under kneegate's server the upstream socket's callback writes each chunk to the client;
when the client's socket pushes back, the chunk goes through ASGI `send` instead (which
waits for the drain) and nothing may overtake it. On any other ASGI server the proxy
relays through `send` alone and notices disconnects with a watcher task.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import anyio
import httptools
import httpx
import pytest
from helpers.gateway import FakeEngine, answer_lifespan, gw_config, serve
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from kneegate.gateway.app import build_app
from kneegate.gateway.http.body_writer import BodyWriter, probe
from kneegate.gateway.http.wire import KneegateHttpProtocol
from kneegate.gateway.upstream.client import UpstreamClient

pytestmark = pytest.mark.anyio


class ScriptedUpstream:
    """A raw HTTP/1.1 server whose response bytes the test writes, one piece at a time."""

    def __init__(self) -> None:
        self.writer: asyncio.StreamWriter | None = None
        self.connected = asyncio.Event()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        self.writer = writer
        self.connected.set()

    def write(self, data: bytes) -> None:
        assert self.writer is not None
        self.writer.write(data)


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


async def test_pipe_pushes_in_order_and_hands_back_refused_and_last_bytes() -> None:
    up = ScriptedUpstream()
    srv = await asyncio.start_server(up.handle, "127.0.0.1", 0)
    base = f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}"
    client = UpstreamClient(connect_timeout=2)
    pushed: list[bytes] = []
    accept = True
    arrived = asyncio.Event()

    def sink(data: bytes) -> bool:
        arrived.set()
        if accept:
            pushed.append(data)
        return accept

    try:
        with anyio.fail_after(5):
            opening = asyncio.create_task(client.open("GET", base, b"/s", [], b""))
            await up.connected.wait()
            up.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + _chunk(b"a"))
            resp = await opening
            piping = asyncio.create_task(resp.pipe(sink))
            await arrived.wait()  # "a" was buffered before pipe: pushed when it starts
            arrived.clear()
            up.write(_chunk(b"b"))
            await arrived.wait()
            assert pushed == [b"a", b"b"] and not piping.done()

            accept = False  # the client's socket is full: "c" must come back, unwritten
            up.write(_chunk(b"c"))
            assert await piping == b"c"
            assert not resp.ended()

            accept = True  # the caller wrote "c" its own way; "d" arrives meanwhile
            up.write(_chunk(b"d"))
            up.write(_chunk(b"e") + b"0\r\n\r\n")  # the last bytes arrive with the end
            rest = await resp.pipe(sink)
            assert b"".join(pushed) + rest == b"abde"  # nothing lost, nothing reordered
            assert rest.endswith(b"e") and resp.ended()
            assert await resp.pipe(sink) == b""
            resp.release()
    finally:
        await client.close()
        if up.writer is not None:
            up.writer.close()
        srv.close()


def test_the_probe_names_what_a_request_cycle_lacks_or_types_otherwise() -> None:
    cycle = SimpleNamespace(
        transport=SimpleNamespace(write=len, close=len),
        flow=SimpleNamespace(write_paused=False, drain=len), disconnected=False,
        response_started=False, response_complete=False, chunked_encoding=None,
        message_event=asyncio.Event(), on_response=len)
    assert probe(cycle) == []
    del cycle.flow.write_paused  # say, renamed by a newer uvicorn
    cycle.disconnected = 0
    cycle.chunked_encoding = True
    assert probe(cycle) == ["flow.write_paused: missing", "disconnected: int"]


class RecordingTransport:
    """What a request cycle writes to its connection, one entry per write."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        assert not self.closed, "written after close"
        self.writes.append(data)

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed


def _cycle(transport: RecordingTransport, keep_alive: bool) -> RequestResponseCycle:
    scope = {"type": "http", "method": "POST", "http_version": "1.1", "path": "/v1/x",
             "raw_path": b"/v1/x", "query_string": b"", "headers": [], "client": None,
             "server": None, "scheme": "http", "root_path": ""}
    return RequestResponseCycle(
        scope=scope, transport=transport, flow=SimpleNamespace(write_paused=False),
        logger=logging.getLogger("t"), access_logger=logging.getLogger("t"), access_log=False,
        default_headers=[], message_event=asyncio.Event(), expect_100_continue=False,
        keep_alive=keep_alive, on_response=lambda: None)


@pytest.mark.parametrize("keep_alive", [True, False])
async def test_send_whole_writes_head_and_body_once_with_the_bytes_of_two_sends(
        keep_alive: bool) -> None:
    start = {"type": "http.response.start", "status": 200,
             "headers": [(b"content-type", b"application/json")]}
    body = b'{"ok": true}'
    apart = RecordingTransport()
    cycle = _cycle(apart, keep_alive)
    await cycle.send(start)
    await cycle.send({"type": "http.response.body", "body": body, "more_body": False})
    assert len(apart.writes) == 2  # what plain ASGI costs: two writes

    together = RecordingTransport()
    cycle = _cycle(together, keep_alive)
    await BodyWriter(cycle).send_whole(cycle.send, start, body)
    assert together.writes == [b"".join(apart.writes)]
    assert cycle.transport is together and cycle.response_complete
    assert together.closed is (not keep_alive)  # closed after the bytes, never before


async def test_send_whole_writes_nothing_to_a_client_gone() -> None:
    transport = RecordingTransport()
    cycle = _cycle(transport, True)
    cycle.disconnected = True
    transport.closed = True
    start = {"type": "http.response.start", "status": 200, "headers": []}
    await BodyWriter(cycle).send_whole(cycle.send, start, b"x")
    assert transport.writes == []


class BigStream:
    """An ASGI engine streaming `count` distinct events of `size` bytes as fast as it can."""

    def __init__(self, count: int, size: int, mark: int) -> None:
        self.events = [b"data: %08d %s\n\n" % (i, bytes([97 + i % 26]) * size)
                       for i in range(count)]
        self.sent = 0
        self.mark, self.past_mark = mark, asyncio.Event()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await answer_lifespan(receive, send)
            return
        if scope["path"] == "/health":  # the gateway's start-up probe
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"{}"})
            return
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        for ev in self.events:
            await send({"type": "http.response.body", "body": ev, "more_body": True})
            self.sent += len(ev)
            if self.sent >= self.mark:
                self.past_mark.set()
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _slow_client(gw: str, started: asyncio.Event) -> bytes:
    """POST through a socket with a tiny receive buffer; read only once `started` fires."""
    host, port = gw.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # no autotuning either
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
    reader, writer = await asyncio.open_connection(sock=sock, limit=4096)
    body = b'{"stream": true}'
    writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json"
                 b"\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
    await started.wait()
    parts: list[bytes] = []
    parser = httptools.HttpResponseParser(_Collect(parts))
    while data := await reader.read(65536):
        parser.feed_data(data)
    writer.close()
    return b"".join(parts)


class _Collect:
    def __init__(self, parts: list[bytes]) -> None:
        self.on_body = parts.append


async def test_back_pressure_from_a_slow_client_loses_and_reorders_nothing(
    relay: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    written = refused = drained = 0
    write, drain = BodyWriter.write, FlowControl.drain

    def counting(self: BodyWriter, data: bytes) -> bool:
        nonlocal written, refused
        ok = write(self, data)
        written += ok
        refused += not ok
        return ok

    async def counting_drain(self: FlowControl) -> None:
        nonlocal drained
        drained += 1
        await drain(self)

    monkeypatch.setattr(BodyWriter, "write", counting)
    monkeypatch.setattr(FlowControl, "drain", counting_drain)
    engine = BigStream(count=256, size=16 * 1024, mark=1 << 20)  # 4 MiB; read after 1 MiB
    async with serve(engine) as up, serve(build_app(gw_config(up))) as gw:
        with anyio.fail_after(20):
            body = await _slow_client(gw, engine.past_mark)
    assert body == b"".join(engine.events)
    # the premise: the client's socket did push back, and `send` waited for it to drain
    assert drained > 0
    if relay == "push":  # the writer carried chunks, and refused them while it pushed back
        assert written > 0 and refused > 0
    else:
        assert written == refused == 0


@contextlib.asynccontextmanager
async def _gateway(engine: FakeEngine, http: type[asyncio.Protocol] | str
                   ) -> AsyncIterator[tuple[str, str, Any]]:
    async with serve(engine) as up:
        app = build_app(gw_config(up, limit=2))
        async with serve(app, http=http) as gw:
            yield up, gw, app


@pytest.mark.parametrize(("relay", "http"), [
    ("push", KneegateHttpProtocol), ("send", KneegateHttpProtocol), ("push", "httptools"),
], ids=["kneegate-protocol", "kneegate-protocol-fallback", "stock-uvicorn"], indirect=["relay"])
async def test_relay_and_disconnect_with_and_without_the_extension(
    relay: str, http: type[asyncio.Protocol] | str,
) -> None:
    engine = FakeEngine(interval=0.002)
    async with _gateway(engine, http) as (up, gw, app), httpx.AsyncClient(timeout=10) as c:
        req = {"max_tokens": 40, "stream": True}
        direct = await c.post(up + "/v1/completions", json=req)
        via = await c.post(gw + "/v1/completions", json=req)
        assert via.content == direct.content and via.content.endswith(b"data: [DONE]\n\n")

        engine.interval = 0.05
        async with c.stream("POST", gw + "/v1/completions",
                            json={"max_tokens": 1000, "stream": True}) as r:
            async for _ in r.aiter_raw():
                break  # one chunk, then hang up
        with anyio.fail_after(1):
            await engine.aborted.wait()
        with anyio.fail_after(2):
            while app.gateway.pool.active[0].inflight:
                await asyncio.sleep(0.01)
