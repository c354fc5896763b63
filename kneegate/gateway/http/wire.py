"""uvicorn's httptools protocol plus the body writer and the client-side limits.

`KneegateHttpProtocol` is uvicorn's HTTP/1.1 protocol whose every request scope also carries
a `BodyWriter` (gateway/http/body_writer.py: why, and what it does). The client limits
(gateway/http/limits.py: what they bound and how a refusal is answered) are enforced here,
in the protocol's callbacks. HTTP/1.0 clients get a request cycle of their own
(gateway/http/http10.py).

What it needs of uvicorn. The body writer and the HTTP/1.0 cycle read attributes of
uvicorn's RequestResponseCycle, which is not a public API (`body_writer.CYCLE_NEEDS`). The
first cycle a process serves is probed for them, once (`body_writer.probe`): if one is
missing or of another type (a newer uvicorn), one warning is logged and every response of
the process goes through plain ASGI `send` (the proxy then watches `receive()` for
disconnects, as on any other ASGI server; correct, with more CPU per streamed event). On
that fallback every client limit is still enforced and counted, with one difference, which
the warning states: HTTP/1.0 clients get uvicorn's own framing, and a refusal on a
connection that already has a request cycle (the body of the request under way:
`body_timeout`, `body_deadline`, a malformed chunk; or the head of a later request on a
keep-alive connection) closes it without an answer, since whether a response started cannot
be read. The environment variable `KNEEGATE_WIRE_FALLBACK=1` forces the fallback
(`FALLBACK_ENV`). The client limits replace the protocol's `data_received` and call a few of
its methods; tests/gateway/http/test_wire.py and test_client_limits.py run all of it on the
real server, and CI runs them on the fallback and the suite on the newest uvicorn too.
Without this protocol (any other ASGI server) the proxy relays through `send`, and the
limits are that server's own.
"""

from __future__ import annotations

import logging
import os
from asyncio import TimerHandle, Transport
from typing import Any

import httptools
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from kneegate.gateway.config.sections import LimitsConfig
from kneegate.gateway.http.body_writer import EXTENSION, FALLBACK_ENV, BodyWriter, probe
from kneegate.gateway.http.http10 import CloseDelimitedCycle
from kneegate.gateway.http.limits import ClientLimits

__all__ = ["KneegateHttpProtocol", "WireConfig"]

LINGER = 5.0  # seconds a refused client's further input is read and dropped (nginx: 5 s)

log = logging.getLogger("kneegate")


