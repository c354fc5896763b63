"""The HTTP client that talks to engines. The one module that knows which library it is.

aiohttp, not httpx: measured on this kind of machine (issue 3), a proxy on httpx's own
transport relayed 32 of 192 offered requests/s at 256 concurrent streams, because
httpcore's pool does work growing with the square of its size at every request start and
release; on aiohttp it kept up. aiohttp's `iter_any()` also hands over everything already
buffered as one chunk, so a busy relay writes fewer, larger frames instead of one per
upstream read. Swapping libraries means rewriting this module only: the rest of the
gateway sees `UpstreamClient.open()` -> `UpstreamResponse` and the errors in
`gateway.errors`.

Timeouts: the connector has no connection cap (`limit=0`): admission is the only cap.
Only `connect` is enforced here; first-byte and idle deadlines are checked by the proxy's
sweeper at tick granularity, which costs nothing per chunk.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import contextmanager

import aiohttp
from yarl import URL

from gateway.errors import UpstreamConnectError, UpstreamError, UpstreamTimeout

__all__ = ["UpstreamClient", "UpstreamResponse", "upstream_errors"]


@contextmanager
def upstream_errors(url: str) -> Iterator[None]:
    """Map the client library's exceptions to UpstreamTimeout / UpstreamError."""
    try:
        yield
    except (TimeoutError, aiohttp.ServerTimeoutError) as exc:
        raise UpstreamTimeout(f"upstream {url} timed out: {exc or 'no answer'}") from exc
    except aiohttp.ClientConnectorError as exc:
        raise UpstreamConnectError(f"cannot connect to upstream {url}: {exc.os_error}") from exc
    except (aiohttp.ClientError, OSError) as exc:
        raise UpstreamError(f"upstream {url} failed: {exc!r}") from exc


class UpstreamResponse:
    """An upstream response whose body has not been read yet."""

    __slots__ = ("_resp", "headers", "status")

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self._resp = resp
        self.status: int = resp.status
        self.headers: Sequence[tuple[bytes, bytes]] = resp.raw_headers

    def chunks(self) -> AsyncIterator[bytes]:
        """Body bytes as they arrive; what is already buffered comes as one chunk."""
        return self._resp.content.iter_any()

    def close(self) -> None:
        """Drop the connection now (the engine sees the disconnect and aborts). Sync."""
        self._resp.close()

    def release(self) -> None:
        """Return a fully read connection to the pool."""
        self._resp.release()


class UpstreamClient:
    """One pooled client for all upstreams, built at start-up."""

    def __init__(self, connect_timeout: float, max_connections: int = 0) -> None:
        self._connect_timeout = connect_timeout
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None
        self._timeout = self._make_timeout(connect_timeout)

    @staticmethod
    def _make_timeout(connect: float) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=None, connect=None, sock_connect=connect, sock_read=None)

    def set_connect_timeout(self, seconds: float) -> None:
        self._timeout = self._make_timeout(seconds)

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(
            limit=self._max_connections, limit_per_host=0, ttl_dns_cache=300, force_close=False
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            auto_decompress=False,  # relay bytes as the engine sent them
            skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
            timeout=self._timeout,
            cookie_jar=aiohttp.DummyCookieJar(),
            raise_for_status=False,
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def open(
        self, method: str, url: str, headers: list[tuple[str, str]], body: bytes
    ) -> UpstreamResponse:
        """Send a request and return once the status line and headers arrived."""
        assert self._session is not None, "UpstreamClient.start() was not awaited"
        with upstream_errors(url):
            resp = await self._session.request(
                method,
                URL(url, encoded=True),  # relay the path's bytes as the caller sent them
                headers=headers,
                data=body or None,
                allow_redirects=False,
                timeout=self._timeout,
                compress=None,
            )
        return UpstreamResponse(resp)

    async def get_text(self, url: str, timeout: float) -> tuple[int, str]:
        """A small GET for health probes and metric scrapes."""
        assert self._session is not None, "UpstreamClient.start() was not awaited"
        with upstream_errors(url):
            async with self._session.get(
                url, timeout=aiohttp.ClientTimeout(total=timeout)
            ) as resp:
                return resp.status, await resp.text()
