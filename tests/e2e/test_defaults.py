"""Defaults that work untuned (issue 12, step 3): `knee` unless told otherwise, the engine's
/metrics scraped when it shows vLLM series (detected, no flag), `--ttft-objective`.

The gateway runs behind real sockets in front of the real emulator or a fake engine; the
tests wait on what the gateway reports (its /metrics, its status page), never on sleeps.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import anyio
import httpx
import pytest
from helpers.gateway import FakeEngine, assert_conserved, scrape, serve, total

from kneegate.cli import _parser, apply_flags
from kneegate.controllers.knee import KneeConfig
from kneegate.gateway.app import KneegateApp, build_app
from kneegate.gateway.config.gateway import GatewayConfig, parse_config, split_for_worker
from kneegate.gateway.errors import ConfigError
from kneegate.gateway.server.workers import embedded_upstream
from kneegate.gateway.upstream.pool import UpstreamPool

pytestmark = pytest.mark.anyio

FAST = {"tick_interval": 0.02}  # ticks (and so detection) come quickly in a test


def serve_args(*argv: str) -> Any:
    """`kneegate serve ARGV` parsed exactly as the command line does."""
    return _parser().parse_args(["serve", *argv])


@contextlib.asynccontextmanager
async def gateway(cfg: GatewayConfig) -> AsyncIterator[tuple[KneegateApp, str, httpx.AsyncClient]]:
    app = build_app(cfg)
    async with serve(app) as gw, httpx.AsyncClient(timeout=10) as client:
        yield app, gw, client
        await finish(client, gw)


async def finish(client: httpx.AsyncClient, gw: str) -> None:
    """In-flight back to 0 and the outcome identities hold."""
    m = scrape((await client.get(gw + "/metrics")).text)
    assert total(m, "kneegate_in_flight") == 0
    assert_conserved(m)


async def upstream_status(client: httpx.AsyncClient, gw: str) -> dict[str, Any]:
    status: dict[str, Any] = (await client.get(gw + "/kneegate/status")).json()
    return status["upstreams"][0]  # type: ignore[no-any-return]


async def wait_scrape_state(client: httpx.AsyncClient, gw: str, want: str) -> None:
    with anyio.fail_after(5):
        while (await upstream_status(client, gw))["scrape"] != want:
            await anyio.sleep(0.02)


class MetricsCounting(FakeEngine):
    """FakeEngine that counts /metrics requests and can answer them as another server would:
    `metrics` None keeps FakeEngine's vLLM lines, else (status, body) is the answer."""

    def __init__(self, metrics: tuple[int, bytes] | None = None) -> None:
        super().__init__()
        self.metrics, self.metrics_hits = metrics, 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] == "/metrics":
            self.metrics_hits += 1
            if self.metrics is not None:
                status, body = self.metrics
                await send({"type": "http.response.start", "status": status,
                            "headers": [(b"content-type", b"text/plain")]})
                await send({"type": "http.response.body", "body": body})
                return
        await super().__call__(scope, receive, send)


def no_scrape_due(app: KneegateApp) -> bool:
    """Whether the pool would start nothing for its upstream even far in the future: no
    probe (healthy, confirmed) and no scrape."""
    pool = app.gateway.pool
    up = pool.active[0]
    return up.healthy and up.confirmed and not pool.background(app.gateway.client, 1e12)


# --- the controller ------------------------------------------------------------------------


async def test_serve_upstream_url_runs_knee_over_sockets() -> None:
    async with serve(FakeEngine()) as up:
        cfg = apply_flags(GatewayConfig(**FAST), serve_args("--upstream", up))
        async with gateway(cfg) as (_, gw, client):
            ups = await upstream_status(client, gw)
            assert ups["controller"]["name"] == "knee" and ups["limit"] == 16
            r = await client.post(gw + "/v1/completions", json={"max_tokens": 2})
            assert r.status_code == 200


def test_embedded_engine_runs_knee_and_is_scraped() -> None:
    up = embedded_upstream(4321)(GatewayConfig()).upstreams[0]
    assert up.controller == "knee" and not up.scrape_detect
    assert up.scrape_url == "http://127.0.0.1:4321/metrics"


def test_limit_flag_sets_knees_initial_and_fixed_stays_for_hand_tuning() -> None:
    cfg = apply_flags(GatewayConfig(), serve_args("--upstream", "http://h:1", "--limit", "7"))
    up = cfg.upstreams[0]
    assert up.controller == "knee" and KneeConfig(**up.params).initial == 7
    cfg = apply_flags(GatewayConfig(), serve_args("--upstream", "http://h:1",
                                                  "--controller", "fixed", "--limit", "7"))
    assert cfg.upstreams[0].controller == "fixed" and cfg.upstreams[0].params["initial"] == 7


