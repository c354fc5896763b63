"""One connection to an engine (an asyncio protocol parsing with httptools) and its response.

`UpstreamClient` (gateway/upstream/client.py) opens these, pools them and hands the caller
an `UpstreamResponse`; a connection parses one response at a time and hands over whatever
body bytes are buffered as one chunk (`read`), or pushes them to a sink from the socket's
callback (`pipe`).

What a peer sends is never trusted to line up with what was asked (issue 11):
- a connection is read only inside an exchange: bytes that arrive while it idles in the
  pool (an unsolicited or late response) close it, and a connection with unread bytes in
  its socket is never handed out, so no request can read another's answer; bytes after
  the end of the response it answers close it too;
- interim responses (100 Continue, 103 Early Hints) are skipped: the request gets the
  final response; a 101 Switching Protocols (kneegate never asks for one) is an error;
- the response head (status line and header fields) is bounded by `max_header_bytes`,
  counted as bytes arrive, so an endless header block costs at most that much memory.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import termios
from collections.abc import Callable, Coroutine
from typing import Any

import httptools

from kneegate.gateway.errors import UpstreamError

__all__ = ["Origin", "UpstreamConnection", "UpstreamResponse"]

log = logging.getLogger("kneegate.upstream")

Origin = tuple[str, int, bool]  # host, port, TLS
_HIGH_WATER = 1 << 20  # buffered body bytes before we stop reading the engine's socket
_NO_BYTES = bytes(4)  # FIONREAD's answer for an empty socket buffer


class _Stop(Exception):
    """Raised from a parser callback to stop parsing; the reason is in
    `UpstreamConnection.error`."""


class UpstreamConnection(asyncio.Protocol):
    """One keep-alive connection to an engine; parses one response at a time.

    It never touches the pool's lists: it calls `release(self)` when it becomes reusable
    (a response read to its end, `finish`) and when it is closed (by either side), and the
    pool files it as idle or forgets it (httpcore's pool is told the same way).
    """

    def __init__(self, key: Origin, max_header_bytes: int,
                 release: Callable[[UpstreamConnection], None]) -> None:
        self.key, self.max_header_bytes, self._release = key, max_header_bytes, release
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.fd = -1  # the plain socket's descriptor, to look for bytes before reuse
        self.closed = False
        # Body bytes not yet handed over. The parser calls `on_body` once per piece (per
        # chunk of a chunked body: per SSE event), so it is the list's own C `append`; one
        # parser serves every response of the connection (llhttp reads keep-alive
        # messages one after another), so both are made once.
        self.buf: list[bytes] = []
        self.on_body = self.buf.append
        self.parser = httptools.HttpResponseParser(self)
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.buf.clear()
        self.buffered = 0  # bytes read since the body was last handed over (head included)
        self.got_headers = False
        self.got_bytes = False
        self.done = False
        self.error: Exception | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.sink: Callable[[bytes], bool] | None = None  # set while `pipe` runs
        self.head_only = False
        self.framed = False  # Content-Length or chunked: else the body ends at EOF
        self.reusable = False
        self.active = False  # inside an exchange: bytes are expected
        self.interim = False  # parsing a 1xx interim response, skipped
        # the response head's size (1xx heads included), two ways: bytes fed while it was
        # incomplete, and the header fields parsed (a head may complete inside one chunk)
        self.head_fed = 0
        self.head_size = 0

    # --- asyncio.Protocol ------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if not self.active:
            # nobody asked: an unsolicited or late response must never be read as the
            # answer to the next request that takes this connection
            log.warning("upstream %s:%d sent %d bytes on an idle connection; closed it",
                        self.key[0], self.key[1], len(data))
            self.close()
            return
        self.got_bytes = True
        self.buffered += len(data)
        if not self.got_headers:
            self.head_fed += len(data)
        try:
            self.parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            if self.error is None:  # else a callback stopped the parser, the reason set
                self.error = exc
            self.close()
        else:
            if not self.got_headers and self.head_fed > self.max_header_bytes:
                self._head_too_large()
        buf = self.buf
        if buf:
            # Push mode: write through from here, so the relay sleeps on (no task switch per
            # event). The body's last bytes go to the relay instead, which sends them with
            # the end of the response in one write. (`_push`, inline: this runs per event.)
            sink = self.sink
            if sink is not None and not self.done and self.error is None:
                data = buf[0] if len(buf) == 1 else b"".join(buf)
                if sink(data):
                    buf.clear()
                    self.buffered = 0
                    return
                buf[:] = [data]
            if self.buffered > _HIGH_WATER and self.transport is not None:
                self.transport.pause_reading()
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._release(self)
        if self.got_headers and not self.framed and exc is None:
            self.done = True
        if not self.done and self.error is None:
            self.error = exc or ConnectionResetError("upstream closed the connection")
        self._wake()

    # --- httptools callbacks ---------------------------------------------------------

    def on_message_begin(self) -> None:
        if self.done:  # a second response to one request: the peer is out of step
            self.reusable = False
            self.error = ConnectionResetError("upstream sent more than one response")
            raise _Stop

    def on_header(self, name: bytes, value: bytes) -> None:
        # `data_received` bounds a head still arriving; this, one completed in a chunk
        self.head_size += len(name) + len(value) + 4  # "name: value\r\n"
        if self.head_size > self.max_header_bytes:
            self._head_too_large()
            raise _Stop
        name = name.lower()
        if name == b"content-length" or name == b"transfer-encoding":
            self.framed = True
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if status < 200:
            if status == 101:  # kneegate never sends Upgrade: nobody asked for this
                self.error = UpstreamError(
                    f"upstream {self.key[0]}:{self.key[1]} switched protocols unasked",
                    "unexpected protocol switch")
                raise _Stop
            # 100 Continue, 103 Early Hints: not the answer; the final response follows
            self.interim = True
            self.headers.clear()
            self.framed = False
            return
        self.status = status
        self.got_headers = True
        if self.head_only:
            self.done = True

    def on_message_complete(self) -> None:
        if self.interim:
            self.interim = False
            return
        self.done = True
        self.reusable = self.parser.should_keep_alive()  # only true inside this callback

    def _head_too_large(self) -> None:
        limit = self.max_header_bytes
        self.error = UpstreamError(
            f"upstream {self.key[0]}:{self.key[1]} sent a response head over {limit} bytes",
            "response headers too large")
        self.close()

    # --- the reader's side -----------------------------------------------------------

    def _wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    # A waiter is left in place once done; `_wake` skips done (or cancelled) futures, so
    # the reader needs no try/finally per wait.

    def next_wake(self) -> asyncio.Future[None]:
        """A future the socket's next callback resolves (a future: no coroutine per wait)."""
        self.waiter = fut = self.loop.create_future()
        return fut

    def _ended(self) -> bool:
        """True once the body is complete; raises the connection's error if it failed."""
        if self.done:
            return True
        if self.error is not None:
            raise self.error
        return False

    async def read(self) -> bytes:
        """The body bytes buffered so far, waiting for some; b"" at the end."""
        while not self.buf:
            if self._ended():
                return b""
            await self.next_wake()
        return self._take()

    async def pipe(self, sink: Callable[[bytes], bool]) -> bytes:
        """Hand body bytes to `sink` from the socket's callback as they arrive.

        Returns b"" at the end of the body. When `sink` refuses bytes (returns False) they
        stay unwritten and are returned instead: the caller writes them its own (awaiting)
        way and calls `pipe` again. The sink is attached only while `pipe` waits, so bytes
        never overtake the ones the caller holds. The body's last bytes are returned, not
        pushed (`UpstreamResponse.ended()` is then true), so the caller can write them
        together with the end of its response.
        """
        self.sink = sink
        try:
            while True:
                if self.buf and (self.done or not self._push(sink)):
                    return self._take()
                if self._ended():
                    return b""
                await self.next_wake()
        finally:
            self.sink = None

    def _push(self, sink: Callable[[bytes], bool]) -> bool:
        """Give everything buffered to `sink`; False when it refused (kept, as one piece)."""
        buf = self.buf
        data = buf[0] if len(buf) == 1 else b"".join(buf)
        if sink(data):
            buf.clear()
            self.buffered = 0
            return True
        buf[:] = [data]
        return False

    def _take(self) -> bytes:
        buf = self.buf
        data = buf[0] if len(buf) == 1 else b"".join(buf)
        buf.clear()
        if self.buffered > _HIGH_WATER and self.transport is not None:
            self.transport.resume_reading()
        self.buffered = 0
        return data

    def close(self) -> None:
        self.closed = True
        self.sink = None
        self._release(self)
        if self.transport is not None:
            self.transport.close()

    def pending(self) -> bool:
        """True when bytes wait unread in the socket (the loop has not delivered them yet):
        they answer nothing this connection will be asked, so it must not be reused."""
        if self.fd < 0:
            return False
        try:
            return fcntl.ioctl(self.fd, termios.FIONREAD, _NO_BYTES) != _NO_BYTES
        except OSError:
            return True

    def finish(self) -> None:
        """Response fully read: back to the pool if the connection can be reused."""
        if (self.done and self.reusable and not self.closed and not self.head_only
                and self.error is None):
            self._reset()
            self._release(self)
        else:
            self.close()


class UpstreamResponse:
    """An upstream response whose body has not been read yet."""

    __slots__ = ("_conn", "headers", "pipe", "read", "status")

    def __init__(self, conn: UpstreamConnection) -> None:
        self._conn = conn
        self.status: int = conn.status
        self.headers: list[tuple[bytes, bytes]] = conn.headers  # names lower-case
        # Body bytes as they arrive, what is buffered as one chunk; b"" at the end.
        self.read: Callable[[], Coroutine[Any, Any, bytes]] = conn.read
        # Body bytes pushed to a sink from the socket's callback
        # (see `UpstreamConnection.pipe`).
        self.pipe: Callable[[Callable[[bytes], bool]], Coroutine[Any, Any, bytes]] = conn.pipe

    async def read_all(self) -> bytes:
        parts = []
        while chunk := await self.read():
            parts.append(chunk)
        return b"".join(parts)

    def ended(self) -> bool:
        """True once the whole body has arrived (what `read`/`pipe` return is the last)."""
        return self._conn.done

    def close(self) -> None:
        """Drop the connection now (the engine sees the disconnect and aborts). Sync."""
        self._conn.close()

    def release(self) -> None:
        """Return a fully read connection to the pool (closes it otherwise)."""
        self._conn.finish()
