"""The proxy over real sockets: a uvicorn gateway in front of a uvicorn fake engine."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from helpers.gateway import FakeEngine, assert_conserved, gw_config, scrape, serve, total
from helpers.rig import Rig, serve_rig

from kneegate.gateway.app import build_app

pytestmark = pytest.mark.anyio


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    async with serve_rig(FakeEngine(interval=0.002), limit=4) as r:
        yield r


async def test_stream_is_relayed_byte_for_byte(relay: str, rig: Rig) -> None:
    req = {"max_tokens": 6, "stream": True}
    direct = await rig.client.post(rig.up + "/v1/completions", json=req)
    via = await rig.client.post(rig.gw + "/v1/completions", json=req)
    assert via.status_code == 200
    assert via.content == direct.content
    assert via.content.endswith(b"data: [DONE]\n\n")
    assert via.headers["content-type"] == "text/event-stream"
    assert len(via.headers["x-request-id"]) == 32
    m = await rig.metrics()
    assert total(m, "kneegate_output_tokens_total") == 6
    assert total(m, "kneegate_ttft_seconds_count") == 1
    assert total(m, "kneegate_requests_finished_total", outcome="completed") == 1
    assert_conserved(m)
    assert total(m, "kneegate_requests_finished_total", outcome="completed") == 1


async def test_non_streamed_body_and_usage(rig: Rig) -> None:
    r = await rig.client.post(rig.gw + "/v1/completions", json={"max_tokens": 5})
    assert r.json()["usage"]["completion_tokens"] == 5
    m = await rig.metrics()
    assert total(m, "kneegate_output_tokens_total") == 5
    assert total(m, "kneegate_ttft_seconds_count") == 0  # not streamed: no first token


async def test_request_is_forwarded_faithfully(rig: Rig) -> None:
    body = b'{"max_tokens": 1,   "odd spacing": true}'
    r = await rig.client.post(
        rig.gw + "/v1/a%20b/completions?x=1&y=%20", content=body,
        headers={"x-request-id": "abc-123", "x-forwarded-for": "10.1.1.1", "te": "trailers",
                 "connection": "keep-alive", "x-custom": "kept", "content-type": "app/json"})
    assert r.headers["x-request-id"] == "abc-123"
    h = rig.engine.last_headers
    assert rig.engine.last_path == "/v1/a%20b/completions?x=1&y=%20"
    assert rig.engine.last_body == body
    assert h["x-request-id"] == "abc-123"
    assert h["x-forwarded-for"] == "10.1.1.1, 127.0.0.1"
    assert h["x-custom"] == "kept" and h["content-type"] == "app/json"
    assert "te" not in h and h.get("connection", "keep-alive") == "keep-alive"
    assert h["host"] == rig.up.removeprefix("http://")


async def test_upstream_error_passes_through_untouched(rig: Rig) -> None:
    r = await rig.client.post(rig.gw + "/v1/fail", json={})
    assert r.status_code == 500 and r.content == b'{"error": "engine exploded"}'
    r = await rig.client.post(rig.gw + "/v1/overloaded", json={})
    assert r.status_code == 503 and r.content == b'{"error": "busy"}'
    m = await rig.metrics()
    assert total(m, "kneegate_upstream_failures_total", kind="error") == 1
    assert total(m, "kneegate_upstream_failures_total", kind="overloaded") == 1
    assert total(m, "kneegate_requests_finished_total", outcome="upstream_error") == 2


async def test_unknown_paths_are_404_and_never_proxied(rig: Rig) -> None:
    for path in ("/", "/v1", "/admin", "/http://evil.example/v1/x", "/v2/completions"):
        r = await rig.client.get(rig.gw + path)
        assert r.status_code == 404, path
        assert r.json()["error"]["code"] == "not_found"
    assert rig.engine.requests == 0


async def test_body_over_limit_is_413() -> None:
    async with serve_rig(FakeEngine(), max_body_bytes=1000) as rig:
        r = await rig.client.post(rig.gw + "/v1/completions", content=b"x" * 1001)
        assert r.status_code == 413
        assert r.json()["error"]["code"] == "body_too_large"
        r = await rig.client.post(rig.gw + "/v1/completions", content=b'{"max_tokens": 1}')
        assert r.status_code == 200
        assert rig.engine.requests == 1


async def test_own_endpoints(rig: Rig) -> None:
    assert (await rig.client.get(rig.gw + "/health")).json() == {"status": "ok"}
    assert (await rig.client.get(rig.gw + "/ready")).status_code == 200
    status = (await rig.client.get(rig.gw + "/kneegate/status")).json()
    assert status["upstreams"][0]["limit"] == 4 and status["upstreams"][0]["in_flight"] == 0
    r = await rig.client.post(rig.gw + "/kneegate/reload")
    assert r.status_code == 400 and "no config file" in r.json()["message"]


async def test_admin_token_guards_admin_endpoints(tmp_path: Path) -> None:
    async with serve_rig(FakeEngine(), admin_token="s3cret") as rig:
        assert (await rig.client.get(rig.gw + "/kneegate/status")).status_code == 401
        bad = {"authorization": "Bearer nope"}
        assert (await rig.client.post(rig.gw + "/kneegate/reload", headers=bad)).status_code == 401
        good = {"authorization": "Bearer s3cret"}
        assert (await rig.client.get(rig.gw + "/kneegate/status", headers=good)).status_code == 200
        for path in ("/metrics", "/kneegate/history"):  # on the API port: the token too
            assert (await rig.client.get(rig.gw + path)).status_code == 401, path
            assert (await rig.client.get(rig.gw + path, headers=bad)).status_code == 401, path
            assert (await rig.client.get(rig.gw + path, headers=good)).status_code == 200, path
        for path in ("/health", "/kneegate/"):  # the probes, and the page's files (no data)
            assert (await rig.client.get(rig.gw + path)).status_code == 200, path


async def test_fixed_limit_holds_with_three_times_the_clients() -> None:
    limit = 3
    engine = FakeEngine(interval=0.01)
    async with serve_rig(engine, limit=limit, max_queue=limit) as rig:
        async def one() -> httpx.Response:
            return await rig.client.post(
                rig.gw + "/v1/completions", json={"max_tokens": 20, "stream": True})

        tasks = [asyncio.create_task(one()) for _ in range(3 * limit)]
        with anyio.fail_after(5):
            await engine.started.wait()
        assert_conserved(await rig.metrics())  # mid-run: queued and in flight included
        with anyio.fail_after(20):
            responses = await asyncio.gather(*tasks)
        codes = sorted(r.status_code for r in responses)
        assert engine.max_running == limit
        assert codes == [200] * (2 * limit) + [429] * limit
        for r in responses:
            if r.status_code == 429:
                assert int(r.headers["retry-after"]) >= 1
                assert r.headers["x-kneegate-reject-reason"] == "queue_full"
                assert r.json()["error"]["type"] == "rate_limit_error"
            else:
                assert r.content.endswith(b"data: [DONE]\n\n")
        m = await rig.metrics()
        assert_conserved(m)
        assert total(m, "kneegate_requests_received_total") == 3 * limit
        assert total(m, "kneegate_requests_finished_total", outcome="completed") == 2 * limit
        assert total(m, "kneegate_in_flight") == 0


async def test_queue_timeout_is_503() -> None:
    cfg_kw: dict[str, Any] = {"classes": {"default": {"max_wait": 0.2}}, "limit": 1}
    async with serve_rig(FakeEngine(first_delay=30), **cfg_kw) as rig:
        hog = asyncio.create_task(rig.client.post(
            rig.gw + "/v1/completions", json={"max_tokens": 1, "stream": True}))
        with anyio.fail_after(5):
            await rig.engine.started.wait()
        r = await rig.client.post(rig.gw + "/v1/completions", json={"max_tokens": 1})
        assert r.status_code == 503
        assert r.headers["x-kneegate-reject-reason"] == "queue_timeout"
        assert "queue wait exceeded 0.2s for class 'default'" in r.json()["error"]["message"]
        hog.cancel()


async def test_client_disconnect_aborts_upstream_and_frees_the_slot(relay: str, rig: Rig
                                                                  ) -> None:
    rig.engine.interval = 0.05
    req = {"max_tokens": 1000, "stream": True}
    async with rig.client.stream("POST", rig.gw + "/v1/completions", json=req) as r:
        async for _ in r.aiter_raw():
            break  # one chunk, then hang up
    with anyio.fail_after(1):
        await rig.engine.aborted.wait()
    with anyio.fail_after(2):
        while rig.app.gateway.pool.active[0].inflight:
            await asyncio.sleep(0.01)
    m = await rig.metrics()
    assert total(m, "kneegate_requests_finished_total", outcome="client_cancelled") == 1
    assert total(m, "kneegate_in_flight") == 0
    assert_conserved(m)


async def test_first_byte_timeout_is_504_and_aborts_upstream() -> None:
    async with serve_rig(FakeEngine(first_delay=30), timeouts={"first_byte": 0.2}) as rig:
        with anyio.fail_after(3):
            r = await rig.client.post(rig.gw + "/v1/completions", json={"max_tokens": 1})
        assert r.status_code == 504
        assert r.json()["error"]["code"] == "upstream_timeout"
        with anyio.fail_after(1):
            await rig.engine.aborted.wait()
        m = await rig.metrics()
        assert total(m, "kneegate_upstream_failures_total", kind="timeout") == 1


async def test_idle_timeout_cuts_a_stalled_stream(relay: str) -> None:
    async with serve_rig(FakeEngine(interval=30), timeouts={"idle": 0.2}) as rig:
        with anyio.fail_after(3), pytest.raises(httpx.RemoteProtocolError):
            await rig.client.post(rig.gw + "/v1/completions",
                                  json={"max_tokens": 3, "stream": True})
        with anyio.fail_after(1):
            await rig.engine.aborted.wait()
        with anyio.fail_after(2):
            while total(m := await rig.metrics(), "kneegate_in_flight"):
                await asyncio.sleep(0.01)
        assert total(m, "kneegate_requests_finished_total", outcome="upstream_error") == 1
        assert total(m, "kneegate_upstream_failures_total", kind="timeout") == 1
        assert_conserved(m)


async def test_a_client_that_stops_reading_is_its_own_outcome_not_a_timeout(relay: str) -> None:
    # The engine streams fine; the client reads nothing, so the relay waits on its socket.
    # That is the client's doing: client_stalled, no failure against the engine, no sample.
    import socket

    async with serve_rig(FakeEngine(), timeouts={"idle": 0.3}) as rig:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        port = int(rig.gw.rsplit(":", 1)[1])
        sock.connect(("127.0.0.1", port))
        body = json.dumps({"max_tokens": 100_000, "stream": True}).encode()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                     b"application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        try:
            with anyio.fail_after(10):
                while True:
                    m = await rig.metrics()
                    if total(m, "kneegate_requests_finished_total"):
                        break
                    await asyncio.sleep(0.05)
        finally:
            sock.close()
        assert total(m, "kneegate_requests_finished_total", outcome="client_stalled") == 1
        assert total(m, "kneegate_upstream_failures_total") == 0
        assert total(m, "kneegate_in_flight") == 0
        assert_conserved(m)


async def test_unreachable_upstream_is_502_then_no_upstream() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"  # bound, never listening
        app = build_app(gw_config(dead))
        async with serve(app) as gw, httpx.AsyncClient() as client:
            r = await client.post(gw + "/v1/completions", json={})
            assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_unreachable"
            assert (await client.get(gw + "/ready")).status_code == 503
            r = await client.post(gw + "/v1/completions", json={})
            assert r.status_code == 503
            assert r.headers["x-kneegate-reject-reason"] == "no_upstream"
            assert "retry-after" in r.headers


async def test_unusable_upstream_comes_back_after_a_probe() -> None:
    import socket

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # the engine's port, not listening yet
    app = build_app(gw_config(f"http://127.0.0.1:{sock.getsockname()[1]}"))
    async with serve(app) as gw, httpx.AsyncClient() as client:
        assert (await client.post(gw + "/v1/completions", json={})).status_code == 502
        assert (await client.get(gw + "/ready")).status_code == 503
        async with serve(FakeEngine(), sock):  # the engine starts
            with anyio.fail_after(5):
                while (await client.get(gw + "/ready")).status_code != 200:
                    await asyncio.sleep(0.05)
            r = await client.post(gw + "/v1/completions", json={"max_tokens": 1})
            assert r.status_code == 200


async def test_engine_metrics_are_scraped_for_the_controller() -> None:
    engine = FakeEngine()
    async with serve(engine) as up:
        cfg = gw_config(upstreams=[{"name": "e0", "url": up, "metrics_url": up + "/metrics",
                                    "scrape_interval": 0.05}])
        app = build_app(cfg)
        seen: list[Any] = []
        ctl = app.gateway.pool.active[0].controller
        ctl.on_engine_stats = seen.append  # type: ignore[method-assign,assignment]
        async with serve(app) as gw, httpx.AsyncClient() as client:
            with anyio.fail_after(5):
                while not seen:
                    await asyncio.sleep(0.02)
            status = (await client.get(gw + "/kneegate/status")).json()
            engine_status = status["upstreams"][0]["engine"]
            assert {k: engine_status[k] for k in ("running", "waiting", "kv_cache_usage")} == {
                "running": 0.0, "waiting": 0.0, "kv_cache_usage": None}
            assert engine_status["stale"] is False and engine_status["stalled"] is False
            assert seen[0].running == 0


async def test_api_key_and_header_pick_the_class() -> None:
    classes = {"interactive": {"priority": 10}, "batch": {"priority": 0, "header": True}}
    cfg_kw: dict[str, Any] = {"classes": classes, "default_class": "interactive",
              "api_keys": {"sk-batch": "batch"}}
    async with serve_rig(FakeEngine(), **cfg_kw) as rig:
        await rig.client.post(rig.gw + "/v1/completions", json={},
                              headers={"authorization": "Bearer sk-batch"})
        await rig.client.post(rig.gw + "/v1/completions", json={},
                              headers={"x-kneegate-class": "batch"})
        await rig.client.post(rig.gw + "/v1/completions", json={},
                              headers={"x-kneegate-class": "nonsense"})
        m = await rig.metrics()
        assert total(m, "kneegate_requests_received_total", **{"class": "batch"}) == 2
        assert total(m, "kneegate_requests_received_total", **{"class": "interactive"}) == 1


def _write(path: Path, up: str, limit: int, **extra: Any) -> None:
    doc = {"tick_interval": 0.02, "upstreams": [
        {"name": "e0", "url": up, "controller": "fixed", "params": {"initial": limit}}], **extra}
    path.write_text(json.dumps(doc))  # JSON is YAML


async def test_reload_under_load_drops_nothing(tmp_path: Path) -> None:
    engine = FakeEngine(interval=0.01)
    path = tmp_path / "kneegate.yaml"
    async with serve(engine) as up:
        _write(path, up, 2)
        from kneegate.gateway.config.gateway import load_config

        app = build_app(load_config(path), config_path=str(path))
        async with serve(app) as gw, httpx.AsyncClient(timeout=10) as client:
            req = {"max_tokens": 30, "stream": True}
            tasks = [asyncio.create_task(client.post(gw + "/v1/completions", json=req))
                     for _ in range(8)]
            with anyio.fail_after(5):
                await engine.started.wait()
            _write(path, up, 4, classes={"default": {"max_wait": 60}}, timeouts={"idle": 30})
            r = await client.post(gw + "/kneegate/reload")
            assert r.status_code == 200, r.text
            assert app.gateway.pool.active[0].limit == 4
            path.write_text("upstreams: [{name: e0, url: 'not a url'}]\n")
            r = await client.post(gw + "/kneegate/reload")
            assert r.status_code == 400 and "upstreams[e0].url" in r.json()["message"]
            assert app.gateway.pool.active[0].limit == 4  # the old config stays
            with anyio.fail_after(20):
                done = await asyncio.gather(*tasks)
            assert [x.status_code for x in done] == [200] * 8
            assert all(x.content.endswith(b"data: [DONE]\n\n") for x in done)
            assert engine.max_running <= 4
            m = scrape((await client.get(gw + "/metrics")).text)
            assert total(m, "kneegate_config_reloads_total", result="ok") == 1
            assert total(m, "kneegate_config_reloads_total", result="error") == 1
            assert total(m, "kneegate_requests_finished_total", outcome="completed") == 8


async def test_userinfo_in_an_upstream_url_is_basic_auth_never_host_nor_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # credentials in an engine's URL are its basic auth (curl and httpx read them so): sent
    # as Authorization, never in Host, never in a log line or on the status page
    engine = FakeEngine()
    with contextlib.closing(__import__("socket").socket()) as dead:
        dead.bind(("127.0.0.1", 0))  # bound, never listening: connects are refused
        dead_port = dead.getsockname()[1]
        async with serve(engine) as up:
            port = up.rsplit(":", 1)[1]
            cfg = gw_config(upstreams=[
                {"name": "e0", "url": f"http://kn:s3cr%40t@127.0.0.1:{port}",
                 "controller": "fixed", "params": {"initial": 4}},
                {"name": "e1", "url": f"http://kn:s3cr%40t@127.0.0.1:{dead_port}",
                 "controller": "fixed", "params": {"initial": 4}},
            ])
            with caplog.at_level(logging.DEBUG):
                async with serve_rig(engine, cfg) as rig:
                    for _ in range(4):
                        r = await rig.client.post(
                            rig.gw + "/v1/completions", json={"max_tokens": 1},
                            headers={"authorization": "Bearer sk-client"})
                        assert r.status_code == 200
                    seen = engine.last_headers
                    assert seen["host"] == f"127.0.0.1:{port}"
                    assert seen["authorization"] == "Basic a246czNjckB0"  # kn:s3cr@t
                    status = (await rig.client.get(rig.gw + "/kneegate/status")).text
                    m = await rig.metrics()
    assert "s3cr" not in status and "kn:" not in status
    logged = [r.getMessage() for r in caplog.records]
    assert any(f"http://127.0.0.1:{port}/metrics" in line for line in logged)  # its URL, shown
    assert f"127.0.0.1:{dead_port}" in status  # e1, shown without its userinfo
    assert not any("s3cr" in line or "kn:" in line for line in logged), logged
    assert_conserved(m)
    assert total(m, "kneegate_requests_finished_total", outcome="completed") == 4
