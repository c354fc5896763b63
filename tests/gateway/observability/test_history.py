"""The live page's data and files: `/kneegate/history` (a ring of one point a second), the
learned curve in `/kneegate/status`, and the static page at `/kneegate/` (issue 14, part 1).

The page itself is driven in a real browser by the opt-in tier, tests/deploy/test_live_page.py.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import re
from dataclasses import dataclass
from typing import Any

import anyio
import httpx
import pytest
from helpers.gateway import FakeEngine, assert_conserved
from helpers.rig import serve_rig
from prometheus_client import CollectorRegistry

from kneegate.controllers.base import EngineStats
from kneegate.gateway.observability.history import History, quantile
from kneegate.gateway.observability.metrics import GatewayMetrics
from kneegate.gateway.upstream.telemetry import Telemetry

pytestmark = pytest.mark.anyio

TOKEN = {"authorization": "Bearer s3cret"}


@dataclass
class Up:
    """What the history reads of an upstream (gateway.observability.gauges.LiveUpstream)."""

    name: str = "e0"
    inflight: int = 5
    handing: int = 1
    usable: bool = True
    limit: int = 8
    knee_estimate: float | None = 9.5
    engine: Telemetry | None = None

    def telemetry(self, now: float) -> Telemetry | None:
        return self.engine


def _history(ups: list[Up], **kw: Any) -> tuple[History, GatewayMetrics]:
    m = GatewayMetrics(CollectorRegistry())
    return History(lambda: ups, lambda: [("default", 3), ("batch", 0)], m, **kw), m


def test_a_point_holds_the_live_state() -> None:
    stats = EngineStats(at=0.0, running=7, waiting=2, kv_cache_usage=0.4,
                        preemptions_total=0)
    h, _ = _history([Up(engine=Telemetry(stats, 0.5, False, False)), Up(name="e1")])
    p = h.sample(10.0)
    assert p["t"] == 10.0
    assert p["upstreams"]["e0"] == {"limit": 8, "in_flight": 4, "knee": 9.5, "running": 7,
                                    "waiting": 2, "kv": 0.4}
    assert p["upstreams"]["e1"]["running"] is None  # not scraped: no engine figures
    assert p["queue"] == {"default": 3, "batch": 0}
    assert p["rejected"] == {} and p["ttft"] == {}  # the first point has nothing to difference


def test_stale_engine_figures_are_not_drawn() -> None:
    stats = EngineStats(at=0.0, running=7, waiting=2, kv_cache_usage=math.nan,
                        preemptions_total=0)
    h, _ = _history([Up(engine=Telemetry(stats, 9.0, True, False))])
    assert h.sample(1.0)["upstreams"]["e0"]["running"] is None


def test_rejections_are_per_second_by_reason_over_classes() -> None:
    h, m = _history([Up()])
    h.sample(0.0)
    m.shed.labels("default", "queue_full").inc(3)
    m.shed.labels("batch", "queue_full").inc(1)
    m.shed.labels("default", "over_objective").inc(2)
    m.queue_timeout.labels("batch").inc(1)
    assert h.sample(2.0)["rejected"] == {"queue_full": 2.0, "over_objective": 1.0,
                                         "queue_timeout": 0.5}
    assert h.sample(3.0)["rejected"] == {"queue_full": 0.0, "over_objective": 0.0,
                                         "queue_timeout": 0.0}


def test_user_ttft_quantiles_come_from_the_buckets_of_the_last_seconds() -> None:
    h, m = _history([Up()], ttft_span=2.0)  # readings 2 s apart: this one and two before
    h.sample(0.0)
    for v in [0.3] * 99 + [3.0]:  # buckets (0.25, 0.5] and (2, 4]
        m.user_ttft.labels("default").observe(v)
    p = h.sample(1.0)["ttft"]["default"]
    assert p["n"] == 100
    assert p["p50"] == pytest.approx(0.25 + 0.25 * 50 / 99, abs=1e-4)
    assert p["p99"] == pytest.approx(0.5, abs=1e-4)  # the 99th answer is the last at 0.3
    h.sample(2.0)
    assert h.sample(3.0)["ttft"] == {}  # the answers left the span: no quantile, not zero


def test_quantile_reads_like_histogram_quantile() -> None:
    inf = math.inf
    assert quantile(0.5, []) is None
    assert quantile(0.5, [(1.0, 0.0), (inf, 0.0)]) is None
    assert quantile(0.5, [(1.0, 4.0), (2.0, 8.0), (inf, 8.0)]) == 1.0
    assert quantile(0.75, [(1.0, 4.0), (2.0, 8.0), (inf, 8.0)]) == 1.5
    assert quantile(0.99, [(1.0, 1.0), (2.0, 1.0), (inf, 10.0)]) == 2.0  # +Inf: the top bound


def test_the_ring_is_bounded_and_since_filters() -> None:
    h, _ = _history([Up()], size=5)
    for t in range(12):
        h.sample(float(t))
    assert [p["t"] for p in h.points] == [7.0, 8.0, 9.0, 10.0, 11.0]
    view = h.view(11.5, since=9.0)
    assert (view["size"], view["interval"], view["now"]) == (5, 1.0, 11.5)
    assert [p["t"] for p in view["points"]] == [10.0, 11.0]


async def test_history_over_a_served_gateway() -> None:
    limit = 3
    engine = FakeEngine(interval=0.01)
    async with serve_rig(engine, limit=limit, max_queue=limit) as rig:
        gw = rig.app.gateway
        with anyio.fail_after(5):  # the sampler's first point comes as the gateway starts
            while not gw.history.points:
                await asyncio.sleep(0.01)
        first = gw.history.points[0]
        assert first["upstreams"]["e0"]["limit"] == limit

        async def one() -> httpx.Response:
            return await rig.client.post(
                rig.gw + "/v1/completions", json={"max_tokens": 20, "stream": True})

        with anyio.fail_after(20):
            codes = sorted(r.status_code for r in await asyncio.gather(
                *(one() for _ in range(3 * limit))))
        assert codes == [200] * (2 * limit) + [429] * limit
        gw.history.sample(gw.clock())
        r = await rig.client.get(rig.gw + "/kneegate/history")
        assert r.status_code == 200 and r.headers["content-type"] == "application/json"
        body = r.json()
        assert (body["size"], body["interval"]) == (600, 1.0)
        pts = body["points"]
        assert set(pts[-1]) == {"t", "upstreams", "queue", "rejected", "ttft"}
        assert pts[-1]["upstreams"]["e0"]["in_flight"] == 0
        assert pts[-1]["queue"] == {"default": 0}
        # every rejection is in exactly one point's rate: sum(rate x its interval) = count
        shed = sum(p["rejected"].get("queue_full", 0.0) * (p["t"] - q["t"])
                   for q, p in itertools.pairwise(pts))
        assert shed == pytest.approx(limit, abs=0.01)
        assert pts[-1]["ttft"]["default"]["p50"] <= pts[-1]["ttft"]["default"]["p99"]
        since = (await rig.client.get(rig.gw + f"/kneegate/history?since={pts[-2]['t']}")).json()
        assert since["points"] == pts[-1:]
        bad = (await rig.client.get(rig.gw + "/kneegate/history?since=soon")).json()
        assert len(bad["points"]) == len(pts)  # not a number: every point
        assert_conserved(await rig.metrics())


async def test_the_served_ring_stays_at_its_size() -> None:
    async with serve_rig(FakeEngine()) as rig:
        gw = rig.app.gateway
        for _ in range(700):
            gw.history.sample(gw.clock())
        pts = (await rig.client.get(rig.gw + "/kneegate/history")).json()["points"]
        assert len(pts) == len(gw.history.points) == 600


async def test_history_is_guarded_like_status_and_the_page_is_not() -> None:
    async with serve_rig(FakeEngine(), admin_token="s3cret") as rig:
        for path in ("/kneegate/status", "/kneegate/history"):
            r = await rig.client.get(rig.gw + path)
            assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
            r = await rig.client.get(rig.gw + path, headers={"authorization": "Bearer nope"})
            assert r.status_code == 401
            assert (await rig.client.get(rig.gw + path, headers=TOKEN)).status_code == 200
        # the page's files hold no data: they load, then ask for the token
        r = await rig.client.get(rig.gw + "/kneegate/")
        assert r.status_code == 200 and "s3cret" not in r.text


@pytest.mark.parametrize(("path", "ctype", "holds"), [
    ("/kneegate/", "text/html; charset=utf-8", '<script src="live.js">'),
    ("/kneegate/live.js", "text/javascript; charset=utf-8", "Authorization"),
    ("/kneegate/live.css", "text/css; charset=utf-8", "--plateau"),
])
async def test_the_page_is_served_from_the_package(path: str, ctype: str, holds: str) -> None:
    async with serve_rig(FakeEngine()) as rig:
        r = await rig.client.get(rig.gw + path)
        assert r.status_code == 200
        assert r.headers["content-type"] == ctype
        assert holds in r.text
        assert r.headers["content-security-policy"].startswith("default-src 'self'")
        assert r.headers["x-content-type-options"] == "nosniff"
        # nothing fetched from elsewhere, so it works offline (SVG's namespace is a name)
        assert set(re.findall(r"\w+://[^\s\"']*", r.text)) <= {"http://www.w3.org/2000/svg"}


async def test_the_page_without_its_slash_redirects_and_other_paths_stay_404() -> None:
    async with serve_rig(FakeEngine()) as rig:
        r = await rig.client.get(rig.gw + "/kneegate")
        assert r.status_code in (301, 307) and r.headers["location"].endswith("/kneegate/")
        assert (await rig.client.get(rig.gw + "/kneegate/nope.js")).status_code == 404


async def test_status_carries_the_knee_curve_and_its_fit() -> None:
    cfg_upstreams = [{"name": "e0", "url": "http://127.0.0.1:9", "controller": "knee"}]
    async with serve_rig(FakeEngine(), upstreams=cfg_upstreams) as rig:
        ctl = (await rig.client.get(rig.gw + "/kneegate/status")).json()["upstreams"][0][
            "controller"]
        assert ctl["curve"] == []
        assert set(ctl["fit"]) == {"kept", "decline_from", "intercept", "slope", "curve_knee",
                                   "room", "over_objective"}
