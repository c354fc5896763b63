"""The hot path: admit, forward, relay chunk by chunk, release.

One request, in order:
1. build the forwarded headers (hop-by-hop dropped, X-Forwarded-For added, X-Request-Id
   kept or made), read the body (413 past `max_body_bytes`, and the connection closed: at
   once when Content-Length says so, before reading any of it), pick its class (API key,
   else header, else the default);
2. `gate.acquire(class)`: a permit, or a Rejection answered as 429/503 with Retry-After;
3. open the upstream request and relay every chunk as it arrives, through the `Tap` (no
   StreamingResponse, no re-encoding): written from the upstream socket's callback when the
   server offers gateway/wire.py's body writer, else through ASGI `send`;
4. `finally`: finish the permit synchronously (the slot is free before anything else can
   happen), then close the upstream connection unless it ended cleanly, which is what makes
   the engine abort a request whose caller went away.

A request whose upstream could not be reached (connect refused or timed out: the engine
never saw it) marks that upstream failed and moves once to another upstream with room
(`Gate.reroute`) before its client sees a 502/504; so does one that vLLM's own admission
valve refused (a small 503 saying "try again later or on a different instance": the engine
never started it), which with no other upstream to go to waits again at the head of its
queue while its objective allows (`Gate.retry_refused`). A client sees an upstream by its
configured name only; the URL and the transport's words go to the log.

Three things end an exchange from outside, all by cancelling its task with a reason: the
client leaving (the body writer's `on_disconnect` callback under kneegate's server; on any
other ASGI server a watcher task blocked on `receive()`, which only returns again when the
client leaves), the sweeper the tick runs, which enforces the first-byte and idle
deadlines by comparing chunk counters — no timer per chunk — and `cut`, when the shutdown
grace is over.

What is forwarded: `proxied_path` decides from the raw request path, normalised first
when it could hide a dot segment (RFC 3986), so the allow-list judges the path the engine
will route; `FORWARDED_METHODS` are the methods the OpenAI API uses.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from functools import partial

from kneegate.controllers.base import Outcome, Sample
from kneegate.gateway.access import AccessLog
from kneegate.gateway.config import GatewayConfig
from kneegate.gateway.errors import (
    BodyTooLarge,
    HTTPError,
    InvalidHeader,
    InvalidPath,
    Rejection,
    ShuttingDown,
    UpstreamError,
    UpstreamTimeout,
    send_error,
)
from kneegate.gateway.gate import Gate, Permit
from kneegate.gateway.tap import Tap
from kneegate.gateway.types import Clock, Receive, Scope, Send
from kneegate.gateway.upstream_client import UpstreamClient, UpstreamResponse, upstream_errors
from kneegate.gateway.upstreams import Upstream, UpstreamPool
from kneegate.gateway.wire import EXTENSION as WIRE_EXTENSION
from kneegate.gateway.wire import BodyWriter

__all__ = [
    "ALLOW", "FORWARDED_METHODS", "Exchange", "Proxy", "ProxySettings", "normalise_path",
    "proxied_path",
]

# The methods of the OpenAI API, and what a proxy forwards for them (HEAD, OPTIONS).
# CONNECT, TRACE, PUT, PATCH, ... get 405: never a tunnel, never an echo.
FORWARDED_METHODS = frozenset({"GET", "POST", "DELETE", "HEAD", "OPTIONS"})
ALLOW = b"GET, POST, DELETE, HEAD, OPTIONS"
PROXIED_EXACT = frozenset({b"/tokenize", b"/detokenize", b"/version"})
_DOT = re.compile(rb"%2[eE]")

log = logging.getLogger("kneegate")

# RFC 9110 §7.6.1 connection-specific fields, plus what the client library recomputes.
HOP_BY_HOP = frozenset({
    b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te",
    b"trailer", b"trailers", b"transfer-encoding", b"upgrade", b"proxy-connection",
    b"host", b"content-length", b"expect",
})
_RESPONSE_DROP = HOP_BY_HOP - {b"content-length"}
_END = {"type": "http.response.body", "body": b"", "more_body": False}


@dataclass(frozen=True, slots=True)
class ProxySettings:
    """What the hot path reads, prepared once per config (load or reload)."""

    max_body: int
    class_header: bytes
    classes: dict[bytes, str]  # only those a request may pick by header (`header: true`)
    api_keys: dict[bytes, str]
    default_class: str
    first_byte: float
    idle: float

    @classmethod
    def from_config(cls, cfg: GatewayConfig) -> ProxySettings:
        return cls(
            max_body=cfg.max_body_bytes,
            class_header=cfg.class_header.lower().encode("latin-1"),
            classes={name.encode(): name for name, c in cfg.classes.items() if c.header},
            api_keys={key.encode(): name for key, name in cfg.api_keys.items()},
            default_class=cfg.default_class,
            first_byte=cfg.timeouts.first_byte,
            idle=cfg.timeouts.idle,
        )

    def classify(self, header: bytes | None, auth: bytes | None) -> str:
        """An API key's class, else an opted-in class the header names, else the default."""
        if auth is not None and self.api_keys and auth[:7].lower() == b"bearer ":
            cls = self.api_keys.get(auth[7:].strip())
            if cls is not None:
                return cls
        if header is not None:
            return self.classes.get(header.strip(), self.default_class)
        return self.default_class


