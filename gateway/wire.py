"""uvicorn's httptools protocol plus one ASGI extension: a synchronous body-chunk writer.

Why. At 1024 realistic streams (~50k SSE events/s) a relay through ASGI `send` costs, per
event: a future resolved by the upstream socket's callback, a task step to resume the
relay coroutine, a message dict, and uvicorn's `send` coroutine — about half of the
gateway's CPU next to the two syscalls that move the bytes. With this extension the
upstream connection's `data_received` writes the event to the client's socket itself, in
the same callback: no task switch per event (see `Proxy._relay`).

What it is. `scope["extensions"]["kneegate.body_writer"]` is a `BodyWriter` for the
current response. `BodyWriter.write(data)` frames `data` as one HTTP/1.1 chunk and writes
it to the connection now, and returns True — or returns False, writing nothing, whenever
plain ASGI `send` must be used instead: the response is not chunked (it has a
Content-Length, or is a HEAD), it has not started or has completed, the client is gone,
or the client's socket is applying back-pressure (`send` is what waits for it to drain).
The status line, headers and the final chunk always go through `send`, so uvicorn's own
state (keep-alive, response completion, pipelining) stays exactly what it tracks.
`BodyWriter.on_disconnect` is called when the client's connection is lost mid-response,
so the proxy needs no task parked on `receive()` to notice.

This reads attributes of uvicorn's RequestResponseCycle (`transport`, `flow`,
`disconnected`, `response_started`, `response_complete`, `chunked_encoding`), so uvicorn is
pinned below its next minor version in pyproject.toml; tests/gateway/test_wire.py runs the
extension on the real server. Without it (any other ASGI server) the proxy relays through
`send`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

__all__ = ["EXTENSION", "BodyWriter", "KneegateHttpProtocol"]

EXTENSION = "kneegate.body_writer"


class BodyWriter:
    """Writes body chunks of one response straight to its connection, when it may.

    `on_disconnect`, when set, is called once if the client's connection is lost before
    the response completed: a callback instead of a task parked on `receive()`.
    """

    __slots__ = ("_cycle", "on_disconnect")

    def __init__(self, cycle: RequestResponseCycle) -> None:
        self._cycle = cycle
        self.on_disconnect: Callable[[], object] | None = None

    def ready(self) -> bool:
        """True when `write` may be used: the response started chunked and is open."""
        c = self._cycle
        return bool(
            c.chunked_encoding and c.response_started and not c.response_complete
            and not c.disconnected and not c.flow.write_paused
        )

    def write(self, data: bytes) -> bool:
        """Write `data` (non-empty) as one chunk now; False: nothing written, use `send`.

        Only after `ready()` said True once for this response.
        """
        c = self._cycle
        if c.flow.write_paused or c.disconnected or c.response_complete:
            return False
        c.transport.write(b"%x\r\n%b\r\n" % (len(data), data))
        return True

    @property
    def disconnected(self) -> bool:
        return self._cycle.disconnected

    def _lost(self) -> None:
        callback, self.on_disconnect = self.on_disconnect, None
        if callback is not None and not self._cycle.response_complete:
            callback()


class KneegateHttpProtocol(HttpToolsProtocol):
    """uvicorn's HTTP/1.1 protocol; each request's scope also carries a `BodyWriter`."""

    _writers: list[BodyWriter] | None = None  # this connection's unfinished responses

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        # The request's task is created above but has not run yet (call_soon), so the
        # extension is in place before the app sees the scope. An upgrade returns early
        # without a new cycle; the scope then belongs to the upgrade path: leave it.
        cycle = self.cycle
        if cycle is not None and cycle.scope is self.scope:
            writer = BodyWriter(cycle)
            # ASGI types each extension's value as a dict; ours is an object with methods.
            extensions = cast("dict[str, object]", self.scope.setdefault("extensions", {}))
            extensions[EXTENSION] = writer
            # Usually one; more only while pipelined requests wait for the one before.
            live = [w for w in self._writers or () if not w._cycle.response_complete]
            live.append(writer)
            self._writers = live

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        writers, self._writers = self._writers, None
        for w in writers or ():
            w._lost()
