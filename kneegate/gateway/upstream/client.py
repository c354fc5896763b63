"""The HTTP client that talks to engines: lean HTTP/1.1 on asyncio protocols + httptools.

Why not a general client library. Measured for issue 3 on this kind of machine: a proxy
on httpx's own transport relayed 32 of 192 offered requests/s at 256 concurrent streams
(httpcore's pool does work growing with the square of its size at each request start and
release); on aiohttp's client it kept up at 256, but at 1024 realistic streams (~50k
events/s) a kneegate built on aiohttp reached 0.55x direct at 100% of its core (measured
with `python -m kneegate_bench.overhead --shapes realistic --concurrency 1024`), and
profiling showed about a third of the time in aiohttp's per-chunk stream machinery. What
a relay needs is small: write one request, parse the response with httptools' C parser,
hand over whatever body bytes are buffered as one chunk, keep connections alive. That is
this module (the pool and the requests) and gateway/upstream/connection.py (the connection and
its response), the only modules that know it: the rest of the gateway sees
`UpstreamClient.open()` -> `UpstreamResponse` and the errors of `gateway.errors`.

There is no connection cap (admission is the only cap) and only `connect` is timed here;
first-byte and idle deadlines are checked by the proxy's sweeper at tick granularity, so a
chunk costs no timer. A request that fails on a reused keep-alive connection before any
byte of response arrived is retried once on a new connection (the engine closed it idle).
What a peer sends is never trusted to line up with what was asked: see connection.py.

Errors name the upstream's URL and the transport's own words for the log; clients see only
their generic `reason` (`UpstreamError.public`).
"""

from __future__ import annotations

import asyncio
import os
import ssl
from types import TracebackType
from urllib.parse import urlsplit

import httptools

from kneegate.gateway.config.upstream import basic_auth, public_url
from kneegate.gateway.errors import (
    UpstreamConnectError,
    UpstreamConnectTimeout,
    UpstreamError,
    UpstreamTimeout,
)
from kneegate.gateway.upstream.connection import Origin, UpstreamConnection, UpstreamResponse

__all__ = ["TRANSPORT_ERRORS", "UpstreamClient", "UpstreamResponse", "upstream_error",
           "upstream_errors"]

# what a transport raises: `upstream_error` says what each means (TimeoutError is an OSError)
TRANSPORT_ERRORS = (OSError, httptools.HttpParserError, httptools.HttpParserUpgrade)


def upstream_error(url: str, exc: BaseException) -> UpstreamError:
    """The UpstreamTimeout / UpstreamError that `exc` (one of TRANSPORT_ERRORS) from the
    engine at `url` means. On the hot path, instead of `upstream_errors`:

        try:
            ...
        except TRANSPORT_ERRORS as exc:
            raise upstream_error(url, exc) from exc

    A URL's userinfo never reaches the message (it is for the log).
    """
    url = public_url(url)
    if isinstance(exc, TimeoutError):
        return UpstreamTimeout(f"upstream {url} timed out", "timed out")
    if isinstance(exc, OSError):
        reason = "connection reset" if isinstance(exc, ConnectionError) else "connection failed"
        return UpstreamError(f"upstream {url} failed: {exc!r}", reason)
    return UpstreamError(f"upstream {url} sent an invalid response: {exc!r}", "invalid response")


class upstream_errors:
    """`with upstream_errors(url):` maps transport exceptions to UpstreamTimeout /
    UpstreamError (`raise from`); see `upstream_error` for the hot path's form."""

    __slots__ = ("url",)

    def __init__(self, url: str) -> None:
        self.url = url

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc is not None and isinstance(exc, TRANSPORT_ERRORS):
            raise upstream_error(self.url, exc) from exc


