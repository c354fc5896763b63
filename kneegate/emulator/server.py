"""The emulator's OpenAI-compatible HTTP server (Starlette), vLLM's routes and wire format.

    POST /v1/completions, /v1/chat/completions   streaming (SSE) or not
    GET  /v1/models (with max_model_len), /health, /version, /metrics
    POST /tokenize                                vLLM's: a prompt's token ids (protocol.tokenize)
    POST /admin/slowdown {"factor": 2.0}          multiply step times (halve capacity)

`build_app(profile, speed=...)` runs the core in real time (`speed` < 1 is slower than real
time: each step sleeps duration / speed). Profile "relay" skips the engine: every request
streams `max_tokens` chunks, `relay_interval` seconds apart (0: as fast as possible), to
measure what sits in front of an engine.

A client that disconnects is noticed by a task waiting on the ASGI `receive`; it aborts the
request in the core at once (blocks freed, counted as finished_reason="abort").

`max_num_queued_reqs` / `max_num_queued_tokens` (vLLM >= 0.32's flags; None: no cap) are
checked by the core when a request arrives, after it parsed: a refused request is answered
503 with vLLM's body (protocol.queue_full), counted in vllm:admission_rejections_total{reason}
and never enters the engine. The relay profile has no engine and no caps. Two differences
from vLLM, both small: the core counts a first token (or a finish) when it schedules the step,
up to one step before vLLM's frontend would see it; and a request is parsed first, so a bad
one is a 400 even while the engine is full (vLLM 0.29+ checks admission before it renders the
prompt, so there it is a 503).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from kneegate.emulator.core import EngineCore, EngineRequest, QueueFull
from kneegate.emulator.driver import RealTimeDriver, TokenQueue
from kneegate.emulator.metrics import EngineMetrics
from kneegate.emulator.profiles import Profile, load_profile
from kneegate.emulator.protocol import (
    DONE,
    ApiError,
    ParsedRequest,
    SseEncoder,
    error_body,
    parse_request,
    queue_full,
    tokenize,
)

__all__ = ["EMULATOR_VERSION", "build_app"]

EMULATOR_VERSION = "0.0.0+kneegate.emulator"
RELAY = "relay"
_SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
]


class EmulatorState:
    """What the routes share: the profile, the core, its driver and its metrics."""

    def __init__(
        self,
        profile: Profile,
        *,
        speed: float,
        seed: int,
        model_name: str,
        relay: bool,
        relay_interval: float,
    ) -> None:
        self.profile, self.model_name = profile, model_name
        self.relay, self.relay_interval = relay, relay_interval
        self.core = EngineCore(profile, seed=seed)
        self.registry = CollectorRegistry()
        cache = {
            "block_size": str(profile.engine.block_size),
            "num_gpu_blocks": str(profile.num_blocks),
            "enable_prefix_caching": str(profile.engine.enable_prefix_caching),
        }
        self.metrics = EngineMetrics(self.registry, self.core.stats, model_name, cache)
        self.driver = RealTimeDriver(self.core, self.metrics, speed=speed)
        self.created = int(time.time())
        # requests carry prefix-cache keys of this many tokens a block, or none (caching off)
        engine = profile.engine
        self.block_keys_of = engine.block_size if engine.enable_prefix_caching else None


def build_app(
    profile: str | Profile = "cpu-tiny",
    *,
    speed: float = 1.0,
    seed: int = 0,
    model_name: str | None = None,
    relay_interval: float = 0.0,
    max_num_queued_reqs: int | None = None,
    max_num_queued_tokens: int | None = None,
    enable_prefix_caching: bool | None = None,
) -> Starlette:
    """The emulator as an ASGI app; its state is `app.state.emulator`.

    The two caps and prefix caching, where given, replace the profile's (vLLM's flags; None
    keeps it).
    """
    relay = profile == RELAY
    prof = load_profile("cpu-tiny") if relay else _as_profile(profile)
    if not relay:
        prof = _with_caps(prof, max_num_queued_reqs, max_num_queued_tokens)
        if enable_prefix_caching is not None:
            engine = dataclasses.replace(prof.engine, enable_prefix_caching=enable_prefix_caching)
            prof = dataclasses.replace(prof, engine=engine)
    name = model_name or (RELAY if relay else prof.name)
    state = EmulatorState(
        prof, speed=speed, seed=seed, model_name=name, relay=relay, relay_interval=relay_interval
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        task = asyncio.create_task(state.driver.run(), name="engine-driver")
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def completions(request: Request) -> Response:
        return await _generate(state, request, chat=False)

    async def chat(request: Request) -> Response:
        return await _generate(state, request, chat=True)

    async def models(request: Request) -> Response:
        return JSONResponse(_models(state))

    async def health(request: Request) -> Response:
        return Response(status_code=200)

    async def version(request: Request) -> Response:
        return JSONResponse({"version": EMULATOR_VERSION})

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(state.registry), media_type=CONTENT_TYPE_LATEST)

    async def slowdown(request: Request) -> Response:
        return await _slowdown(state, request)

    async def tokenize_route(request: Request) -> Response:
        try:
            return JSONResponse(tokenize(await request.body(), served_model=state.model_name,
                                         max_model_len=state.profile.max_model_len))
        except ApiError as err:
            return JSONResponse(error_body(err), status_code=err.status)

    routes = [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/models", models),
        Route("/health", health),
        Route("/version", version),
        Route("/metrics", metrics),
        Route("/tokenize", tokenize_route, methods=["POST"]),
        Route("/admin/slowdown", slowdown, methods=["POST"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.emulator = state
    return app


def _as_profile(profile: str | Profile) -> Profile:
    return load_profile(profile) if isinstance(profile, str) else profile


def _with_caps(profile: Profile, reqs: int | None, tokens: int | None) -> Profile:
    """`profile` with the admission caps that are given (not None) replaced."""
    engine = profile.engine
    if reqs is not None:
        engine = dataclasses.replace(engine, max_num_queued_reqs=reqs)
    if tokens is not None:
        engine = dataclasses.replace(engine, max_num_queued_tokens=tokens)
    return dataclasses.replace(profile, engine=engine)


def _models(state: EmulatorState) -> dict[str, Any]:
    model = {
        "id": state.model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "vllm",
        "root": state.model_name,
        "parent": None,
        "max_model_len": state.profile.max_model_len,
        "permission": [],
    }
    return {"object": "list", "data": [model]}


async def _slowdown(state: EmulatorState, request: Request) -> Response:
    try:
        factor = float(json.loads(await request.body())["factor"])
        if factor <= 0:
            raise ValueError(factor)
    except (ValueError, KeyError, TypeError):
        err = ApiError(400, 'send {"factor": x} with x > 0', "BadRequestError", "factor")
        return JSONResponse(error_body(err), status_code=400)
    state.core.slowdown = factor
    return JSONResponse({"slowdown": factor})


async def _generate(state: EmulatorState, request: Request, *, chat: bool) -> Response:
    try:
        parsed = parse_request(
            await request.body(),
            chat=chat,
            served_model=state.model_name,
            max_model_len=state.profile.max_model_len,
            block_size=state.block_keys_of,
        )
    except ApiError as err:
        return JSONResponse(error_body(err), status_code=err.status)
    encoder = SseEncoder(chat=chat, model=state.model_name, created=int(time.time()))
    if state.relay:
        return _RelayResponse(state, parsed, encoder)
    return _EngineResponse(state, parsed, encoder)


class _EngineResponse(Response):
    """Submits the request to the driver and relays its tokens; aborts on disconnect."""

    def __init__(self, state: EmulatorState, parsed: ParsedRequest, encoder: SseEncoder) -> None:
        self.state, self.parsed, self.enc = state, parsed, encoder
        self.produced = 0
        self.finish: str | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        p, driver = self.parsed, self.state.driver
        try:
            queue = driver.submit(
                EngineRequest(self.enc.id, p.prompt_tokens, p.max_tokens, ignore_eos=p.ignore_eos,
                              block_keys=p.block_keys)
            )
        except QueueFull as full:  # counted by the core; nothing of it is in the engine
            err = queue_full(full.reason)
            await JSONResponse(error_body(err), status_code=err.status)(scope, receive, send)
            return
        watcher = asyncio.create_task(_watch_disconnect(receive, queue))
        try:
            if p.stream:
                await self._stream(send, queue)
            else:
                await self._whole(scope, receive, send, queue)
        except OSError:
            pass  # the client went away mid-send
        finally:
            watcher.cancel()
            if self.finish is None:
                driver.abort(self.enc.id)

    async def _stream(self, send: Send, queue: TokenQueue) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
        pending = [self.enc.role()] if self.parsed.chat else []
        while self.finish is None:
            batch = [await queue.get()]
            while not queue.empty():
                batch.append(queue.get_nowait())  # several steps behind: one write for all
            for ev in batch:
                if ev is None:
                    return  # the client disconnected
                pending.extend(self._chunks(ev.new_tokens, ev.finished))
            if self.finish is not None:
                if self.parsed.include_usage:
                    pending.append(self.enc.usage(self.parsed.prompt_tokens, self.produced))
                pending.append(DONE)
            await send(
                {
                    "type": "http.response.body",
                    "body": b"".join(pending),
                    "more_body": self.finish is None,
                }
            )
            pending = []

    def _chunks(self, new_tokens: int, finished: str | None) -> list[bytes]:
        out = []
        for i in range(new_tokens):
            self.produced += 1
            out.append(self.enc.token(self.produced, finished if i == new_tokens - 1 else None))
        self.finish = finished
        return out

    async def _whole(self, scope: Scope, receive: Receive, send: Send, queue: TokenQueue) -> None:
        while self.finish is None:
            ev = await queue.get()
            if ev is None:
                return  # disconnected
            self.produced += ev.new_tokens
            self.finish = ev.finished
        body = self.enc.full(self.parsed.prompt_tokens, self.produced, self.finish)
        await JSONResponse(body)(scope, receive, send)


class _RelayResponse(Response):
    """Zero compute: `max_tokens` chunks, `relay_interval` apart."""

    def __init__(self, state: EmulatorState, parsed: ParsedRequest, encoder: SseEncoder) -> None:
        self.state, self.parsed, self.enc = state, parsed, encoder

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        p, interval = self.parsed, self.state.relay_interval
        if not p.stream:
            if interval:
                await asyncio.sleep(interval * p.max_tokens)
            full = self.enc.full(p.prompt_tokens, p.max_tokens, "length")
            await JSONResponse(full)(scope, receive, send)
            self.state.metrics.success["length"].inc()
            return
        await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
        for i in range(1, p.max_tokens + 1):
            last = i == p.max_tokens
            body = self.enc.token(i, "length" if last else None)
            if last:
                usage = [self.enc.usage(p.prompt_tokens, i)] if p.include_usage else []
                body = b"".join([body, *usage, DONE])
            await send({"type": "http.response.body", "body": body, "more_body": not last})
            if interval:
                await asyncio.sleep(interval)
            elif i % 16 == 0:
                await asyncio.sleep(0)  # let other streams run
        self.state.metrics.success["length"].inc()


async def _watch_disconnect(receive: Receive, queue: TokenQueue) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    queue.put_nowait(None)
