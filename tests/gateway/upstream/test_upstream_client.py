"""The lean upstream client against hand-written HTTP/1.1 servers (raw asyncio, loopback)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Callable

import anyio
import pytest
from helpers.faulty_upstream import blackhole

from kneegate.gateway.errors import (
    UpstreamConnectError,
    UpstreamConnectTimeout,
    UpstreamError,
    UpstreamTimeout,
)
from kneegate.gateway.upstream.client import UpstreamClient

pytestmark = pytest.mark.anyio

class RawServer:
    """Answers every request on a connection with `reply(n)`; counts connections."""

    def __init__(self, reply: Callable[[int], bytes], close_after: bool = False) -> None:
        self.reply, self.close_after = reply, close_after
        self.connections = 0
        self.requests: list[bytes] = []
        self.writers: list[asyncio.StreamWriter] = []
        self.ended = asyncio.Event()  # a connection ended (the client closed it)

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
        self.ended.set()


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


async def test_one_parser_reads_chunked_answers_one_after_another() -> None:
    # the connection's parser is made once and reads every response of the connection
    def chunked(n: int) -> bytes:
        events = b"".join(b"%x\r\n%b\r\n" % (len(e), e) for e in (b"a%d" % n, b"bc"))
        return b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + events + b"0\r\n\r\n"

    server = RawServer(chunked)
    client = UpstreamClient(connect_timeout=2)
    async with raw_server(server) as base:
        for i in (1, 2, 3):
            resp = await client.open("GET", base, b"/", [], b"")
            with anyio.fail_after(2):
                assert await resp.read_all() == b"a%dbc" % i
            resp.release()
        assert server.connections == 1
        await client.close()


async def test_a_body_nobody_reads_stops_the_socket_at_the_high_water_mark() -> None:
    body = b"x" * (3 << 20)
    server = RawServer(fixed(body))
    client = UpstreamClient(connect_timeout=2)
    async with raw_server(server) as base:
        resp = await client.open("GET", base, b"/", [], b"")
        transport = resp._conn.transport
        assert transport is not None
        with anyio.fail_after(5):
            while transport.is_reading():  # the engine's bytes keep coming until the mark
                await asyncio.sleep(0.01)
        assert (1 << 20) < resp._conn.buffered < len(body)
        with anyio.fail_after(5):
            assert await resp.read_all() == body  # reading resumes what was stopped
        resp.release()
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


# --- issue 11: a peer out of step never hands one request another's answer ------------

UNASKED = b"HTTP/1.1 200 OK\r\ncontent-length: 6\r\nX-N: 99\r\n\r\nstolen"


async def _get(client: UpstreamClient, base: str) -> tuple[int, bytes, bytes]:
    """One GET: (status, X-N header, body)."""
    with anyio.fail_after(2):
        resp = await client.open("GET", base, b"/", [], b"")
        body = await resp.read_all()
    resp.release()
    return resp.status, dict(resp.headers).get(b"x-n", b""), body


async def test_bytes_on_an_idle_pooled_connection_close_it() -> None:
    server = RawServer(fixed(b"hello"))
    client = UpstreamClient(connect_timeout=2)
    async with raw_server(server) as base:
        assert await _get(client, base) == (200, b"1", b"hello")
        server.writers[0].write(UNASKED)  # a late or unsolicited response, unasked
        with anyio.fail_after(2):
            await server.ended.wait()  # the client read it while idle and hung up
        assert await _get(client, base) == (200, b"2", b"hello")
        assert server.connections == 2
        await client.close()


async def test_unread_bytes_in_the_socket_keep_a_connection_out_of_use() -> None:
    server = RawServer(fixed(b"hello"))
    client = UpstreamClient(connect_timeout=2)
    async with raw_server(server) as base:
        assert await _get(client, base) == (200, b"1", b"hello")
        # in the client's socket now, but the loop has not delivered it: taken at once
        server.writers[0].write(UNASKED)
        assert await _get(client, base) == (200, b"2", b"hello")
        assert server.connections == 2
        await client.close()


async def test_the_connection_tells_the_pool_and_the_pool_keeps_the_lists() -> None:
    server = RawServer(fixed(b"hello"))
    client = UpstreamClient(connect_timeout=2)
    told: list[tuple[object, bool]] = []
    forgotten = asyncio.Event()
    pool_release = client._release

    def spy(conn) -> None:  # the connection's only way into the pool
        told.append((conn, conn.closed))
        pool_release(conn)
        if conn.closed:
            forgotten.set()

    client._release = spy  # type: ignore[method-assign]
    async with raw_server(server) as base:
        assert await _get(client, base) == (200, b"1", b"hello")
        ((conn, closed),) = told
        assert not closed and list(client._idle[conn.key]) == [conn]  # filed as idle
        server.writers[0].close()  # the engine drops the idle connection
        with anyio.fail_after(2):
            await forgotten.wait()
        assert told[1] == (conn, True) and not client._idle[conn.key]  # forgotten
        assert await _get(client, base) == (200, b"2", b"hello")
        assert server.connections == 2
        await client.close()
    assert all(c.closed for c, _ in told[2:]) and not client._idle


async def test_a_second_response_after_the_answer_closes_the_connection() -> None:
    server = RawServer(lambda n: fixed(b"hello")(n) + UNASKED)
    client = UpstreamClient(connect_timeout=2)
    async with raw_server(server) as base:
        assert await _get(client, base) == (200, b"1", b"hello")
        assert await _get(client, base) == (200, b"2", b"hello")
        assert server.connections == 2
        await client.close()


async def test_interim_responses_are_skipped_for_the_final_one() -> None:
    interim = (b"HTTP/1.1 100 Continue\r\n\r\n"
               b"HTTP/1.1 103 Early Hints\r\nlink: </a.css>; rel=preload\r\n\r\n")
    server = RawServer(lambda n: interim + fixed(b"final")(n))
    client = UpstreamClient(connect_timeout=2)
    async with raw_server(server) as base:
        with anyio.fail_after(2):
            resp = await client.open("POST", base, b"/v1/x", [], b"{}")
            assert resp.status == 200
            assert [k for k, _ in resp.headers] == [b"content-length", b"x-n"]
            assert await resp.read_all() == b"final"
        resp.release()
        assert await _get(client, base) == (200, b"2", b"final")  # and the connection reused
        assert server.connections == 1
        await client.close()


async def test_unasked_switching_protocols_is_an_upstream_error() -> None:
    server = RawServer(lambda n: b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\n"
                       b"connection: upgrade\r\n\r\n")
    client = UpstreamClient(connect_timeout=2)
    async with raw_server(server) as base:
        with anyio.fail_after(2), pytest.raises(UpstreamError) as info:
            await client.open("GET", base, b"/", [], b"")
        assert info.value.status == 502
        assert info.value.reason == "unexpected protocol switch"
        with anyio.fail_after(2):
            await server.ended.wait()  # closed, never pooled
        await client.close()


class EndlessHead:
    """A status line, then header fields until the client hangs up (or CAP bytes)."""

    CAP = 16 << 20

    def __init__(self) -> None:
        self.sent = 0
        self.writers: list[asyncio.StreamWriter] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writers.append(writer)
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\n")
        line = b"x-filler: " + b"a" * 8180 + b"\r\n"  # 8 KiB a field
        with contextlib.suppress(ConnectionError, RuntimeError):  # uvloop: closed transport
            while self.sent < self.CAP:
                writer.write(line)
                self.sent += len(line)
                await writer.drain()
        writer.close()


async def test_an_endless_response_head_is_cut_at_the_limit() -> None:
    head = EndlessHead()
    client = UpstreamClient(connect_timeout=2, max_header_bytes=64 << 10)
    srv = await asyncio.start_server(head.handle, "127.0.0.1", 0)
    base = f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}"
    try:
        with anyio.fail_after(5), pytest.raises(UpstreamError) as info:
            await client.open("GET", base, b"/", [], b"")
        assert info.value.status == 502
        assert info.value.reason == "response headers too large"
        # the client hung up near the limit: the server got out socket buffers' worth
        # (~4 MiB on loopback), not all it meant to send
        assert head.sent < EndlessHead.CAP
    finally:
        for w in head.writers:
            w.transport.abort()
        srv.close()
        await client.close()


async def test_a_head_over_the_limit_in_one_chunk_is_refused() -> None:
    big = b"x-big: " + b"b" * 4000 + b"\r\n"
    server = RawServer(fixed(b"ok", big))
    client = UpstreamClient(connect_timeout=2, max_header_bytes=1024)
    async with raw_server(server) as base:
        with anyio.fail_after(2), pytest.raises(UpstreamError, match="over 1024 bytes"):
            await client.open("GET", base, b"/", [], b"")
    small = UpstreamClient(connect_timeout=2, max_header_bytes=1024)
    async with raw_server(RawServer(fixed(b"ok", b"x-ok: 1\r\n"))) as base:
        assert (await _get(small, base))[0] == 200
        await small.close()


async def test_connect_timeout_is_a_connect_failure() -> None:
    client = UpstreamClient(connect_timeout=0.1)
    with blackhole() as base, anyio.fail_after(2), pytest.raises(
            UpstreamConnectTimeout) as info:
        await client.open("GET", base, b"/", [], b"")
    exc = info.value
    assert isinstance(exc, UpstreamTimeout) and exc.unreached and exc.status == 504
    assert exc.reason == "connect timed out"


async def test_public_errors_name_the_upstream_and_nothing_internal() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        client = UpstreamClient(connect_timeout=2)
        with pytest.raises(UpstreamConnectError) as info:
            await client.open("GET", f"http://127.0.0.1:{port}", b"/", [], b"")
    assert str(port) in info.value.message  # the log's version has the details
    public = info.value.public("e0")
    assert type(public) is UpstreamConnectError
    assert public.message == "upstream 'e0' failed: connection refused; retry later"