def _origin(base: str) -> tuple[Origin, bytes, bytes | None, str]:
    """What requests to `base` need, once per base: the connection key, the Host header
    (the netloc without userinfo), the basic auth its userinfo gives (None: none) and the
    URL as errors may show it."""
    parts = urlsplit(base)
    tls = parts.scheme == "https"
    port = parts.port or (443 if tls else 80)
    host = parts.netloc.rpartition("@")[2].encode("idna")
    return ((parts.hostname or "localhost", port, tls), host, basic_auth(base),
            public_url(base))


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
        self._idle: dict[Origin, dict[UpstreamConnection, None]] = {}
        self._origins: dict[str, tuple[Origin, bytes, bytes | None, str]] = {}
        self._ssl: ssl.SSLContext | None = None

    def set_connect_timeout(self, seconds: float) -> None:
        self.connect_timeout = seconds

    async def close(self) -> None:
        for conns in list(self._idle.values()):
            for c in list(conns):
                c.close()
        self._idle.clear()

    def _release(self, conn: UpstreamConnection) -> None:
        """A connection's word to its pool: reusable (filed as idle, most recent last) or
        closed (forgotten). Only the pool edits its idle lists."""
        if conn.closed:
            idle = self._idle.get(conn.key)
            if idle is not None:
                idle.pop(conn, None)
        else:
            self._idle.setdefault(conn.key, {})[conn] = None

    async def _connect(self, key: Origin) -> UpstreamConnection:
        host, port, tls = key
        if tls and self._ssl is None:
            self._ssl = ssl.create_default_context()
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout):
                transport, conn = await loop.create_connection(
                    lambda: UpstreamConnection(key, self.max_header_bytes, self._release),
                    host, port, ssl=self._ssl if tls else None)
        except TimeoutError as exc:
            raise UpstreamConnectTimeout(
                f"connect to upstream {host}:{port} timed out after {self.connect_timeout:g}s",
                "connect timed out") from exc
        except OSError as exc:
            reason = ("connection refused" if isinstance(exc, ConnectionRefusedError)
                      else "cannot connect")
            # the errno's words: asyncio's own strerror carries the address as a tuple
            why = os.strerror(exc.errno) if exc.errno else exc.strerror or str(exc)
            raise UpstreamConnectError(f"cannot connect to upstream {host}:{port}: {why}",
                                       reason) from exc
        conn.transport = transport  # uvloop may call connection_made only later
        if not tls:  # TLS records (tickets, alerts) may arrive unasked: judged in data_received
            sock = transport.get_extra_info("socket")
            conn.fd = sock.fileno() if sock is not None else -1
        return conn

    def _pooled(self, key: Origin) -> UpstreamConnection | None:
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
        (raw ASGI pairs) must not include Host or Content-Length. When `base` has userinfo
        it is sent as `Authorization: Basic`, in place of any Authorization in `headers`.
        """
        origin = self._origins.get(base)
        if origin is None:
            origin = self._origins[base] = _origin(base)
        key, netloc, auth, shown = origin
        url = shown + target.decode("latin-1")
        head = [b"%s %s HTTP/1.1\r\nhost: %s\r\n" % (method.encode(), target, netloc)]
        if auth is not None:  # the engine's own credentials (rare: no cost otherwise)
            headers = [(k, v) for k, v in headers if k != b"authorization"]
            head.append(b"authorization: %s\r\n" % auth)
        head += [b"%s: %s\r\n" % kv for kv in headers]
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

    async def _exchange(self, conn: UpstreamConnection, method: str, payload: bytes, url: str
                        ) -> UpstreamResponse:
        conn.head_only = method == "HEAD"
        conn.active = True
        assert conn.transport is not None
        try:
            conn.transport.write(payload)
            while not conn.got_headers:  # the response head (no coroutine of its own)
                if conn.error is not None:
                    raise conn.error
                await conn.next_wake()
        except BaseException as exc:
            conn.close()
            if isinstance(exc, TRANSPORT_ERRORS):
                raise upstream_error(url, exc) from exc
            raise
        return UpstreamResponse(conn)

    async def get_text(self, url: str, timeout: float, max_bytes: int = 8 << 20
                       ) -> tuple[int, str]:
        """A small GET for health probes and metric scrapes; at most `max_bytes` of body."""
        shown = public_url(url)
        try:
            async with asyncio.timeout(timeout):
                parts = urlsplit(url)
                target = (parts.path or "/") + ("?" + parts.query if parts.query else "")
                base = f"{parts.scheme}://{parts.netloc}"
                resp = await self.open("GET", base, target.encode(), [(b"accept", b"*/*")], b"")
                try:
                    with upstream_errors(url):
                        body = await _read_at_most(resp, max_bytes, shown)
                finally:
                    resp.release()
        except TimeoutError as exc:
            raise UpstreamTimeout(f"GET {shown} took longer than {timeout:g}s",
                                  "timed out") from exc
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
