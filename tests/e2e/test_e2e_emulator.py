"""End to end: the real `openai` client -> uvicorn gateway -> uvicorn emulator, all on sockets."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
import httpx
import openai
import pytest
from helpers.gateway import gw_config, scrape, serve, total

from kneegate.gateway.app import KneegateApp, build_app

pytestmark = pytest.mark.anyio

engine_server = pytest.importorskip("kneegate.emulator.server")


@contextlib.asynccontextmanager
async def stack(**kw: Any) -> AsyncIterator[tuple[str, str, KneegateApp]]:
    async with serve(engine_server.build_app("cpu-tiny")) as up:
        app = build_app(gw_config(up, **kw))
        async with serve(app) as gw:
            yield up, gw, app


async def engine_metrics(client: httpx.AsyncClient, up: str) -> dict[Any, float]:
    return scrape((await client.get(up + "/metrics")).text)


async def test_openai_client_gets_the_same_content_as_direct() -> None:
    async with stack(limit=4) as (up, gw, _):
        results = []
        for base in (up, gw):
            async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="k") as c:
                model = (await c.models.list()).data[0].id
                done = await c.completions.create(model=model, prompt="hello", max_tokens=6)
                stream = await c.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                    stream=True, stream_options={"include_usage": True})
                chunks = [ch async for ch in stream]
                text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
                results.append((done.choices[0].text, done.usage, text, chunks[-1].usage))
        assert results[0] == results[1]
        assert results[1][3] is not None and results[1][3].completion_tokens == 6


async def test_openai_client_honours_retry_after_on_429() -> None:
    async with stack(limit=1, max_queue=0) as (_, gw, _app), httpx.AsyncClient() as raw:
        hog = await raw.send(raw.build_request(
            "POST", gw + "/v1/completions",
            json={"model": "cpu-tiny", "prompt": "x", "max_tokens": 2000, "stream": True}),
            stream=True)
        assert hog.status_code == 200
        statuses: list[int] = []

        async def on_response(resp: httpx.Response) -> None:
            statuses.append(resp.status_code)
            if resp.status_code == 429:
                assert resp.headers["retry-after"] == "1"
                await hog.aclose()  # the slot frees now; the client must still wait 1 s

        http = httpx.AsyncClient(event_hooks={"response": [on_response]})
        async with openai.AsyncOpenAI(base_url=gw + "/v1", api_key="k",
                                      http_client=http,  # type: ignore[arg-type]
                                      max_retries=2) as c:
            start = time.monotonic()
            with anyio.fail_after(10):
                done = await c.completions.create(model="cpu-tiny", prompt="hi", max_tokens=2)
            waited = time.monotonic() - start
        assert statuses == [429, 200]
        assert done.usage is not None and done.usage.completion_tokens == 2
        assert waited >= 0.95  # Retry-After: 1, not the client's own 0.5 s back-off


async def test_engine_never_sees_more_than_the_limit() -> None:
    limit = 3
    async with stack(limit=limit, max_queue=limit) as (up, gw, app), \
            httpx.AsyncClient(timeout=30) as client:
        peak = 0
        stop = asyncio.Event()

        async def poll() -> None:
            nonlocal peak
            while not stop.is_set():
                m = await engine_metrics(client, up)
                seen = total(m, "vllm:num_requests_running") + total(m, "vllm:num_requests_waiting")
                peak = max(peak, int(seen))
                await asyncio.sleep(0.01)

        poller = asyncio.create_task(poll())
        req = {"model": "cpu-tiny", "prompt": "p " * 50, "max_tokens": 48, "stream": True}
        with anyio.fail_after(30):
            responses = await asyncio.gather(*[
                client.post(gw + "/v1/completions", json=req) for _ in range(3 * limit)])
        stop.set()
        await poller
        codes = sorted(r.status_code for r in responses)
        assert codes == [200] * (2 * limit) + [429] * limit
        assert 1 <= peak <= limit
        m = scrape((await client.get(gw + "/metrics")).text)
        received = total(m, "kneegate_requests_received_total")
        admitted = total(m, "kneegate_requests_admitted_total")
        assert received == 3 * limit
        assert received == admitted + total(m, "kneegate_requests_shed_total") + total(
            m, "kneegate_requests_queue_timeout_total")
        assert admitted == total(m, "kneegate_requests_finished_total", outcome="completed")
        assert app.gateway.pool.active[0].inflight == 0


async def test_disconnect_mid_stream_aborts_in_the_engine_within_a_second() -> None:
    async with stack(limit=2) as (up, gw, app), httpx.AsyncClient(timeout=10) as client:
        req = {"model": "cpu-tiny", "prompt": "x", "max_tokens": 2000, "stream": True}
        async with client.stream("POST", gw + "/v1/completions", json=req) as r:
            async for _ in r.aiter_raw():
                break
        gone_at = time.monotonic()
        with anyio.fail_after(1):
            while total(await engine_metrics(client, up), "vllm:request_success_total",
                        finished_reason="abort") < 1:
                await asyncio.sleep(0.02)
        assert time.monotonic() - gone_at < 1.0
        with anyio.fail_after(1):
            while app.gateway.pool.active[0].inflight:
                await asyncio.sleep(0.01)
