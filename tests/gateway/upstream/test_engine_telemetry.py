"""Engine telemetry in the gateway: scrape config, staleness, progress-based health, metrics.

Unit tests drive the pool and the scrape-time collector with a fake clock and a fresh
registry; the end-to-end ones scrape a tiny engine over real sockets and wait on what the
gateway reports, never on sleeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator
from typing import Any

import anyio
import httpx
import pytest
from helpers.gateway import answer_lifespan, gw_config, scrape, serve, total
from prometheus_client import CollectorRegistry

from kneegate.controllers.base import EngineStats
from kneegate.controllers.knee import Knee
from kneegate.gateway.app import KneegateApp, build_app
from kneegate.gateway.config.gateway import parse_config
from kneegate.gateway.errors import ConfigError
from kneegate.gateway.observability.metrics import GatewayMetrics
from kneegate.gateway.runtime import Gateway
from kneegate.gateway.upstream.pool import UpstreamPool
from kneegate.gateway.upstream.state import Upstream


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def upstream_cfg(**kw: Any) -> dict[str, Any]:
    return {"name": "e0", "url": "http://127.0.0.1:9", **kw}


def stats(at: float, running: float = 2, tokens: float = 10) -> EngineStats:
    return EngineStats(at=at, running=running, waiting=1, kv_cache_usage=0.25,
                       preemptions_total=0, generation_tokens_total=tokens)


# --- config ----------------------------------------------------------------------------


def test_scrape_true_derives_metrics_url_from_the_upstream_url() -> None:
    u = parse_config({"upstreams": [upstream_cfg(url="http://h:8000/", scrape=True)]}).upstreams[0]
    assert u.metrics_url == "http://h:8000/metrics" and u.scrape_url == "http://h:8000/metrics"
    assert u.scrape_interval == 1.0 and u.stale_bound == 3.0


def test_explicit_metrics_url_is_kept_and_scraped() -> None:
    data = upstream_cfg(metrics_url="http://h:9100/m", scrape_interval=2)
    u = parse_config({"upstreams": [data]}).upstreams[0]
    assert u.scrape_url == "http://h:9100/m" and u.stale_bound == 6.0
    u = parse_config({"upstreams": [{**data, "scrape": True}]}).upstreams[0]
    assert u.scrape_url == "http://h:9100/m"


def test_scrape_false_turns_scraping_off() -> None:
    # unset is detected (tests/e2e/test_defaults.py); false wins even over metrics_url
    assert parse_config({"upstreams": [upstream_cfg(scrape=False)]}).upstreams[0].scrape_url is None
    off = upstream_cfg(scrape=False, metrics_url="http://h:1/metrics")
    assert parse_config({"upstreams": [off]}).upstreams[0].scrape_url is None


def test_stale_bound_must_outlast_the_scrape_interval() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"upstreams": [upstream_cfg(scrape=True, stale_after=1.0)]})
    assert info.value.field == "upstreams[e0].stale_after"
    assert "scrape_interval" in info.value.reason


# --- pool and collector, fake clock, fresh registry ---------------------------------------


def rig(**kw: Any) -> tuple[UpstreamPool, Upstream, CollectorRegistry, FakeClock]:
    clock = FakeClock()
    cfg = parse_config({"upstreams": [upstream_cfg(scrape=True, **kw)]})
    registry = CollectorRegistry()
    metrics = GatewayMetrics(registry)
    pool = UpstreamPool(cfg.upstreams, clock=clock, count_scrape=metrics.count_scrape)
    metrics.bind_live(pool.all, lambda: [], clock)
    return pool, pool.active[0], registry, clock


def gauge(registry: CollectorRegistry, name: str) -> float | None:
    return registry.get_sample_value(name, {"upstream": "e0"})


def test_fresh_figures_are_exported_and_stale_ones_are_not() -> None:
    pool, up, registry, clock = rig(stale_after=3.0)
    assert gauge(registry, "kneegate_engine_stale") == 1.0  # nothing scraped yet
    assert gauge(registry, "kneegate_engine_running") is None
    pool.note_engine(up, stats(at=clock.now, running=5), clock.now)
    clock.now += 1.0
    assert gauge(registry, "kneegate_engine_running") == 5.0
    assert gauge(registry, "kneegate_engine_waiting") == 1.0
    assert gauge(registry, "kneegate_engine_kv_cache_usage") == 0.25
    assert gauge(registry, "kneegate_engine_stats_age_seconds") == 1.0
    assert gauge(registry, "kneegate_engine_stale") == 0.0
    clock.now += 2.5  # 3.5 s old: past stale_after
    assert gauge(registry, "kneegate_engine_stale") == 1.0
    assert gauge(registry, "kneegate_engine_running") is None
    assert gauge(registry, "kneegate_engine_stats_age_seconds") == 3.5


def test_upstreams_not_scraped_export_no_engine_series() -> None:
    registry = CollectorRegistry()
    metrics = GatewayMetrics(registry)
    pool = UpstreamPool(parse_config({"upstreams": [upstream_cfg()]}).upstreams)
    metrics.bind_live(pool.all, lambda: [])
    assert gauge(registry, "kneegate_engine_stale") is None
    assert gauge(registry, "kneegate_limit") == 16.0


def test_no_new_tokens_while_running_stalls_the_upstream_until_tokens_move() -> None:
    pool, up, registry, clock = rig(stall_after=10.0)
    for dt in (0.0, 5.0, 9.0):
        pool.note_engine(up, stats(at=100 + dt, running=2, tokens=50), 100 + dt)
    assert up.usable and not up.stalled
    pool.note_engine(up, stats(at=110, running=2, tokens=50), 110)
    assert up.stalled and not up.usable and up.healthy
    clock.now = 110
    assert gauge(registry, "kneegate_upstream_stalled") == 1.0
    assert gauge(registry, "kneegate_upstream_usable") == 0.0
    pool.note_engine(up, stats(at=111, running=2, tokens=51), 111)
    assert up.usable and not up.stalled
    assert gauge(registry, "kneegate_upstream_stalled") == 0.0


def test_an_idle_engine_with_a_frozen_counter_stays_usable() -> None:
    pool, up, _, _ = rig(stall_after=1.0)
    for t in (100.0, 105.0, 110.0):
        pool.note_engine(up, stats(at=t, running=0, tokens=7), t)
    assert up.usable


def test_stalled_and_unhealthy_must_both_clear() -> None:
    pool, up, _, _ = rig(stall_after=1.0)
    pool.note_engine(up, stats(at=100, running=1, tokens=1), 100)
    pool.note_engine(up, stats(at=102, running=1, tokens=1), 102)
    pool.mark_failed(up, 102)
    pool.note_engine(up, stats(at=103, running=0, tokens=1), 103)  # progress, but /health failed
    assert not up.usable and not up.stalled


def test_reload_that_turns_scraping_off_forgets_the_figures_and_the_stall() -> None:
    pool, up, _, _ = rig(stall_after=1.0)
    pool.note_engine(up, stats(at=100, running=1, tokens=1), 100)
    pool.note_engine(up, stats(at=102, running=1, tokens=1), 102)
    assert not up.usable
    pool.reload(parse_config({"upstreams": [upstream_cfg(scrape=False)]}).upstreams)
    assert up.usable and up.telemetry(0.0) is None
    assert up.scrape_state == "off"


# --- knee estimate and controller state on /metrics and the status page -------------------


def test_status_and_metrics_show_the_controllers_state_and_knee() -> None:
    cfg = gw_config(upstreams=[{"name": "e0", "url": "http://127.0.0.1:9", "controller": "knee",
                                "params": {"initial": 8}}])
    registry = CollectorRegistry()
    gw = Gateway(cfg, registry=registry, clock=FakeClock())
    unknown = registry.get_sample_value("kneegate_knee_estimate", {"upstream": "e0"})
    assert unknown is not None and math.isnan(unknown)
    ctl = gw.pool.active[0].controller
    assert isinstance(ctl, Knee)
    ctl.knee_estimate = 12.5
    assert registry.get_sample_value("kneegate_knee_estimate", {"upstream": "e0"}) == 12.5
    assert registry.get_sample_value("kneegate_limit", {"upstream": "e0"}) == 8.0
    state = gw.status()["upstreams"][0]["controller"]
    assert state["name"] == "knee" and state["limit"] == 8 and state["knee_estimate"] == 12.5
    assert state["curve"] == [] and state["curve_of"] == "gateway"


# --- over real sockets ----------------------------------------------------------------


class MetricsEngine:
    """Serves /health and a vLLM-like /metrics whose figures the test sets."""

    def __init__(self) -> None:
        self.running, self.tokens, self.status = 0, 0, 200
        self.hang = asyncio.Event()  # set: /metrics answers; clear: it hangs until set
        self.hang.set()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await answer_lifespan(receive, send)
            return
        status, body = 200, b"{}"
        if scope["path"] == "/metrics":
            await self.hang.wait()
            status, body = self.status, (
                f"vllm:num_requests_running{{engine=\"0\"}} {self.running}\n"
                f"vllm:num_requests_waiting{{engine=\"0\"}} 0\n"
                f"vllm:kv_cache_usage_perc{{engine=\"0\"}} 0.5\n"
                f"# TYPE vllm:generation_tokens_total counter\n"
                f"vllm:generation_tokens_total{{engine=\"0\"}} {self.tokens}\n").encode()
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": body})


@contextlib.asynccontextmanager
async def scraped(engine: MetricsEngine, **kw: Any) -> AsyncIterator[
        tuple[str, KneegateApp, httpx.AsyncClient]]:
    async with serve(engine) as up:
        cfg = gw_config(upstreams=[{"name": "e0", "url": up, "scrape": True,
                                    "scrape_interval": 0.05, **kw}])
        app = build_app(cfg)
        try:
            async with serve(app) as gw, httpx.AsyncClient(timeout=5) as client:
                yield gw, app, client
        finally:
            engine.hang.set()  # let a hung scrape finish so the engine's server can stop


async def wait_metrics(client: httpx.AsyncClient, gw: str, name: str, want: float,
                       **labels: str) -> dict[Any, float]:
    with anyio.fail_after(10):
        while True:
            m = scrape((await client.get(gw + "/metrics")).text)
            if any(n == name and dict(ls) == labels and v == want for (n, ls), v in m.items()):
                return m
            await asyncio.sleep(0.02)


@pytest.mark.anyio
async def test_scraper_reads_url_metrics_feeds_the_controller_and_counts_outcomes() -> None:
    engine = MetricsEngine()
    engine.running = 3
    async with scraped(engine) as (gw, app, client):
        fed: list[EngineStats] = []
        ctl = app.gateway.pool.active[0].controller
        ctl.on_engine_stats = fed.append  # type: ignore[method-assign,assignment]
        m = await wait_metrics(client, gw, "kneegate_engine_running", 3.0, upstream="e0")
        with anyio.fail_after(5):
            while not fed:
                await asyncio.sleep(0.02)
        assert fed[0].running == 3 and fed[0].generation_tokens_total == 0
        assert total(m, "kneegate_engine_scrapes_total", outcome="ok") >= 1
        assert total(m, "kneegate_engine_kv_cache_usage", upstream="e0") == 0.5
        status = (await client.get(gw + "/kneegate/status")).json()["upstreams"][0]
        assert status["engine"]["running"] == 3 and status["engine"]["stale"] is False
        engine.status = 500
        m = await wait_metrics(client, gw, "kneegate_engine_stale", 1.0, upstream="e0")
        assert total(m, "kneegate_engine_scrapes_total", outcome="http_error") >= 1
        assert total(m, "kneegate_engine_running", upstream="e0") == 0  # absent when stale


@pytest.mark.anyio
async def test_a_hanging_metrics_endpoint_times_out_at_the_stale_bound() -> None:
    engine = MetricsEngine()
    engine.hang.clear()
    async with scraped(engine, stale_after=0.2) as (gw, _, client):
        await wait_metrics(client, gw, "kneegate_engine_scrapes_total", 1.0,
                           upstream="e0", outcome="timeout")


@pytest.mark.anyio
async def test_stalled_engine_is_unusable_over_sockets_and_comes_back() -> None:
    engine = MetricsEngine()
    engine.running, engine.tokens = 2, 100
    async with scraped(engine, stall_after=0.3) as (gw, _, client):
        with anyio.fail_after(10):
            while (await client.get(gw + "/ready")).status_code != 503:
                await asyncio.sleep(0.02)
        r = await client.post(gw + "/v1/completions", json={"max_tokens": 1})
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_upstream"
        status = (await client.get(gw + "/kneegate/status")).json()["upstreams"][0]
        assert status["engine"]["stalled"] is True and status["healthy"] is True
        engine.tokens = 101
        with anyio.fail_after(3):
            while (await client.get(gw + "/ready")).status_code != 200:
                await asyncio.sleep(0.02)
