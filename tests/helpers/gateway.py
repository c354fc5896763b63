"""Test helpers: a real uvicorn server on 127.0.0.1:0, a tiny fake engine, config builders."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
from prometheus_client.parser import text_string_to_metric_families

from kneegate.admission.queue import AdmissionQueue
from kneegate.gateway.config.gateway import GatewayConfig, parse_config
from kneegate.gateway.server.serving import serving as serve  # noqa: F401 - the tests' name for it

# the example config shipped in examples/, as the README shows it
EXAMPLE = Path(__file__).parents[2] / "examples" / "kneegate.yaml"


def gw_config(upstream: str | None = None, **overrides: Any) -> GatewayConfig:
    """A gateway config for tests: one fixed-limit upstream, short tick."""
    limit = overrides.pop("limit", 4)
    data: dict[str, Any] = {"tick_interval": 0.02}
    if upstream is not None:
        data["upstreams"] = [{"name": "e0", "url": upstream, "controller": "fixed",
                              "params": {"initial": limit}}]
    data.update(overrides)
    return parse_config(data)


async def until(cond: Callable[[], bool], seconds: float = 5.0) -> None:
    """Wait for `cond` (a state of the gateway in this event loop), failing after `seconds`."""
    with anyio.fail_after(seconds):
        while not cond():
            await asyncio.sleep(0.01)


def scrape(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Prometheus text -> {(sample name, sorted labels): value}."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def total(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str,
          **labels: str) -> float:
    """Sum a series over every label set that matches `labels`."""
    return sum(
        v for (n, ls), v in samples.items()
        if n == name and all(dict(ls).get(k) == x for k, x in labels.items())
    )


def assert_conserved(m: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> None:
    """The outcome identities of DESIGN.md on one /metrics scrape (summed over labels); a
    request an engine refused unstarted and kneegate put back in its queue is received
    once, admitted (and finished) once more."""
    received = total(m, "kneegate_requests_received_total") + total(
        m, "kneegate_requests_requeued_total")
    admitted = total(m, "kneegate_requests_admitted_total")
    assert received == admitted + total(m, "kneegate_requests_shed_total") + total(
        m, "kneegate_requests_queue_timeout_total") + total(m, "kneegate_queue_depth")
    assert admitted == total(m, "kneegate_requests_finished_total") + total(
        m, "kneegate_in_flight")


async def answer_lifespan(receive: Any, send: Any) -> None:
    """The lifespan protocol for a test's bare ASGI engine: start, then stop when told."""
    while (await receive())["type"] != "lifespan.shutdown":
        await send({"type": "lifespan.startup.complete"})
    await send({"type": "lifespan.shutdown.complete"})


async def read_request_body(receive: Any) -> bytes:
    """An ASGI request's whole body."""
    body = b""
    while True:
        msg = await receive()
        body += msg.get("body", b"")
        if not msg.get("more_body"):
            return body


class FakeEngine:
    """A tiny OpenAI-ish engine: SSE completions with a delay per event, counts what it saw.

    Tests set `interval` (seconds per event), `first_delay` (before the first event) and
    `max_model_len` (what `GET /v1/models` lists, uncounted),
    read `running`, `max_running`, `aborts`, `requests`, and `last_headers`/`last_body`.
    """

    def __init__(self, interval: float = 0.0, first_delay: float = 0.0,
                 max_model_len: int | None = None) -> None:
        self.interval, self.first_delay = interval, first_delay
        self.max_model_len = max_model_len  # listed by GET /v1/models (not counted)
        self.running = self.max_running = self.aborts = self.requests = 0
        self.last_headers: dict[str, str] = {}
        self.last_body = b""
        self.last_path = ""
        self.started = asyncio.Event()
        self.aborted = asyncio.Event()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await answer_lifespan(receive, send)
            return
        path = scope["path"]
        if path == "/health":
            await reply(send, 200, b"{}")
            return
        if path == "/v1/models":
            card = {"id": "fake", "object": "model", "max_model_len": self.max_model_len}
            await reply(send, 200, json.dumps({"object": "list", "data": [card]}).encode())
            return
        if path == "/metrics":
            text = (f"vllm:num_requests_running {self.running}\n"
                    f"vllm:num_requests_waiting 0\n").encode()
            await reply(send, 200, text, b"text/plain")
            return
        body = await read_request_body(receive)
        self.requests += 1
        self.last_headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        self.last_body, self.last_path = body, scope["raw_path"].decode()
        if scope["query_string"]:
            self.last_path += "?" + scope["query_string"].decode()
        if path == "/v1/fail":
            await reply(send, 500, b'{"error": "engine exploded"}')
            return
        if path == "/v1/overloaded":
            await reply(send, 503, b'{"error": "busy"}')
            return
        req = json.loads(body or b"{}")
        await self._generate(req, receive, send)

    async def _generate(self, req: dict[str, Any], receive: Any, send: Any) -> None:
        n = int(req.get("max_tokens", 4))
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        self.started.set()
        gone = asyncio.Event()

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            gone.set()

        watcher = asyncio.create_task(watch())
        try:
            if req.get("stream"):
                await self._stream(n, send, gone)
            else:
                await self._sleep(self.first_delay + n * self.interval, gone)
                usage = {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": n + 3}
                await reply(send, 200, json.dumps({
                    "id": "cmpl-1", "object": "text_completion",
                    "choices": [{"index": 0, "text": "tok " * n, "finish_reason": "length"}],
                    "usage": usage}).encode())
        except _Gone:
            self.aborts += 1
            self.aborted.set()
        finally:
            self.running -= 1
            watcher.cancel()

    async def _stream(self, n: int, send: Any, gone: asyncio.Event) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        await self._sleep(self.first_delay, gone)
        for i in range(n):
            if i:
                await self._sleep(self.interval, gone)
            event = {"choices": [{"index": 0, "text": f"t{i} "}]}
            await send({"type": "http.response.body", "body": b"data: " +
                        json.dumps(event).encode() + b"\n\n", "more_body": True})
        usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": n}}
        await send({"type": "http.response.body", "more_body": False,
                    "body": b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n"})

    @staticmethod
    async def _sleep(seconds: float, gone: asyncio.Event) -> None:
        if gone.is_set():
            raise _Gone
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(gone.wait(), seconds)
            raise _Gone


class _Gone(Exception):
    pass


async def reply(send: Any, status: int, body: bytes, ctype: bytes = b"application/json") -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", ctype)]})
    await send({"type": "http.response.body", "body": body})


def overloaded(q: AdmissionQueue, now: float, n: int = 8) -> None:
    """`n` arrivals at `now` the engines did not serve (refused elsewhere): an excess of
    arrivals over completions, which the queue's budget rations (`Demand.excess`)."""
    for _ in range(n):
        q.demand.arrive(now)


def warm_rate(q: AdmissionQueue, rate: float, n: int = 40, start: float = 100.0,
              offered: int = 3) -> float:
    """`n` completions at `rate` per second from `start`, each after `offered` arrivals
    (3: an overload, whose excess the queue's budget rations; 1: none), so that the queue
    has a measured completion rate; returns the time of the last."""
    for i in range(n):
        t = start + i / rate
        for _ in range(offered):
            q.demand.arrive(t)
        q.note_completion(t)
    return start + (n - 1) / rate
