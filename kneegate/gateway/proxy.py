"""The hot path: admit, forward, relay chunk by chunk, release.

One request, in order:
1. build the forwarded headers (gateway/forwarding.py: hop-by-hop dropped,
   X-Forwarded-For added, X-Request-Id kept or made; 401 when `require_api_key` finds no
   configured key, before anything else is read), read the body (413 past
   `max_body_bytes`, and the connection closed: at once when Content-Length says so,
   before reading any of it), pick its class (API key, else header, else the default);
2. `gate.acquire(class)`: a permit, or a Rejection answered as 429/503 with Retry-After;
3. open the upstream request and relay every chunk as it arrives, through the `Tap` (no
   StreamingResponse, no re-encoding): written from the upstream socket's callback when the
   server offers gateway/http/wire.py's body writer, else through ASGI `send`;
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

What is forwarded, and how (paths, methods, headers, the valve's refusal): gateway/forwarding.py.
"""

from __future__ import annotations

import asyncio
import logging
from functools import partial

from kneegate.admission.types import TenantPolicy
from kneegate.controllers.base import Outcome, Sample
from kneegate.gateway.access import AccessLog
from kneegate.gateway.config.upstream import public_url
from kneegate.gateway.errors import (
    BodyTooLarge,
    ContextTooLong,
    HTTPError,
    InvalidApiKey,
    InvalidBody,
    InvalidHeader,
    ModelNotFound,
    ModelRequired,
    Rejection,
    ShuttingDown,
    UpstreamError,
    UpstreamTimeout,
    send_error,
)
from kneegate.gateway.exchange import Exchange, read_body, watch
from kneegate.gateway.forwarding import (
    VALVE,
    ProxySettings,
    ReadResponse,
    content_length,
    forward_headers,
    forward_target,
    is_sse,
    parse_objective,
    small_body,
)
from kneegate.gateway.gate import Gate, Permit
from kneegate.gateway.http.body_writer import BodyWriter
from kneegate.gateway.models import answer_models
from kneegate.gateway.relay import Response, body_writer, relay
from kneegate.gateway.request_size import BadBody, RequestSize, over_context, read_request
from kneegate.gateway.tap import Tap
from kneegate.gateway.types import Clock, Receive, Scope, Send
from kneegate.gateway.upstream.client import (
    TRANSPORT_ERRORS,
    UpstreamClient,
    upstream_error,
    upstream_errors,
)
from kneegate.gateway.upstream.pool import UpstreamPool
from kneegate.gateway.upstream.state import Upstream

__all__ = ["Proxy"]

_CLIENT_REASON: dict[type[HTTPError], str] = {  # kneegate_client_rejections_total's reason
    InvalidBody: "invalid_body", ContextTooLong: "context_length",
    ModelNotFound: "model_not_found", ModelRequired: "model_required"}

log = logging.getLogger("kneegate")


