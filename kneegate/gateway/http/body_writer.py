"""One ASGI extension: the body writer the relay pushes each chunk through.

Why. At 1024 realistic streams (~50k SSE events/s) a relay through ASGI `send` costs, per
event: a future resolved by the upstream socket's callback, a task step to resume the
relay coroutine, a message dict, and uvicorn's `send` coroutine — about half of the
gateway's CPU next to the two syscalls that move the bytes. With this extension the
upstream connection's `data_received` writes the event to the client's socket itself, in
the same callback: no task switch per event (see gateway/relay.py).

What it is. `scope["extensions"]["kneegate.body_writer"]` is a `BodyWriter` for the
current response. `BodyWriter.write(data)` frames `data` as one HTTP/1.1 chunk and writes
it to the connection now, and returns True — or returns False, writing nothing, whenever
plain ASGI `send` must be used instead: the response is not chunked (it has a
Content-Length, or is a HEAD, or goes to an HTTP/1.0 client), it has not started or has
completed, the client is gone, or the client's socket is applying back-pressure (`send` is
what waits for it to drain).
The status line, headers and the final chunk always go through `send`, so uvicorn's own
state (keep-alive, response completion, pipelining) stays exactly what it tracks.
`BodyWriter.send_whole(send, start, body)` sends a response whose whole body is at hand (a
short answer read in the same packet as its head) through those two `send`s, but as one
write to the socket instead of two: one syscall less per short request (issue 16).
`BodyWriter.on_disconnect` is called when the client's connection is lost mid-response,
so the proxy needs no task parked on `receive()` to notice.

What it needs of uvicorn. The body writer and the HTTP/1.0 cycle read attributes of
uvicorn's RequestResponseCycle, which is not a public API (`CYCLE_NEEDS`); `probe` says
which of them a cycle lacks. The protocol that hands out body writers
(gateway/http/wire.py) probes the first cycle of the process and falls back to plain ASGI
`send` when one is missing or of another type (a newer uvicorn), or when the environment
variable `KNEEGATE_WIRE_FALLBACK=1` (`FALLBACK_ENV`) asks it to.
"""

from __future__ import annotations

from asyncio import Transport
from collections.abc import Awaitable, Callable
from typing import Any, cast

from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

__all__ = ["CYCLE_NEEDS", "EXTENSION", "FALLBACK_ENV", "BodyWriter", "probe"]


EXTENSION = "kneegate.body_writer"


FALLBACK_ENV = "KNEEGATE_WIRE_FALLBACK"  # "1": as if the probe failed (CI runs tests so)


_CALLABLE = cast("type", Callable)  # isinstance() takes it; mypy wants it called a type


# What BodyWriter and CloseDelimitedCycle read of uvicorn's RequestResponseCycle (dotted:
# an attribute's attribute), with the types they expect. Not uvicorn's public API.
CYCLE_NEEDS: tuple[tuple[str, type | tuple[type, ...]], ...] = (
    ("transport.write", _CALLABLE),
    ("transport.close", _CALLABLE),
    ("flow.write_paused", bool),
    ("flow.drain", _CALLABLE),
    ("disconnected", bool),
    ("response_started", bool),
    ("response_complete", bool),
    ("chunked_encoding", (bool, type(None))),
    ("message_event.set", _CALLABLE),
    ("on_response", _CALLABLE),
)


_MISSING = object()


def probe(cycle: object) -> list[str]:
    """What of `CYCLE_NEEDS` `cycle` lacks or holds with another type; empty: all there."""
    wrong = []
    for path, kind in CYCLE_NEEDS:
        value = cycle
        for name in path.split("."):
            value = getattr(value, name, _MISSING)
        if value is _MISSING:
            wrong.append(f"{path}: missing")
        elif not isinstance(value, kind):
            wrong.append(f"{path}: {type(value).__name__}")
    return wrong


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

    async def send_whole(self, send: Callable[[Any], Awaitable[None]], start: Any,
                         body: bytes) -> None:
        """Send `start` and then `body` as the whole rest of the response, through `send`
        (uvicorn frames both and keeps its state), in one write to the socket."""
        c = self._cycle
        real = c.transport
        held = c.transport = _Held(real)  # type: ignore[assignment]  # writes and closes
        try:
            await send(start)
            await send({"type": "http.response.body", "body": body, "more_body": False})
        finally:
            c.transport = real
            held.flush()

    @property
    def disconnected(self) -> bool:
        return self._cycle.disconnected

    def _lost(self) -> None:
        callback, self.on_disconnect = self.on_disconnect, None
        if callback is not None and not self._cycle.response_complete:
            callback()


class _Held:
    """The connection's transport as `send_whole` lends it to the request cycle: writes
    are held, and go out as one, when the cycle closes the connection or at `flush`."""

    __slots__ = ("_parts", "_transport")

    def __init__(self, transport: Transport) -> None:
        self._transport = transport
        self._parts: list[bytes] = []

    def write(self, data: bytes) -> None:
        self._parts.append(data)

    def flush(self) -> None:
        parts, self._parts = self._parts, []
        if parts and not self._transport.is_closing():
            self._transport.write(parts[0] if len(parts) == 1 else b"".join(parts))

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)