def test_workers_split_knees_limits() -> None:
    cfg = parse_config({"upstreams": [{"name": "a", "url": "http://h:1"}]})
    parts = [split_for_worker(cfg, i, 3) for i in range(3)]
    knee = [KneeConfig(**p.upstreams[0].params) for p in parts]  # each one valid
    assert [k.initial for k in knee] == [6, 5, 5]  # 16 split
    assert all(p.upstreams[0].controller == "knee" for p in parts)


# --- scrape detection ------------------------------------------------------------------------


def test_scrape_unset_is_detected_true_forces_false_turns_off() -> None:
    def up(**kw: Any) -> Any:
        return parse_config({"upstreams": [{"name": "a", "url": "http://h:1/", **kw}]}).upstreams[0]

    assert up().scrape_url == "http://h:1/metrics" and up().scrape_detect
    assert up(scrape=True).scrape_url == "http://h:1/metrics" and not up(scrape=True).scrape_detect
    forced = up(metrics_url="http://h:2/m")
    assert forced.scrape_url == "http://h:2/m" and not forced.scrape_detect
    assert up(scrape=False).scrape_url is None
    assert up(scrape=False, metrics_url="http://h:2/m").scrape_url is None


async def test_the_emulators_vllm_metrics_are_detected_and_scraped() -> None:
    engine_server = pytest.importorskip("kneegate.emulator.server")
    async with serve(engine_server.build_app("cpu-tiny")) as up:
        cfg = parse_config({**FAST, "upstreams": [
            {"name": "e0", "url": up, "scrape_interval": 0.05}]})
        assert cfg.upstreams[0].scrape is None and cfg.upstreams[0].metrics_url is None
        async with gateway(cfg) as (_, gw, client):
            with anyio.fail_after(5):
                while True:
                    m = scrape((await client.get(gw + "/metrics")).text)
                    if total(m, "kneegate_engine_scrapes_total", outcome="ok") > 0:
                        break
                    await anyio.sleep(0.02)
            assert total(m, "kneegate_engine_stale", upstream="e0") == 0  # fresh figures
            ups = await upstream_status(client, gw)
            assert ups["scrape"] == "on" and ups["engine"]["running"] == 0
            r = await client.post(gw + "/v1/completions",
                                  json={"model": "cpu-tiny", "prompt": "hi", "max_tokens": 2})
            assert r.status_code == 200


@pytest.mark.parametrize("answer", [
    (404, b"not found"),
    (200, b"# TYPE process_cpu_seconds_total counter\nprocess_cpu_seconds_total 1.5\n"),
], ids=["404", "other_server"])
async def test_metrics_without_vllm_series_are_not_scraped(answer: tuple[int, bytes]) -> None:
    engine = MetricsCounting(metrics=answer)
    async with serve(engine) as up:
        cfg = parse_config({**FAST, "upstreams": [
            {"name": "e0", "url": up, "scrape_interval": 0.05}]})
        async with gateway(cfg) as (app, gw, client):
            await wait_scrape_state(client, gw, "not_vllm")
            assert no_scrape_due(app) and engine.metrics_hits == 1  # asked once, then never
            r = await client.post(gw + "/v1/completions", json={"max_tokens": 2})
            assert r.status_code == 200
            m = scrape((await client.get(gw + "/metrics")).text)
            assert total(m, "kneegate_engine_scrapes_total") == 0  # detection is no scrape
            assert ("kneegate_engine_stale", (("upstream", "e0"),)) not in m
            assert (await upstream_status(client, gw))["engine"] is None


async def test_an_upstream_back_after_a_failure_is_asked_again() -> None:
    engine = MetricsCounting(metrics=(404, b""))
    async with serve(engine) as up:
        cfg = parse_config({**FAST, "upstreams": [
            {"name": "e0", "url": up, "scrape_interval": 0.05}]})
        async with gateway(cfg) as (app, gw, client):
            await wait_scrape_state(client, gw, "not_vllm")
            engine.metrics = None  # now it serves vLLM's series (say, vLLM replaced it)
            pool = app.gateway.pool
            pool.mark_failed(pool.active[0], pool.clock())  # the probe brings it back
            with anyio.fail_after(5):
                while total(scrape((await client.get(gw + "/metrics")).text),
                            "kneegate_engine_scrapes_total", outcome="ok") == 0:
                    await anyio.sleep(0.02)
            assert engine.metrics_hits >= 2
            assert (await upstream_status(client, gw))["scrape"] == "on"