def _refused_as_bad(resp: Response | None) -> bool:
    """The engine answered 4xx (429 aside): the request's own fault, not evidence of the
    engine's speed (a 400 for a prompt over the context comes back in milliseconds)."""
    return resp is not None and 400 <= resp.status < 500 and resp.status != 429


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
        try:
            headers, rid, cls, tenant, length, ttft_ms = forward_headers(scope, s)
        except InvalidHeader as exc:  # before admission: no request id of its own to echo
            self.gate.metrics.count_client_rejection("invalid_header")
            self.access.refused(b"-", s.default_class, exc, "-")
            await send_error(send, exc)
            return
        except InvalidApiKey as exc:  # before its body is read: never queued, never demand
            self.gate.metrics.count_client_rejection("invalid_api_key")
            self.access.refused(exc.request_id, s.default_class, exc, "-")
            await send_error(send, exc, [(b"x-request-id", exc.request_id)])
            return
        try:
            objective = parse_objective(ttft_ms)
        except InvalidHeader as exc:
            self.gate.metrics.count_client_rejection("invalid_header")
            self.access.refused(rid, cls, exc, tenant.label)
            await send_error(send, exc, [(b"x-request-id", rid)])
            return
        try:
            if length is not None and content_length(length) > s.max_body:
                # said up front: answer before reading any of it
                raise BodyTooLarge(f"request body of {content_length(length)} bytes exceeds "
                                   f"{s.max_body} bytes; send a smaller request")
            body = await read_body(receive, s.max_body)
        except BodyTooLarge as exc:
            self.gate.metrics.count_client_rejection("body_too_large")
            self.access.refused(rid, cls, exc, tenant.label)
            await send_error(send, exc, [(b"x-request-id", rid)])
            return
        if body is None or await answer_models(scope, send, self.gate.queue, rid):
            return
        try:
            size = self._size(scope, body)
        except (InvalidBody, ContextTooLong, ModelNotFound, ModelRequired) as exc:
            self.gate.metrics.count_client_rejection(_CLIENT_REASON[type(exc)])
            self.access.refused(rid, cls, exc, tenant.label)
            await send_error(send, exc, [(b"x-request-id", rid)])
            return
        task = asyncio.current_task()
        assert task is not None
        ex = Exchange(task)
        writer = body_writer(scope)
        watcher: asyncio.Task[None] | None = None
        if writer is not None:  # the server calls us back when the client leaves
            writer.on_disconnect = partial(ex.abort, Outcome.CLIENT_CANCELLED)
            if writer.disconnected:
                ex.abort(Outcome.CLIENT_CANCELLED)
        else:
            watcher = asyncio.create_task(watch(receive, ex))
        try:
            await self._serve(ex, scope, send, headers, body, rid, cls, writer, objective,
                              tenant, size)
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

    def _size(self, scope: Scope, body: bytes) -> RequestSize:
        """What the request asks (gateway/request_size.py). Raises InvalidBody for a
        generation request that is not a JSON object, ContextTooLong for one that surely
        cannot fit its model's context: answered at once, never queued, as vLLM would."""
        path: bytes = scope.get("raw_path") or scope["path"].encode()
        try:
            size = read_request(scope["method"], path, body, self.gate.queue.affinity_on)
        except BadBody as exc:
            raise InvalidBody(str(exc)) from None
        if size.generation and self.gate.queue.pool_of(size.model) is None:  # never queued
            if size.model is None:
                raise ModelRequired(f"name a model: {', '.join(self.gate.queue.models)}")
            raise ModelNotFound(f"The model `{size.model}` does not exist. Available models: "
                                f"{', '.join(self.gate.queue.models)}.")
        if size.generation:
            context = self.pool.context(size.model)
            why = None if context is None else over_context(size, context)
            if why is not None:
                long = ContextTooLong(why)
                long.param = "messages" if path == b"/v1/chat/completions" else "prompt"
                raise long
        return size

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

    async def _serve(
        self, ex: Exchange, scope: Scope, send: Send, headers: list[tuple[bytes, bytes]],
        body: bytes, rid: bytes, cls: str, writer: BodyWriter | None, objective: float,
        tenant: TenantPolicy, size: RequestSize,
    ) -> None:
        # The prompt's size in tokens, read from its content: a leading signal of the KV
        # footprint (controllers learn the engine's tokens per estimate from finished
        # prompts), weighed against a controller's token budget. A request that is not
        # generation passes with no slot and is no evidence (admission/queue.py).
        if cls not in self.gate.queue.classes:  # a reload removed it while the body came
            cls = self.settings.default_class
        try:
            permit = await self.gate.acquire(cls, size.prompt, objective, tenant, size.stream,
                                             size.generation, size.model, size.prefix)
        except Rejection as exc:
            self.access.refused(rid, cls, exc, tenant.label)
            await send_error(send, exc, [(b"x-request-id", rid)])
            return
        ex.admitted_at, ex.upstream, ex.permit = permit.admitted_at, permit.upstream, permit
        self.active.add(ex)
        resp: Response | None = None
        tap: Tap | None = None
        error: UpstreamError | None = None
        refused: Rejection | None = None  # requeued after an engine's refusal, then timed out
        outcome = Outcome.CLIENT_CANCELLED  # what a cancellation leaves behind
        try:
            resp = await self._open(ex, permit, scope, headers, body)
            tap = ex.tap = Tap(self.clock, is_sse(resp.headers),
                               partial(self.gate.first_token, permit))
            try:
                await relay(ex, resp, tap, send, rid, writer)
            except TRANSPORT_ERRORS as exc:  # `with upstream_errors(...)`, without its calls
                raise upstream_error(permit.upstream.url, exc) from exc
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
                try:  # a connect failure, or the client's own error, says nothing of latency
                    if (error is None or not error.unreached) and not _refused_as_bad(resp):
                        sample = self._sample(permit, outcome, tap)
                finally:  # even a sample that cannot be made must not keep the slot
                    permit.finish(outcome, sample)
            if resp is not None:
                resp.release() if ex.finished else resp.close()
            if self.access.on():
                if refused is not None:
                    self.access.refused(rid, cls, refused, tenant.label)
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
        method, target = scope["method"], forward_target(scope)
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
        while resp.status == 503 and small_body(resp.headers):
            try:
                with upstream_errors(permit.upstream.url):
                    refusal = await resp.read_all()
            except BaseException:  # cancelled (client gone, deadline) or broken mid-body:
                resp.close()  # not returned to `_serve`, so closed here, never leaked
                raise
            resp.release()
            if VALVE not in refusal or not await self.gate.retry_refused(
                    permit, self._sample(permit, Outcome.UPSTREAM_OVERLOADED, None)):
                return ReadResponse(resp.status, resp.headers, refusal)
            ex.admitted_at, ex.upstream = permit.admitted_at, permit.upstream
            resp = await self.client.open(method, permit.upstream.url, target, headers, body)
            permit.upstream.answered(self.clock())
        return resp

    def _unreachable(self, up: Upstream, exc: UpstreamError) -> None:
        self.pool.mark_failed(up, self.clock(), exc.message)

    def _upstream_failed(self, permit: Permit, exc: UpstreamError, rid: bytes) -> Outcome:
        up = permit.upstream
        if exc.unreached:
            if up.healthy:  # else `_open` marked it already, or a probe is under way
                self._unreachable(up, exc)
        else:
            log.warning("upstream %s (%s) failed request %s: %s (%r)", up.name, public_url(up.url),
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
        """Abort exchanges past their first-byte or idle deadline (called from the tick),
        and charge the output streamed since the last tick to each one's tenant.

        Silence while the relay waits on the client's socket is the client's doing (it
        stopped reading): `client_stalled`, never a timeout against the engine.
        """
        fb, idle = self.settings.first_byte, self.settings.idle
        for ex in self.active:
            if ex.chunks != ex.seen_chunks:
                ex.seen_chunks, ex.seen_at = ex.chunks, now
                if ex.upstream is not None:
                    ex.upstream.answered_at = now  # the engine makes progress
                tap, permit = ex.tap, ex.permit
                if tap is not None and tap.streaming and permit is not None:
                    # its tenant's fair share is charged as the output streams (one event
                    # is about one token; the true count settles it at the end)
                    self.gate.charge(permit, tap.events - permit.ticket.output_charged, now)
            elif ex.chunks == 0:
                if now - ex.admitted_at > fb:
                    ex.abort(Outcome.TIMEOUT)
            elif now - ex.seen_at > idle:
                ex.abort(Outcome.CLIENT_STALLED if ex.sending else Outcome.TIMEOUT)


