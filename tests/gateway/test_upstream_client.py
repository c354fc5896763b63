"""The lean upstream client against hand-written HTTP/1.1 servers (raw asyncio, loopback)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Callable

import anyio
import pytest

from gateway.errors import UpstreamConnectError, UpstreamError
from gateway.upstream_client import UpstreamClient

pytestmark = pytest.mark.anyio

class RawServer:
    """Answers every request on a connection with `reply(n)`; counts connections."""

    def __init__(self, reply: Callable[[int], bytes], close_after: bool = False) -> None:
        self.reply, self.close_after = reply, close_after
        self.connections = 0
        self.requests: list[bytes] = []
        self.writers: list[asyncio.StreamWriter] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.writers.append(writer)
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                self.requests.append(head + await reader.readexactly(length))
                writer.write(self.reply(len(self.requests)))
                await writer.drain()
                if self.close_after:
                    break
        writer.close()


@contextlib.asynccontextmanager
async def raw_server(server: RawServer) -> AsyncIterator[str]:
    srv = await asyncio.start_server(server.handle, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        for w in server.writers:
            w.close()
        srv.close()


def fixed(body: bytes, extra: bytes = b"") -> Callable[[int], bytes]:
    return lambda n: (b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\nX-N: %d\r\n%s\r\n%s"
                      % (len(body), n, extra, body))


async def test_keep_alive_connection_is_reused() -> None:
    server = RawServer(fixed(b"hello"))
    client = UpstreamClient(connect_timeout=2)
    async with raw_server(server) as base:
        for i in (1, 2, 3):
            resp = await client.open("POST", base, b"/v1/x?q=1", [(b"x-a", b"b")], b"{}")
            assert resp.status == 200 and (b"x-n", str(i).encode()) in resp.headers
            assert await resp.read_all() == b"hello"
            resp.release()
        assert server.connections == 1
        assert server.requests[0].startswith(b"POST /v1/x?q=1 HTTP/1.1\r\n")
        assert b"content-length: 2\r\n" in server.requests[0]
        await client.close()


async def test_body_delimited_by_close_is_read_to_the_end() -> None:
    server = RawServer(lambda n: b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nall of it",
                       close_after=True)
    client = UpstreamClient(connect_timeout=2)
    async with raw_server(server) as base:
        resp = await client.open("GET", base, b"/", [], b"")
        with anyio.fail_after(2):
            assert await resp.read_all() == b"all of it"
        resp.release()
        resp = await client.open("GET", base, b"/", [], b"")  # a fresh connection
        assert server.connections == 2
        await client.close()


async def test_idle_connection_closed_by_the_engine_is_replaced() -> None:
    server = RawServer(fixed(b"ok"))
    client = UpstreamClient(connect_timeout=2)
    async with raw_server(server) as base:
        resp = await client.open("GET", base, b"/", [], b"")
        await resp.read_all()
        resp.release()
        for w in server.writers:  # the engine drops its idle keep-alive connection
            w.close()
        await asyncio.sleep(0.05)  # let the FIN arrive (or not: both paths must work)
        resp = await client.open("GET", base, b"/", [], b"")
        assert await resp.read_all() == b"ok"
        assert server.connections == 2
        await client.close()


async def test_connection_refused_is_connect_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        base = f"http://127.0.0.1:{s.getsockname()[1]}"
        client = UpstreamClient(connect_timeout=2)
        with pytest.raises(UpstreamConnectError, match="cannot connect"):
            await client.open("GET", base, b"/", [], b"")


async def test_garbage_and_truncation_are_upstream_errors() -> None:
    client = UpstreamClient(connect_timeout=2)
    async with raw_server(RawServer(lambda n: b"NOT HTTP AT ALL\r\n\r\n")) as base:
        with anyio.fail_after(2), pytest.raises(UpstreamError):
            await client.open("GET", base, b"/", [], b"")
    cut = RawServer(lambda n: b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nshort",
                    close_after=True)
    async with raw_server(cut) as base:
        resp = await client.open("GET", base, b"/", [], b"")
        with anyio.fail_after(2), pytest.raises(ConnectionError):
            await resp.read_all()


async def test_get_text_for_probes() -> None:
    client = UpstreamClient(connect_timeout=2)
    async with raw_server(RawServer(fixed(b"vllm:num_requests_running 3\n"))) as base:
        status, text = await client.get_text(base + "/metrics", timeout=2)
        assert (status, text) == (200, "vllm:num_requests_running 3\n")
        await client.close()