class Exchange:
    """One request in flight: what the watcher and the sweeper need to end it."""

    __slots__ = (
        "aborted", "admitted_at", "chunks", "finished", "seen_at", "seen_chunks", "sending",
        "started", "task", "upstream",
    )

    def __init__(self, task: asyncio.Task[object]) -> None:
        self.task = task
        self.upstream: Upstream | None = None  # set at admission (and at a reroute)
        self.aborted: Outcome | None = None
        self.started = False  # response headers sent to the client
        self.finished = False  # the last byte is on its way: nothing may abort now
        self.admitted_at = 0.0
        self.chunks = 0
        self.seen_chunks = 0
        self.seen_at = 0.0
        self.sending = False  # awaiting the client's socket (back-pressure) in `send`

    def abort(self, outcome: Outcome) -> None:
        if self.aborted is None and not self.finished:
            self.aborted = outcome
            self.task.cancel()


def proxied_path(raw: bytes) -> bytes | None:
    """The path to forward for a request's raw path, or None when it is not proxied.

    Proxied: `/v1/*` and `PROXIED_EXACT`. A clean path (no '%', '/.' or '\\': nearly every
    request) is judged as it is; any other is normalised first (`normalise_path`), and the
    normalised path is what is judged and forwarded. Raises InvalidPath.
    """
    if b"%" in raw or b"/." in raw or b"\\" in raw:
        raw = normalise_path(raw)
    if raw.startswith(b"/v1/") or raw in PROXIED_EXACT:
        return raw
    return None


def normalise_path(raw: bytes) -> bytes:
    """`raw` with %2E decoded and dot segments removed (RFC 3986 §6.2.2.2, §5.2.4).

    Other escapes stay as sent: decoding %65 could complete a new escape ('%2%65' is
    '%2e' for an engine that decodes once). After this no segment of the path decodes to
    '.' or '..' for the engine. An encoded '/' or '\\' and a bare '\\' raise InvalidPath:
    servers disagree on whether they separate segments (Envoy rejects them the same way).
    """
    low = raw.lower()
    if b"%2f" in low or b"%5c" in low or b"\\" in raw:
        raise InvalidPath("the path contains an encoded '/' or a '\\'; send it unencoded")
    return remove_dot_segments(_DOT.sub(b".", raw))


def remove_dot_segments(path: bytes) -> bytes:
    """RFC 3986 §5.2.4 for an absolute path: '/a/./b/../c' -> '/a/c', '/..' -> '/'."""
    if not path.startswith(b"/"):
        return path  # '*' or an absolute URI: never proxied anyway
    segments = path.split(b"/")[1:]
    out: list[bytes] = []
    for seg in segments:
        if seg == b"..":
            if out:
                out.pop()
        elif seg != b".":
            out.append(seg)
    # a path ending in '.' or '..' names a directory: it keeps its trailing '/'
    tail = b"/" if segments[-1] in (b".", b"..") and out else b""
    return b"/" + b"/".join(out) + tail