async def test_scrape_false_never_scrapes() -> None:
    engine = MetricsCounting()  # vLLM series on /metrics: detection would find them
    async with serve(engine) as up:
        cfg = parse_config({**FAST, "upstreams": [
            {"name": "e0", "url": up, "scrape": False, "scrape_interval": 0.05}]})
        async with gateway(cfg) as (app, gw, client):
            r = await client.post(gw + "/v1/completions", json={"max_tokens": 2})
            assert r.status_code == 200
            assert (await upstream_status(client, gw))["scrape"] == "off"
            assert no_scrape_due(app) and engine.metrics_hits == 0
            m = scrape((await client.get(gw + "/metrics")).text)
            assert total(m, "kneegate_engine_scrapes_total") == 0


# --- the objective -------------------------------------------------------------------------


def test_ttft_objective_flag_lands_in_the_default_class() -> None:
    cfg = apply_flags(GatewayConfig(), serve_args("--upstream", "http://h:1",
                                                  "--ttft-objective", "1.5"))
    assert cfg.classes["default"].ttft_objective == 1.5
    assert GatewayConfig().classes["default"].ttft_objective == 2.0
    two = GatewayConfig(classes={"chat": {}, "batch": {"ttft_objective": 60}},
                        default_class="chat")
    cfg = apply_flags(two, serve_args("--ttft-objective", "0.5"))
    assert cfg.classes["chat"].ttft_objective == 0.5
    assert cfg.classes["batch"].ttft_objective == 60  # other classes keep theirs
    with pytest.raises(ConfigError) as info:
        apply_flags(GatewayConfig(), serve_args("--ttft-objective", "0"))
    assert info.value.field == "classes.default.ttft_objective"


def test_the_controllers_ttft_objective_follows_the_tightest_class_objective() -> None:
    """The users' objective (from arrival) sets the engine's (from dispatch,
    `engine_ttft_objective`): `--ttft-objective 3` had left the engine held to 2 s. A
    controller's own setting wins, and a reload that changes the classes' objectives moves
    the controllers' with them."""
    def objectives(app: KneegateApp) -> list[float]:
        return [u.controller.cfg.ttft_objective for u in app.gateway.pool.active]

    ups = [{"name": "a", "url": "http://h:1"},
           {"name": "b", "url": "http://h:2", "controller": "aimd"},
           {"name": "c", "url": "http://h:3", "params": {"ttft_objective": 0.7}}]
    app = build_app(parse_config({"upstreams": ups}))
    assert objectives(app) == [2.0, 2.0, 0.7]
    flagged = apply_flags(GatewayConfig(), serve_args("--upstream", "http://h:1",
                                                      "--ttft-objective", "3"))
    assert objectives(build_app(flagged)) == [3.0]
    two = {"upstreams": ups, "classes": {"chat": {"ttft_objective": 4},
                                         "batch": {"ttft_objective": 60}},
           "default_class": "chat"}
    app.gateway.apply(parse_config(two))
    assert objectives(app) == [4.0, 4.0, 0.7]
    assert app.gateway.config.upstreams[0].params == {}  # the file's config, as it was read


def test_failed_detections_never_judge_an_upstream_frozen() -> None:
    # timeouts while detecting are counted like scrapes, but only a scraped upstream is
    # judged frozen: one not known to serve vLLM's series is left to the request timeouts
    pool = UpstreamPool(parse_config({"upstreams": [{"name": "a", "url": "http://h:1"}]}).upstreams)
    up = pool.active[0]
    assert up.scrape_state == "detecting"
    up.inflight, up.scrape_failures = 1, 10
    up.busy = True  # a detection in flight: the tick only judges silence
    assert pool.background(None, 1e6) == []  # type: ignore[arg-type]
    assert not up.frozen and up.usable
    up.scraping = True  # the same evidence about a scraped upstream: frozen
    pool.background(None, 2e6)  # type: ignore[arg-type]
    assert up.frozen and not up.usable


def test_a_reload_keeps_the_verdict_unless_the_metrics_url_changes() -> None:
    def ups(url: str, **kw: Any) -> Any:
        return parse_config({"upstreams": [{"name": "a", "url": url, **kw}]}).upstreams

    pool = UpstreamPool(ups("http://h:1"))
    up = pool.active[0]
    up.scraping = False  # detected: no vLLM series
    pool.reload(ups("http://h:1", stall_after=10.0))  # nothing about scraping changed
    assert up.scrape_state == "not_vllm"
    pool.reload(ups("http://h:2"))  # another engine: look again
    assert up.scrape_state == "detecting" and up.progress is None
    pool.reload(ups("http://h:2", scrape=True))
    assert up.scrape_state == "on" and up.progress is not None
