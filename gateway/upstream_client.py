"""The HTTP client that talks to engines: lean HTTP/1.1 on asyncio protocols + httptools.

Why not a general client library. Measured for issue 3 on this kind of machine: a proxy
on httpx's own transport relayed 32 of 192 offered requests/s at 256 concurrent streams
(httpcore's pool does work growing with the square of its size at each request start and
release); on aiohttp's client it kept up at 256, but at 1024 realistic streams (~50k
events/s) a kneegate built on aiohttp reached 0.55x direct at 100% of its core (measured
with `python -m kneegate.benchmarks.overhead --shapes realistic --concurrency 1024`), and
profiling showed about a third of the time in aiohttp's per-chunk stream machinery. What
a relay needs is small: write one request, parse the response with httptools' C parser,
hand over whatever body bytes are buffered as one chunk, keep connections alive. That is
this module, and the only module that knows it: the rest of the gateway sees
`UpstreamClient.open()` -> `UpstreamResponse` and the errors of `gateway.errors`.

There is no connection cap (admission is the only cap) and only `connect` is timed here;
first-byte and idle deadlines are checked by the proxy's sweeper at tick granularity, so a
chunk costs no timer. A request that fails on a reused keep-alive connection before any
byte of response arrived is retried once on a new connection (the engine closed it idle).

What a peer sends is never trusted to line up with what was asked (issue 11):
- a connection is read only inside an exchange: bytes that arrive while it idles in the
  pool (an unsolicited or late response) close it, and a connection with unread bytes in
  its socket is never handed out, so no request can read another's answer; bytes after
  the end of the response it answers close it too;
- interim responses (100 Continue, 103 Early Hints) are skipped: the request gets the
  final response; a 101 Switching Protocols (kneegate never asks for one) is an error;
- the response head (status line and header fields) is bounded by `max_header_bytes`,
  counted as bytes arrive, so an endless header block costs at most that much memory.

Errors name the upstream's URL and the transport's own words for the log; clients see only
their generic `reason` (`UpstreamError.public`).
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import ssl
import termios
from collections.abc import Callable, Coroutine
from types import TracebackType
from typing import Any
from urllib.parse import urlsplit

import httptools

from kneegate.gateway.errors import (
    UpstreamConnectError,
    UpstreamConnectTimeout,
    UpstreamError,
    UpstreamTimeout,
)

__all__ = ["UpstreamClient", "UpstreamResponse", "upstream_errors"]

log = logging.getLogger("kneegate.upstream")

Origin = tuple[str, int, bool]  # host, port, TLS
_HIGH_WATER = 1 << 20  # buffered body bytes before we stop reading the engine's socket
_NO_BYTES = bytes(4)  # FIONREAD's answer for an empty socket buffer


class _Stop(Exception):
    """Raised from a parser callback to stop parsing; the reason is in `_Conn.error`."""


class upstream_errors:
    """Map transport-level exceptions to UpstreamTimeout / UpstreamError (`raise from`).

    A class, not @contextmanager: it is entered twice per proxied request.
    """

    __slots__ = ("url",)

    def __init__(self, url: str) -> None:
        self.url = url

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc is None:
            return
        if isinstance(exc, TimeoutError):
            raise UpstreamTimeout(f"upstream {self.url} timed out", "timed out") from exc
        if isinstance(exc, OSError):
            reason = "connection reset" if isinstance(exc, ConnectionError) else "connection failed"
            raise UpstreamError(f"upstream {self.url} failed: {exc!r}", reason) from exc
        if isinstance(exc, (httptools.HttpParserError, httptools.HttpParserUpgrade)):
            raise UpstreamError(f"upstream {self.url} sent an invalid response: {exc!r}",
                                "invalid response") from exc


class _Conn(asyncio.Protocol):
    """One keep-alive connection to an engine; parses one response at a time.

    It never touches the pool's lists: it calls `release(self)` when it becomes reusable
    (a response read to its end, `finish`) and when it is closed (by either side), and the
    pool files it as idle or forgets it (httpcore's pool is told the same way).
    """

    def __init__(self, key: Origin, max_header_bytes: int,
                 release: Callable[[_Conn], None]) -> None:
        self.key, self.max_header_bytes, self._release = key, max_header_bytes, release
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.fd = -1  # the plain socket's descriptor, to look for bytes before reuse
        self.closed = False
        self._reset()

    def _reset(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.buf: list[bytes] = []
        self.buffered = 0
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
        if self.buf:
            # Push mode: write through from here, so the relay sleeps on (no task switch per
            # event). The body's last bytes go to the relay instead, which sends them with
            # the end of the response in one write.
            sink = self.sink
            if sink is not None and not self.done and self.error is None and self._push(sink):
                return
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
        self.headers.append((name.lower(), value))

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
            return
        self.status = status
        self.got_headers = True
        self.framed = any(k in (b"content-length", b"transfer-encoding") for k, _ in self.headers)
        if self.head_only:
            self.done = True

    def on_body(self, body: bytes) -> None:
        self.buf.append(body)
        self.buffered += len(body)

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

    def _next(self) -> asyncio.Future[None]:
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

    async def read_head(self) -> None:
        while not self.got_headers:
            if self.error is not None:
                raise self.error
            await self._next()

    async def read(self) -> bytes:
        """The body bytes buffered so far, waiting for some; b"" at the end."""
        while not self.buf:
            if self._ended():
                return b""
            await self._next()
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
                await self._next()
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

    def __init__(self, conn: _Conn) -> None:
        self._conn = conn
        self.status: int = conn.status
        self.headers: list[tuple[bytes, bytes]] = conn.headers  # names lower-case
        # Body bytes as they arrive, what is buffered as one chunk; b"" at the end.
        self.read: Callable[[], Coroutine[Any, Any, bytes]] = conn.read
        # Body bytes pushed to a sink from the socket's callback (see `_Conn.pipe`).
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


def _origin(base: str) -> tuple[Origin, bytes]:
    parts = urlsplit(base)
    tls = parts.scheme == "https"
    port = parts.port or (443 if tls else 80)
    return (parts.hostname or "localhost", port, tls), parts.netloc.encode("idna")


class UpstreamClient:
    """Keep-alive connections to every upstream, no cap, built at start-up.

    `max_header_bytes`: the largest response head (status line and headers) accepted from
    an engine; a larger one is an UpstreamError (502) and its connection is closed.
    """

    def __init__(self, connect_timeout: float, max_header_bytes: int = 65536) -> None:
        self.connect_timeout = connect_timeout
        self.max_header_bytes = max_header_bytes
        # idle keep-alive connections per origin; a dict as an ordered set: O(1) removal
        # when the engine closes one, and the most recently used is reused first
        self._idle: dict[Origin, dict[_Conn, None]] = {}
        self._origins: dict[str, tuple[Origin, bytes]] = {}
        self._ssl: ssl.SSLContext | None = None

    def set_connect_timeout(self, seconds: float) -> None:
        self.connect_timeout = seconds

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        for conns in list(self._idle.values()):
            for c in list(conns):
                c.close()
        self._idle.clear()

    def _release(self, conn: _Conn) -> None:
        """A connection's word to its pool: reusable (filed as idle, most recent last) or
        closed (forgotten). Only the pool edits its idle lists."""
        if conn.closed:
            idle = self._idle.get(conn.key)
            if idle is not None:
                idle.pop(conn, None)
        else:
            self._idle.setdefault(conn.key, {})[conn] = None

    async def _connect(self, key: Origin) -> _Conn:
        host, port, tls = key
        if tls and self._ssl is None:
            self._ssl = ssl.create_default_context()
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout):
                transport, conn = await loop.create_connection(
                    lambda: _Conn(key, self.max_header_bytes, self._release), host, port,
                    ssl=self._ssl if tls else None)
        except TimeoutError as exc:
            raise UpstreamConnectTimeout(
                f"connect to upstream {host}:{port} timed out after {self.connect_timeout:g}s",
                "connect timed out") from exc
        except OSError as exc:
            reason = ("connection refused" if isinstance(exc, ConnectionRefusedError)
                      else "cannot connect")
            raise UpstreamConnectError(
                f"cannot connect to upstream {host}:{port}: {exc.strerror or exc}",
                reason) from exc
        conn.transport = transport  # uvloop may call connection_made only later
        if not tls:  # TLS records (tickets, alerts) may arrive unasked: judged in data_received
            sock = transport.get_extra_info("socket")
            conn.fd = sock.fileno() if sock is not None else -1
        return conn

    def _pooled(self, key: Origin) -> _Conn | None:
        idle = self._idle.get(key)
        while idle:
            conn, _ = idle.popitem()
            if not conn.closed and not conn.pending():
                return conn
            conn.close()
        return None

    async def open(
        self, method: str, base: str, target: bytes, headers: list[tuple[bytes, bytes]],
        body: bytes,
    ) -> UpstreamResponse:
        """Send `method target` to the engine at `base`; return once its headers arrived.

        `target` (path and query) is sent as it is, already percent-encoded; `headers`
        (raw ASGI pairs) must not include Host or Content-Length.
        """
        origin = self._origins.get(base)
        if origin is None:
            origin = self._origins[base] = _origin(base)
        key, netloc = origin
        url = base + target.decode("latin-1")
        head = [b"%s %s HTTP/1.1\r\nhost: %s\r\n" % (method.encode(), target, netloc)]
        head.extend(b"%s: %s\r\n" % kv for kv in headers)
        if body or method not in ("GET", "HEAD", "DELETE", "OPTIONS"):
            head.append(b"content-length: %d\r\n" % len(body))
        head.append(b"\r\n")
        head.append(body)
        payload = b"".join(head)
        conn = self._pooled(key)
        if conn is not None:
            try:
                return await self._exchange(conn, method, payload, url)
            except UpstreamError:
                if conn.got_bytes:
                    raise
                # the engine closed this idle connection as we reused it: once more, fresh
        return await self._exchange(await self._connect(key), method, payload, url)

    async def _exchange(self, conn: _Conn, method: str, payload: bytes, url: str
                        ) -> UpstreamResponse:
        conn.head_only = method == "HEAD"
        conn.active = True
        assert conn.transport is not None
        try:
            with upstream_errors(url):
                conn.transport.write(payload)
                await conn.read_head()
        except BaseException:
            conn.close()
            raise
        return UpstreamResponse(conn)

    async def get_text(self, url: str, timeout: float, max_bytes: int = 8 << 20
                       ) -> tuple[int, str]:
        """A small GET for health probes and metric scrapes; at most `max_bytes` of body."""
        try:
            async with asyncio.timeout(timeout):
                parts = urlsplit(url)
                target = (parts.path or "/") + ("?" + parts.query if parts.query else "")
                base = f"{parts.scheme}://{parts.netloc}"
                resp = await self.open("GET", base, target.encode(), [(b"accept", b"*/*")], b"")
                try:
                    with upstream_errors(url):
                        body = await _read_at_most(resp, max_bytes, url)
                finally:
                    resp.release()
        except TimeoutError as exc:
            raise UpstreamTimeout(f"GET {url} took longer than {timeout:g}s", "timed out") from exc
        return resp.status, body.decode("utf-8", "replace")


async def _read_at_most(resp: UpstreamResponse, limit: int, url: str) -> bytes:
    parts: list[bytes] = []
    size = 0
    while chunk := await resp.read():
        size += len(chunk)
        if size > limit:  # release() then closes the connection: the body is unfinished
            raise UpstreamError(f"GET {url}: body over {limit} bytes", "response too large")
        parts.append(chunk)
    return b"".join(parts)