async def read_body(receive: Receive, limit: int) -> bytes | None:
    """The whole request body, or None when the client left first."""
    chunks: list[bytes] = []
    size = 0
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return None
        body: bytes = msg.get("body", b"")
        size += len(body)
        if size > limit:
            raise BodyTooLarge(f"request body exceeds {limit} bytes; send a smaller request")
        if not msg.get("more_body", False):
            return body if not chunks else b"".join([*chunks, body])
        chunks.append(body)


async def _watch(receive: Receive, ex: Exchange) -> None:
    # After the body, receive() returns only when the client disconnects (or the response
    # completed, which `finished` tells apart).
    while (await receive())["type"] != "http.disconnect":
        pass
    ex.abort(Outcome.CLIENT_CANCELLED)


def _outcome_for_status(status: int) -> Outcome:
    if status in (429, 503):
        return Outcome.UPSTREAM_OVERLOADED
    return Outcome.UPSTREAM_ERROR if status >= 500 else Outcome.OK


class Proxy:
    """The ASGI endpoint for every proxied path."""

    def __init__(
        self, settings: ProxySettings, gate: Gate, pool: UpstreamPool, client: UpstreamClient,
        clock: Clock,
    ) -> None:
        self.settings, self.gate, self.pool, self.client = settings, gate, pool, client
        self.clock = clock
        self.active: set[Exchange] = set()
        self.cut_off: set[Exchange] = set()  # cut by `cut` (shutdown), answered 503 if unstarted
        self.access = AccessLog(clock)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        s = self.settings
        headers, rid, cls, length, ttft_ms = self._forward_headers(scope, s)
        try:
            objective = _objective(ttft_ms)
        except InvalidHeader as exc:
            self.access.refused(rid, cls, exc)
            await send_error(send, exc, [(b"x-request-id", rid)])
            return
        try:
            if length is not None and int(length) > s.max_body:
                # said up front: answer before reading any of it
                raise BodyTooLarge(f"request body of {int(length)} bytes exceeds "
                                   f"{s.max_body} bytes; send a smaller request")
            body = await read_body(receive, s.max_body)
        except BodyTooLarge as exc:
            self.gate.metrics.count_client_rejection("body_too_large")
            self.access.refused(rid, cls, exc)
            await send_error(send, exc, [(b"x-request-id", rid)])
            return
        if body is None:
            return
        task = asyncio.current_task()
        assert task is not None
        ex = Exchange(task)
        writer = _body_writer(scope)
        watcher: asyncio.Task[None] | None = None
        if writer is not None:  # the server calls us back when the client leaves
            writer.on_disconnect = partial(ex.abort, Outcome.CLIENT_CANCELLED)
            if writer.disconnected:
                ex.abort(Outcome.CLIENT_CANCELLED)
        else:
            watcher = asyncio.create_task(_watch(receive, ex))
        try:
            await self._serve(ex, scope, send, headers, body, rid, cls, writer, objective)
        except asyncio.CancelledError:
            if ex.aborted is None:
                raise
            task.uncancel()
            error = None if ex.started else self._abort_error(ex, s)
            if error is not None:
                await send_error(send, error, [(b"x-request-id", rid)])
        finally:
            if watcher is not None:
                watcher.cancel()
            elif writer is not None:
                writer.on_disconnect = None

    def _abort_error(self, ex: Exchange, s: ProxySettings) -> HTTPError | None:
        # what the client hears of an abort before the response started (if still there)
        if ex.aborted is Outcome.TIMEOUT:
            name = ex.upstream.name if ex.upstream is not None else "?"
            return UpstreamTimeout(
                f"upstream '{name}' sent nothing within {s.first_byte:g}s; retry later")
        if ex in self.cut_off:
            return ShuttingDown("kneegate shut down before the engine answered; retry",
                                self.gate.queue.retry_after_min)
        return None

    def _status(self, ex: Exchange, resp: Response | None, error: HTTPError | None) -> int:
        """The status the client got, or is about to get (499: none, it left)."""
        if ex.started and resp is not None:
            return resp.status
        if error is None and ex.aborted is not None:
            error = self._abort_error(ex, self.settings)
        return error.status if error is not None else 499

    def cut(self) -> int:
        """Abort every exchange in flight (the shutdown grace is over): counted as
        client_cancelled (the engine is not to blame: no sample), the upstream request
        closed; an unstarted response is answered 503 shutting_down. Returns how many."""
        cut = [ex for ex in self.active if ex.aborted is None and not ex.finished]
        for ex in cut:
            self.cut_off.add(ex)
            ex.abort(Outcome.CLIENT_CANCELLED)
        return len(cut)

    def _forward_headers(
        self, scope: Scope, s: ProxySettings
    ) -> tuple[list[tuple[bytes, bytes]], bytes, str, bytes | None, bytes | None]:
        """Headers for the engine, the request id, the class, the Content-Length and the
        request's own TTFT objective (`x-kneegate-ttft-ms`, ours: not forwarded)."""
        out: list[tuple[bytes, bytes]] = []
        xff = rid = cls_value = auth = length = ttft = None
        for k, v in scope["headers"]:
            if k in HOP_BY_HOP:
                if k == b"content-length" and v.isdigit():  # the parser checked it already
                    length = v
                continue
            if k == b"x-forwarded-for":
                xff = v
                continue
            if k == TTFT_HEADER:
                ttft = v
                continue
            if k == b"x-request-id":
                rid = v
            elif k == s.class_header:
                cls_value = v
            elif k == b"authorization":
                auth = v
            out.append((k, v))
        if rid is None:
            rid = os.urandom(16).hex().encode()  # as random as uuid4, a third of the cost
            out.append((b"x-request-id", rid))
        client = scope.get("client")
        if client:
            xff = client[0].encode() if xff is None else xff + b", " + client[0].encode()
        if xff is not None:
            out.append((b"x-forwarded-for", xff))
        return out, rid, s.classify(cls_value, auth), length, ttft

    async def _serve(
        self, ex: Exchange, scope: Scope, send: Send, headers: list[tuple[bytes, bytes]],
        body: bytes, rid: bytes, cls: str, writer: BodyWriter | None, objective: float,
    ) -> None:
        # A leading signal of the KV footprint: about 4 bytes a token (JSON overhead is a
        # constant factor: controllers use ratios of sizes, or put estimates into tokens by
        # the ratio of finished prompts' token counts to them). Every upstream that may
        # serve the request hears of it as it arrives, queued or shed included (under
        # overload the queue delays admissions by seconds); the one it is dispatched to,
        # again at admission (the admission queue tells them). Admission weighs it against a
        # controller's token budget.
        size = len(body) // 4
        try:
            permit = await self.gate.acquire(cls, size, objective)
        except Rejection as exc:
            self.access.refused(rid, cls, exc)
            await send_error(send, exc, [(b"x-request-id", rid)])
            return
        ex.admitted_at, ex.upstream = permit.admitted_at, permit.upstream
        self.active.add(ex)
        resp: Response | None = None
        tap: Tap | None = None
        error: UpstreamError | None = None
        refused: Rejection | None = None  # requeued after an engine's refusal, then timed out
        outcome = Outcome.CLIENT_CANCELLED  # what a cancellation leaves behind
        try:
            resp = await self._open(ex, permit, scope, headers, body)
            tap = Tap(self.clock, _is_sse(resp.headers))
            with upstream_errors(permit.upstream.url):
                await self._relay(ex, resp, tap, send, rid, writer)
            outcome = _outcome_for_status(resp.status)
        except UpstreamError as exc:
            outcome, error = self._upstream_failed(permit, exc, rid), exc
        except Rejection as exc:  # counted by the gate, which has finished the permit
            refused = exc
        finally:
            # the slot is free before anything else may happen; sync, cancellation-proof
            self.active.discard(ex)
            if ex.aborted is not None:
                outcome = ex.aborted
            if not permit.done:  # done: requeued by `retry_refused` and counted there
                sample = None
                try:  # a connect failure says nothing of latency
                    if error is None or not error.unreached:
                        sample = self._sample(permit, outcome, tap)
                finally:  # even a sample that cannot be made must not keep the slot
                    permit.finish(outcome, sample)
            if resp is not None:
                resp.release() if ex.finished else resp.close()
            if self.access.on():
                if refused is not None:
                    self.access.refused(rid, cls, refused)
                else:
                    self.access.finished(rid, permit, outcome, self._status(ex, resp, error), tap)
        if refused is not None:
            await send_error(send, refused, [(b"x-request-id", rid)])
        elif error is not None and not ex.started:
            await send_error(send, error.public(permit.upstream.name),
                             [(b"x-request-id", rid)])

    async def _open(
        self, ex: Exchange, permit: Permit, scope: Scope, headers: list[tuple[bytes, bytes]],
        body: bytes,
    ) -> Response:
        """Send the request upstream; return once the response head arrived.

        A connect failure marks that upstream failed and, the engine never having seen
        the request, moves it once to another upstream with room (else it is raised)."""
        method, target = scope["method"], _target(scope)
        try:
            resp = await self.client.open(method, permit.upstream.url, target, headers, body)
        except UpstreamError as exc:
            if not exc.unreached:
                raise
            self._unreachable(permit.upstream, exc)
            if not self.gate.reroute(permit):
                raise
            ex.admitted_at, ex.upstream = permit.admitted_at, permit.upstream
            resp = await self.client.open(method, permit.upstream.url, target, headers, body)
        permit.upstream.answered(self.clock())
        # vLLM's own valve (--max-num-queued-reqs / --max-num-queued-tokens) refuses with a
        # small 503 before the engine starts the request: another upstream with room takes
        # it, else it waits again at the head of its queue while its objective allows (the
        # gate bounds the retries: the refusing upstream has no room until one of its
        # requests ends). Read whole (it is small) to tell it from other 503s; relayed from
        # memory when it stands.
        while resp.status == 503 and _small(resp.headers):
            with upstream_errors(permit.upstream.url):
                refusal = await resp.read_all()
            resp.release()
            if _VALVE not in refusal or not await self.gate.retry_refused(
                    permit, self._sample(permit, Outcome.UPSTREAM_OVERLOADED, None)):
                return _ReadResponse(resp.status, resp.headers, refusal)
            ex.admitted_at, ex.upstream = permit.admitted_at, permit.upstream
            resp = await self.client.open(method, permit.upstream.url, target, headers, body)
            permit.upstream.answered(self.clock())
        return resp

    async def _relay(
        self, ex: Exchange, resp: Response, tap: Tap, send: Send, rid: bytes,
        writer: BodyWriter | None,
    ) -> None:
        headers = [h for h in resp.headers if h[0] not in _RESPONSE_DROP]
        if not any(k == b"x-request-id" for k, _ in headers):
            headers.append((b"x-request-id", rid))
        await send({"type": "http.response.start", "status": resp.status, "headers": headers})
        ex.started = True
        feed = tap.feed
        if writer is not None and writer.ready():
            # Push: the upstream socket's callback writes each chunk to the client itself
            # (gateway/wire.py); this task wakes only at the end, or to wait out the
            # client's back-pressure through `send` with the chunk the writer refused.
            def sink(data: bytes) -> bool:
                if not writer.write(data):
                    return False
                ex.chunks += 1
                feed(data)
                return True

            more: Callable[[], Awaitable[bytes]] = partial(resp.pipe, sink)
        else:
            more = resp.read
        ended = resp.ended
        while chunk := await more():
            ex.chunks += 1
            feed(chunk)
            if ended():  # the last bytes: one write with the end of the response
                ex.finished = True
                await send({"type": "http.response.body", "body": chunk, "more_body": False})
                return
            # `send` waits while the client does not read: the sweeper tells that apart
            ex.sending = True
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            ex.sending = False
        ex.finished = True
        await send(_END)

    def _unreachable(self, up: Upstream, exc: UpstreamError) -> None:
        self.pool.mark_failed(up, self.clock(), exc.message)

    def _upstream_failed(self, permit: Permit, exc: UpstreamError, rid: bytes) -> Outcome:
        up = permit.upstream
        if exc.unreached:
            if up.healthy:  # else `_open` marked it already, or a probe is under way
                self._unreachable(up, exc)
        else:
            log.warning("upstream %s (%s) failed request %s: %s (%r)", up.name, up.url,
                        rid.decode("latin-1"), exc.message, exc.__cause__)
        return Outcome.TIMEOUT if isinstance(exc, UpstreamTimeout) else Outcome.UPSTREAM_ERROR

    def _sample(self, permit: Permit, outcome: Outcome, tap: Tap | None) -> Sample | None:
        if outcome.is_client:
            return None  # counted, never a latency sample
        at = permit.admitted_at
        ttft = None
        prompt = out = 0
        if tap is not None:
            prompt, out = tap.usage()
            if tap.first_at is not None:
                ttft = tap.first_at - at
        return Sample(
            admitted_at=at, duration=self.clock() - at, ttft=ttft, prompt_tokens=prompt,
            output_tokens=out, inflight_at_admit=permit.ticket.inflight_at_admit,
            outcome=outcome,
        )

    def sweep(self, now: float) -> None:
        """Abort exchanges past their first-byte or idle deadline (called from the tick).

        Silence while the relay waits on the client's socket is the client's doing (it
        stopped reading): `client_stalled`, never a timeout against the engine.
        """
        fb, idle = self.settings.first_byte, self.settings.idle
        for ex in self.active:
            if ex.chunks != ex.seen_chunks:
                ex.seen_chunks, ex.seen_at = ex.chunks, now
                if ex.upstream is not None:
                    ex.upstream.answered_at = now  # the engine makes progress
            elif ex.chunks == 0:
                if now - ex.admitted_at > fb:
                    ex.abort(Outcome.TIMEOUT)
            elif now - ex.seen_at > idle:
                ex.abort(Outcome.CLIENT_STALLED if ex.sending else Outcome.TIMEOUT)


