"""Only generation is evidence, over real sockets: `GET /v1/models` and other requests that
are not generation pass at once, with no slot, and no controller or demand hears of them; a
body that is not JSON, or a prompt surely longer than the engine's context (read from its
`/v1/models`), is answered 400 before admission; a Content-Length's leading zeros are no
trouble."""

from __future__ import annotations

import asyncio
import json

import anyio
import httpx
import pytest
from helpers.gateway import FakeEngine, assert_conserved, gw_config, scrape, serve, total, until

from kneegate.gateway.app import build_app

pytestmark = pytest.mark.anyio

JSON = {"content-type": "application/json"}


async def test_requests_that_are_not_generation_pass_a_full_limit_and_tell_nobody() -> None:
    engine = FakeEngine(interval=0.5)  # every answer takes ~2 s: 4 events (or 4 x 0.5 s)
    async with serve(engine) as up:
        app = build_app(gw_config(up, limit=2))
        ctl = app.gateway.pool.active[0].controller
        heard: list[str] = []
        ctl.on_arrival = lambda tokens: heard.append("arrival")  # type: ignore[method-assign]
        ctl.on_admit = lambda tokens: heard.append("admit")  # type: ignore[method-assign]
        ctl.on_sample = lambda sample: heard.append("sample")  # type: ignore[method-assign]
        body = json.dumps({"prompt": "p" * 40, "max_tokens": 8, "stream": True}).encode()
        async with serve(app) as gw, httpx.AsyncClient(timeout=10) as client:
            held = [asyncio.create_task(client.post(gw + "/v1/completions", content=body,
                                                    headers=JSON)) for _ in range(2)]
            await until(lambda: engine.running == 2)
            assert heard == ["arrival", "admit"] * 2
            demand = app.gateway.queue.pools[0].queue.demand
            arrivals = demand._arrivals
            # both slots are held: these reach the engine beside them, none queued
            with anyio.fail_after(1):  # the engine answers it at once
                assert (await client.get(gw + "/v1/models")).status_code == 200
            passing = [asyncio.create_task(client.get(gw + p)) for p in ("/version", "/v1/files")]
            passing.append(asyncio.create_task(
                client.post(gw + "/tokenize", content=b"{}", headers=JSON)))
            await until(lambda: engine.running == 5)
            assert app.gateway.queue.depth() == 0
            m = scrape((await client.get(gw + "/metrics")).text)
            assert total(m, "kneegate_in_flight") == 5
            assert_conserved(m)
            assert [r.status_code for r in await asyncio.gather(*passing)] == [200] * 3
            assert heard == ["arrival", "admit"] * 2 and demand._arrivals == arrivals
            assert [r.status_code for r in await asyncio.gather(*held)] == [200, 200]
            m = scrape((await client.get(gw + "/metrics")).text)
        assert heard[4:] == ["sample", "sample"]
        assert total(m, "kneegate_requests_admitted_total") == 6  # counted like any request
        assert_conserved(m)
        state = app.gateway.pool.active[0]
        assert (state.inflight, state.passing) == (0, 0)


async def test_a_prompt_surely_over_the_context_is_refused_before_admission() -> None:
    engine = FakeEngine(max_model_len=100)
    async with serve(engine) as up:
        app = build_app(gw_config(up, limit=2))
        async with serve(app) as gw, httpx.AsyncClient(timeout=10) as client:
            await until(lambda: app.gateway.pool.context("fake") == 100)
            long = {"model": "fake", "prompt": list(range(95)), "max_tokens": 10}
            r = await client.post(gw + "/v1/completions", json=long)
            assert r.status_code == 400
            err = r.json()["error"]
            assert (err["code"], err["param"]) == ("context_length_exceeded", "prompt")
            assert "maximum context length is 100 tokens" in err["message"]
            fits = {**long, "max_tokens": 5}
            assert (await client.post(gw + "/v1/completions", json=fits)).status_code == 200
            m = scrape((await client.get(gw + "/metrics")).text)
        assert engine.requests == 1  # the refused one never reached it
        assert total(m, "kneegate_client_rejections_total", reason="context_length") == 1
        assert total(m, "kneegate_requests_received_total") == 1
        assert_conserved(m)


async def test_a_generation_body_that_is_not_json_is_400_and_never_queued() -> None:
    engine = FakeEngine()
    async with serve(engine) as up:
        app = build_app(gw_config(up))
        async with serve(app) as gw, httpx.AsyncClient(timeout=10) as client:
            r = await client.post(gw + "/v1/chat/completions", content=b"{not json",
                                  headers=JSON)
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_body"
            m = scrape((await client.get(gw + "/metrics")).text)
        assert engine.requests == 0
        assert total(m, "kneegate_client_rejections_total", reason="invalid_body") == 1


async def test_a_content_length_with_thousands_of_leading_zeros_is_its_value() -> None:
    engine = FakeEngine()
    async with serve(engine) as up:
        app = build_app(gw_config(up))
        async with serve(app) as gw:
            host, port = gw.removeprefix("http://").split(":")
            body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
            head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                    f"application/json\r\nContent-Length: {'0' * 5000}{len(body)}\r\n\r\n")
            with anyio.fail_after(5):
                reader, writer = await asyncio.open_connection(host, int(port))
                writer.write(head.encode() + body)
                await writer.drain()
                status = await reader.readline()
                writer.close()
        assert status.split()[1] in (b"200", b"400", b"431"), status  # never a 500


@pytest.mark.parametrize(("headers", "param"), [
    ([("authorization", "Bearer sk-trial-0001"), ("authorization", "Bearer x")],
     "authorization"),
    ([("x-request-id", "r" * 8192)], "x-request-id"),
    ([("x-kneegate-ttft-ms", "1e999")], "x-kneegate-ttft-ms"),
])
async def test_ambiguous_or_unbounded_headers_are_400_before_admission(
        headers: list[tuple[str, str]], param: str) -> None:
    engine = FakeEngine()
    async with serve(engine) as up:
        app = build_app(gw_config(up))
        async with serve(app) as gw, httpx.AsyncClient(timeout=10) as client:
            r = await client.post(gw + "/v1/completions", json={"prompt": "hi"},
                                  headers=[*headers, ("content-type", "application/json")])
            assert r.status_code == 400
            err = r.json()["error"]
            assert (err["code"], err["param"]) == ("invalid_header", param)
            assert len(r.headers.get("x-request-id", "")) <= 200
            m = scrape((await client.get(gw + "/metrics")).text)
        assert engine.requests == 0
        assert total(m, "kneegate_client_rejections_total", reason="invalid_header") == 1
        assert total(m, "kneegate_requests_received_total") == 0
