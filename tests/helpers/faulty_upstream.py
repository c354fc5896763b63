"""A deliberately faulty HTTP/1.1 upstream on raw asyncio: one mode per fault (issue 11).

    async with faulty_upstream("reset_mid_body") as up:
        ...  # a gateway in front of up.url

`/health`, `/metrics` and `/v1/models` are always answered correctly (the gateway probes,
scrapes and reads them); every other path gets the mode's fault. Normal answers are JSON bodies
`{"n": <request number>}` on a keep-alive connection, so a test can tell whose answer a
client got. Modes:

    ok                    answers correctly
    refused               nothing listens on the port (connect refused)
    blackhole             the port's accept queue is full: connects time out
    reset_before_headers  reads the request, then resets the connection (RST)
    reset_mid_body        headers and part of the body, then RST
    hang_before_headers   reads the request, never answers
    stall_mid_stream      SSE headers and one event, then silence
    garbage               answers with bytes that are not HTTP
    huge_headers          a 2 MiB header block
    short_content_length  Content-Length 100, 10 bytes, then closes
    interim_1xx           100 Continue and 103 Early Hints, then the final answer
    switching_101         101 Switching Protocols (nobody asked)
    unsolicited           answers, then sends a second, unasked-for response on the
                          idle keep-alive connection (sets `unsolicited_sent`)
    slow_drip             a streamed answer one byte at a time, `drip` seconds apart
    freezable             answers correctly until `freeze()`; then nothing (health and
                          metrics included) until `thaw()` (an engine under SIGSTOP)
    valve_stall           a small 503 that starts like vLLM's valve refusal, half its
                          body, then silence; sets `peer_closed` when the gateway closes
                          the connection (an exchange cut while the refusal is read)

Whatever hangs is released when the context exits, so servers stop promptly.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import struct
from collections.abc import AsyncIterator, Iterator

__all__ = ["MODES", "FaultyUpstream", "blackhole", "faulty_upstream"]

MODES = (
    "ok", "refused", "blackhole", "reset_before_headers", "reset_mid_body",
    "hang_before_headers", "stall_mid_stream", "garbage", "huge_headers",
    "short_content_length", "interim_1xx", "switching_101", "unsolicited", "slow_drip",
    "freezable", "valve_stall",
)
HUGE = 2 << 20  # bytes of header block sent by `huge_headers`
METRICS = b"vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n"
MODELS = b'{"object": "list", "data": [{"id": "m", "max_model_len": 4096}]}'
_WELL = {"/health": b"{}", "/metrics": METRICS, "/v1/models": MODELS}  # answered right


def _response(body: bytes, status: bytes = b"200 OK", ctype: bytes = b"application/json",
              extra: bytes = b"") -> bytes:
    return (b"HTTP/1.1 %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n%s\r\n%s"
            % (status, ctype, len(body), extra, body))


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


_SSE_HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
             b"transfer-encoding: chunked\r\n\r\n")


class FaultyUpstream:
    """The server; `url` once started. Counts `connections` and `requests`."""

    def __init__(self, mode: str, drip: float = 0.02) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; choose one of {MODES}")
        self.mode, self.drip = mode, drip
        self.url = ""
        self.connections = self.requests = 0
        self.unsolicited_sent = asyncio.Event()
        self.released = asyncio.Event()  # set at exit: whatever hangs returns
        self.thawed = asyncio.Event()
        self.thawed.set()
        self.peer_closed = asyncio.Event()
        self._writers: list[asyncio.StreamWriter] = []
        self._server: asyncio.Server | None = None

    def freeze(self) -> None:
        self.thawed.clear()

    def thaw(self) -> None:
        self.thawed.set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    def kill(self) -> None:
        """Die as a killed process does: stop listening, reset every connection."""
        if self._server is not None:
            self._server.close()
        for w in self._writers:
            _reset(w)

    async def stop(self) -> None:
        self.released.set()
        self.thawed.set()
        self.kill()
        if self._server is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(2):
                    await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.append(writer)
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError, OSError):
            while True:
                path = await _read_request(reader)
                if self.mode == "freezable" and not self.thawed.is_set():
                    await self.thawed.wait()
                if path in _WELL:
                    writer.write(_response(_WELL[path]))
                    await writer.drain()
                    continue
                self.requests += 1
                if self.mode == "valve_stall":
                    await self._valve_stall(reader, writer)
                    break
                if not await self._answer(writer):
                    break
        writer.close()

    async def _answer(self, w: asyncio.StreamWriter) -> bool:
        """Answer one request in the mode's way; False when the connection is done."""
        mode, body = self.mode, json.dumps({"n": self.requests}).encode()
        if mode in ("ok", "freezable"):
            w.write(_response(body))
        elif mode == "reset_before_headers":
            _reset(w)
            return False
        elif mode == "reset_mid_body":
            w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 1000\r\n\r\n" + b"x" * 10)
            await w.drain()
            _reset(w)
            return False
        elif mode == "hang_before_headers":
            await self.released.wait()
            return False
        elif mode == "stall_mid_stream":
            w.write(_SSE_HEAD + _chunk(b'data: {"choices": []}\n\n'))
            await w.drain()
            await self.released.wait()
            return False
        elif mode == "garbage":
            w.write(b"NOT HTTP AT ALL\r\n\r\n")
        elif mode == "huge_headers":
            await self._huge_headers(w)
            return False
        elif mode == "short_content_length":
            w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n" + b"x" * 10)
            await w.drain()
            return False
        elif mode == "interim_1xx":
            w.write(b"HTTP/1.1 100 Continue\r\n\r\n"
                    b"HTTP/1.1 103 Early Hints\r\nlink: </style.css>; rel=preload\r\n\r\n")
            await w.drain()
            w.write(_response(body))
        elif mode == "switching_101":
            w.write(b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\n"
                    b"connection: upgrade\r\n\r\n")
        elif mode == "unsolicited":
            await self._unsolicited(w, body)
        elif mode == "slow_drip":
            await self._slow_drip(w, body)
        await w.drain()
        return True

    async def _valve_stall(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        body = (b'{"object": "error", "message": "The server is busy and cannot accept new '
                b'requests. Please try again later or on a different instance.", "code": 503}')
        w.write(b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n%s" % (len(body), body[:len(body) // 2]))
        await w.drain()
        if await r.read() == b"" and not self.released.is_set():  # EOF: the gateway closed
            self.peer_closed.set()

    async def _huge_headers(self, w: asyncio.StreamWriter) -> None:
        w.write(b"HTTP/1.1 200 OK\r\n")
        line = b"x-filler: " + b"a" * 1014 + b"\r\n"  # 1 KiB a header
        for _ in range(HUGE // len(line)):  # the gateway gives up long before the end
            w.write(line)
            await w.drain()
        w.write(b"content-length: 2\r\n\r\n{}")
        await w.drain()

    async def _unsolicited(self, w: asyncio.StreamWriter, body: bytes) -> None:
        w.write(_response(body))
        await w.drain()
        # another response nobody asked for: it must never reach the next client
        w.write(_response(b'{"stolen": true}'))
        await w.drain()
        self.unsolicited_sent.set()

    async def _slow_drip(self, w: asyncio.StreamWriter, body: bytes) -> None:
        w.write(_SSE_HEAD)
        for byte in b"data: " + body + b"\n\ndata: [DONE]\n\n":
            await asyncio.sleep(self.drip)
            w.write(_chunk(bytes([byte])))
            await w.drain()
        w.write(b"0\r\n\r\n")


async def _read_request(reader: asyncio.StreamReader) -> str:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    await reader.readexactly(length)
    return head.split(b" ", 2)[1].decode("latin-1").split("?")[0]


def _reset(w: asyncio.StreamWriter) -> None:
    """Close with an RST, not a FIN (SO_LINGER 0), as a crashed process's kernel would."""
    if w.transport.is_closing():
        return
    sock = w.get_extra_info("socket")
    with contextlib.suppress(OSError, ValueError):  # ValueError: uvloop, already closed
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    w.transport.abort()


@contextlib.contextmanager
def blackhole() -> Iterator[str]:
    """The URL of a loopback port whose accept queue is full: the kernel drops a new
    connect's SYN, so the connect times out (a blackholed host, without leaving loopback)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(0)  # room for one connection not yet accepted
    addr = srv.getsockname()
    fillers = [socket.create_connection(addr, timeout=2)]  # fills it; never accepted
    try:
        yield f"http://127.0.0.1:{addr[1]}"
    finally:
        for c in fillers:
            c.close()
        srv.close()


@contextlib.asynccontextmanager
async def faulty_upstream(mode: str, drip: float = 0.02) -> AsyncIterator[FaultyUpstream]:
    """A started FaultyUpstream (`.url`), stopped on exit."""
    if mode == "refused":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))  # bound, never listening: connects are refused
            up = FaultyUpstream(mode)
            up.url = f"http://127.0.0.1:{s.getsockname()[1]}"
            yield up
        return
    if mode == "blackhole":
        with blackhole() as url:
            up = FaultyUpstream(mode)
            up.url = url
            yield up
        return
    up = FaultyUpstream(mode, drip)
    await up.start()
    try:
        yield up
    finally:
        await up.stop()