TTFT_HEADER = b"x-kneegate-ttft-ms"


def _objective(value: bytes | None) -> float:
    """The request's own TTFT objective in seconds from `x-kneegate-ttft-ms` (inf: none).
    It can only tighten its class's; a value that is not a positive number is a 400."""
    if value is None:
        return math.inf
    try:
        ms = float(value)
    except ValueError:
        ms = math.nan
    if not (0 < ms < math.inf):
        raise InvalidHeader(
            f"x-kneegate-ttft-ms must be a positive number of milliseconds, got "
            f"{value[:32].decode('latin-1')!r}", "x-kneegate-ttft-ms")
    return ms / 1000


# in both of vLLM 0.32's admission refusals (vllm/exceptions.py): "...busy and cannot accept
# new requests" and "...reached its prefill token backlog limit", each followed by this
_VALVE = b"Please try again later or on a different instance"
_SMALL = 1 << 16  # bytes: a refusal is a short JSON error


def _small(headers: Sequence[tuple[bytes, bytes]]) -> bool:
    for k, v in headers:
        if k == b"content-length":
            return v.isdigit() and int(v) <= _SMALL
    return False


class _ReadResponse:
    """An engine's small response read whole (to look at it), relayed from memory: the
    parts of `UpstreamResponse` the relay uses."""

    def __init__(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        self.status, self.headers, self._body = status, headers, body

    async def read(self) -> bytes:
        body, self._body = self._body, b""
        return body

    async def pipe(self, sink: Callable[[bytes], bool]) -> bytes:
        return await self.read()

    def ended(self) -> bool:
        return True  # what `read` returns is the last of it

    def release(self) -> None:
        pass  # its connection went back to the pool when it was read

    def close(self) -> None:
        pass


Response = UpstreamResponse | _ReadResponse


def _body_writer(scope: Scope) -> BodyWriter | None:
    extensions = scope.get("extensions")
    return extensions.get(WIRE_EXTENSION) if extensions else None


def _target(scope: Scope) -> bytes:
    path: bytes = scope.get("raw_path") or scope["path"].encode()
    qs: bytes = scope.get("query_string", b"")
    return path + b"?" + qs if qs else path


def _is_sse(headers: Sequence[tuple[bytes, bytes]]) -> bool:
    for k, v in headers:
        if k == b"content-type":
            return v.startswith(b"text/event-stream")
    return False