class WireConfig(uvicorn.Config):
    """uvicorn's settings plus the client limits `KneegateHttpProtocol` enforces."""

    def __init__(self, app: Any, *, client_limits: ClientLimits, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self.client_limits = client_limits


class _Refused(Exception):
    """Raised in a parser callback to stop parsing; `feed_data` re-raises it as context."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class KneegateHttpProtocol(HttpToolsProtocol):
    """uvicorn's HTTP/1.1 protocol with the client limits; each request's scope also
    carries a `BodyWriter`, unless the probe of uvicorn's request cycle failed."""

    _writers: list[BodyWriter] | None = None  # this connection's unfinished responses
    # the probe's answer for this process (None: no request cycle seen yet): may the body
    # writer and the HTTP/1.0 cycle use uvicorn's request cycle?
    relay: bool | None = None

    def __init__(self, config: uvicorn.Config, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        limits = config.client_limits if isinstance(config, WireConfig) else None
        self._limits = limits or ClientLimits(LimitsConfig())
        # bytes the current request head may still take; None while no head is read
        self._head_room: int | None = self._limits.max_header_bytes
        self._head_timer: TimerHandle | None = None
        self._body_timer: TimerHandle | None = None
        self._body_seen = 0.0  # loop time of the last read of the request body
        self._body_due = 0.0  # loop time by which the whole body must have arrived
        self._reading_body = False
        self._over_cap: str | None = None  # the refusal due on its request, if any
        self._host: str | None = None  # the client's address, as `ClientLimits` counts it
        self._lingering = False

    # --- connection -------------------------------------------------------------------

    def connection_made(self, transport: Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        limits = self._limits
        # uvicorn counts this one in already; its own cap (limit_concurrency) also counts
        # request tasks, answers 503 text/plain, logs a line per refusal and refuses at N-1
        if len(self.connections) > limits.max_connections:
            self._over_cap = "connection_limit"
        if self.client is not None:  # a Unix socket's peers have no address to tell apart
            self._host = self.client[0]
            if limits.opened(self._host) and self._over_cap is None:
                self._over_cap = "client_connection_limit"
        # nginx: the first request's head is due header_timeout after the accept
        self._head_timer = self.loop.call_later(limits.header_timeout, self._head_timed_out)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        if self._host is not None:
            self._limits.closed(self._host)
            self._host = None
        super().connection_lost(exc)
        writers, self._writers = self._writers, None
        for w in writers or ():
            w._lost()

    def shutdown(self) -> None:
        if self._lingering:  # the refused client is owed nothing more
            self.transport.close()
            return
        super().shutdown()

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            return  # a refused client's input is dropped until the connection closes
        room = self._head_room
        if room is not None:
            if len(data) > room:
                self._head_overflow(data, room)
                return
            self._head_room = room - len(data)
        elif self._reading_body:
            self._body_seen = self.loop.time()
        self._feed(data)
        # A head still incomplete after this read (a slow or slowloris client) is timed
        # from here; one that came whole, as nearly every head does, costs no timer.
        room = self._head_room
        if (room is not None and room < self._limits.max_header_bytes
                and self._head_timer is None and not self._lingering):
            self._head_timer = self.loop.call_later(
                self._limits.header_timeout, self._head_timed_out)
        if self._reading_body and self._body_timer is None and not self._lingering:
            # a body that spans reads (one that came whole, as most do, costs no timer):
            # one timer for both bounds, the pause between reads and the whole deadline
            limits = self._limits
            self._body_seen = now = self.loop.time()
            self._body_due = now + limits.body_deadline
            self._body_timer = self.loop.call_later(
                min(limits.body_timeout, limits.body_deadline), self._body_timed_out)

    def _head_overflow(self, data: bytes, room: int) -> None:
        # The head would outgrow its limit within this read: parse only what fits. If the
        # head ends there, the rest is its body or the next request; else it is too large,
        # and no more of it was ever buffered.
        self._head_room = 0
        self._feed(data[:room])
        if self._lingering or self.transport.is_closing():
            return
        if self._head_room == 0:
            self._refuse("header_bytes")
        else:
            self.data_received(data[room:])

    def _feed(self, data: bytes) -> None:
        # uvicorn's data_received, plus the refusals raised from the parser callbacks
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            if isinstance(exc.__context__, _Refused):
                self._refuse(exc.__context__.reason)
                return
            self._refuse("malformed_request")  # OpenAI-style, counted, logged sparingly
        except httptools.HttpParserUpgrade:
            # only CONNECT gets here (an Upgrade request is refused at its head): its
            # request went to the app, which answers 405; what follows its head is dropped
            pass

    # --- parser callbacks -------------------------------------------------------------

    def on_headers_complete(self) -> None:
        self._head_room = None
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        # counted once the head is whole: `max_header_bytes` already bounds its memory
        if len(self.headers) > self._limits.max_headers:
            raise _Refused("header_count")
        if self._over_cap is not None:
            raise _Refused(self._over_cap)
        # Connection: upgrade with an Upgrade header (rare: one C call for the rest)
        if self.parser.should_upgrade() and any(k == b"upgrade" for k, _ in self.headers):
            raise _Refused("upgrade")
        previous = self.cycle
        super().on_headers_complete()
        # The request's task is created above but has not run yet (call_soon), so the
        # extension is in place before the app sees the scope. An upgrade returns early
        # without a new cycle; the scope then belongs to the upgrade path: leave it.
        cycle = self.cycle
        if cycle is not None and cycle is not previous:
            self._reading_body = True  # until on_message_complete, maybe in this same read
            relay = self.relay
            if relay is None:
                relay = _probe_once(cycle)
            if not relay:
                return  # the app relays through `send`
            if self.scope["http_version"] == "1.0":
                cycle.__class__ = CloseDelimitedCycle  # same state, one method differs
            writer = BodyWriter(cycle)
            # ASGI types each extension's value as a dict; ours is an object with methods.
            extensions: dict[str, object] = self.scope.setdefault(  # type: ignore[assignment]
                "extensions", {})
            extensions[EXTENSION] = writer
            # Usually one; more only while pipelined requests wait for the one before.
            live = [w for w in self._writers or () if not w._cycle.response_complete]
            live.append(writer)
            self._writers = live

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._reading_body = False
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        self._head_room = self._limits.max_header_bytes  # what follows is the next head

    # --- timers and refusals ----------------------------------------------------------

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._lingering or self.transport.is_closing():
            return
        cycle = self.cycle
        if cycle is not None and self.relay and not cycle.response_complete:
            # a pipelined head waits for the response before it: its clock starts later
            self._head_timer = self.loop.call_later(
                self._limits.header_timeout, self._head_timed_out)
            return
        # Nothing of a request at all: close without a word (nginx does too).
        self._refuse("header_timeout", answer=self._head_room != self._limits.max_header_bytes)

    def _body_timed_out(self) -> None:
        self._body_timer = None
        if not self._reading_body or self._lingering or self.transport.is_closing():
            return
        timeout, now = self._limits.body_timeout, self.loop.time()
        paused = self.flow.read_paused  # we stopped reading (the app has not taken it yet)
        if paused:  # not the client's doing: neither bound runs out while we do not read
            self._body_seen = now
        if now >= self._body_due and not paused:
            self._refuse("body_deadline")
            return
        left, due = self._body_seen + timeout - now, self._body_due - now
        if left > 0:
            self._body_timer = self.loop.call_later(
                min(left, due) if due > 0 else left, self._body_timed_out)
            return
        self._refuse("body_timeout")

    def _cancel_timers(self) -> None:
        for timer in (self._head_timer, self._body_timer):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._body_timer = None

    def _refuse(self, reason: str, *, answer: bool = True) -> None:
        """Count, answer (unless a response is under way) and close this connection."""
        limits = self._limits
        limits.refused(reason, _peer(self.client), self.loop.time())
        self._cancel_timers()
        self._reading_body = False
        cycle = self.cycle
        if cycle is not None and not self.relay:
            answer = False  # its state cannot be read: closing tells uvicorn and the app
        elif cycle is not None and not cycle.response_complete:
            answer = answer and not cycle.response_started
            # the app sees its client gone; its own sends are dropped from now on
            cycle.disconnected = True
            cycle.message_event.set()
        if not answer:
            self.transport.close()
            return
        self.transport.write(limits.answers[reason])
        if not self.transport.can_write_eof():
            self.transport.close()
            return
        # lingering close: FIN after the answer; read and drop what still comes, a while
        self._lingering = True
        self.transport.write_eof()
        self.flow.resume_reading()
        self.loop.call_later(LINGER, self.transport.close)


def _probe_once(cycle: RequestResponseCycle) -> bool:
    """Probe the first request cycle of the process; warn once when the relay is off."""
    wrong = probe(cycle)
    if os.environ.get(FALLBACK_ENV) == "1":
        wrong.append(f"{FALLBACK_ENV}=1")
    KneegateHttpProtocol.relay = not wrong
    if wrong:
        log.warning(
            "uvicorn %s: its request cycle is not what kneegate's push relay reads (%s); "
            "relaying through ASGI send instead (correct; more CPU per streamed event). "
            "Client limits still cut and count, but a refusal on a connection with a "
            "request under way (a slow or late body, a later keep-alive request's head) "
            "closes it without an answer", uvicorn.__version__, ", ".join(wrong))
    return not wrong


def _peer(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "?"
