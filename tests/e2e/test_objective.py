"""The queue bounded by time, over real sockets (issue 12): a request is answered by its
objective, measured from arrival, and one past it never reaches the engine."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import anyio
import httpx
import pytest
from helpers.gateway import FakeEngine, assert_conserved, gw_config, scrape, serve, total

from kneegate.gateway.app import build_app

pytestmark = pytest.mark.anyio


class Rig:
    def __init__(self, engine: FakeEngine, gw: str, client: httpx.AsyncClient) -> None:
        self.engine, self.gw, self.client = engine, gw, client

    async def post(self, headers: dict[str, str] | None = None, **body: object
                   ) -> httpx.Response:
        return await self.client.post(self.gw + "/v1/completions",
                                      json={"max_tokens": 1, **body}, headers=headers)

    async def hog(self) -> asyncio.Task[httpx.Response]:
        """Take the only slot with a request the engine holds until cancelled."""
        self.engine.started.clear()
        task = asyncio.create_task(self.post(max_tokens=1, stream=True))
        with anyio.fail_after(5):
            await self.engine.started.wait()
        return task


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    engine = FakeEngine()
    async with serve(engine) as up:
        # the whole objective as the queue's budget: before any answer ends, a request
        # behind the hog is predicted to wait as long as the hog has run (a few ms here,
        # but it may be tens on a busy machine), and must be queued, not refused at once
        app = build_app(gw_config(up, limit=1, classes={
            "default": {"ttft_objective": 0.4, "queue_budget": 1.0}}))
        async with serve(app) as gw, httpx.AsyncClient(timeout=10) as client:
            yield Rig(engine, gw, client)
            m = scrape((await client.get(gw + "/metrics")).text)
            assert total(m, "kneegate_in_flight") == 0
            assert_conserved(m)


async def test_a_request_queued_past_its_objective_never_reaches_the_engine(rig: Rig) -> None:
    rig.engine.first_delay = 30
    hog = await rig.hog()
    t0 = time.monotonic()
    r = await rig.post()  # queued behind the hog: no slot within the class's 0.4 s
    waited = time.monotonic() - t0
    assert r.status_code == 503
    assert r.headers["x-kneegate-reject-reason"] == "queue_timeout"
    assert "objective" in r.json()["error"]["message"]
    assert 0.35 <= waited < 2.0  # answered at its objective (tick granularity), not later
    hog.cancel()
    with anyio.fail_after(5):
        await rig.engine.aborted.wait()
    rig.engine.first_delay = 0
    assert (await rig.post()).status_code == 200
    assert rig.engine.requests == 2  # the hog and the last one: never the expired one


async def test_the_header_tightens_the_objective(rig: Rig) -> None:
    rig.engine.first_delay = 30
    hog = await rig.hog()
    t0 = time.monotonic()
    r = await rig.post(headers={"x-kneegate-ttft-ms": "100"})
    assert r.status_code == 503 and time.monotonic() - t0 < 0.35  # 0.1 s, not the class's 0.4
    r = await rig.post(headers={"x-kneegate-ttft-ms": "60000"})  # cannot loosen it
    assert r.status_code == 503
    hog.cancel()
    assert rig.engine.requests == 1


async def test_a_request_that_cannot_make_it_is_told_at_once(rig: Rig) -> None:
    # completions to measure a rate from: 20 ms each, so a slot turns over in ~20 ms (the
    # rate skips idle time: answered in 0.2 ms, one slot read ~4,000/s, and a 1 ms objective
    # less 0.25 ms of predicted wait was still within its budget)
    rig.engine.first_delay = 0.02
    for _ in range(6):
        assert (await rig.post()).status_code == 200
    rig.engine.first_delay = 30
    hog = await rig.hog()
    t0 = time.monotonic()
    r = await rig.post(headers={"x-kneegate-ttft-ms": "1"})  # no slot could come in 1 ms
    assert time.monotonic() - t0 < 0.3  # told at once, not after waiting
    assert r.status_code == 429, (r.headers, r.text)
    assert r.headers["x-kneegate-reject-reason"] == "over_objective"
    assert int(r.headers["retry-after"]) >= 1
    hog.cancel()
    assert rig.engine.requests == 7


@pytest.mark.parametrize("value", ["soon", "-5", "0", "nan", "inf", ""])
async def test_a_malformed_objective_header_is_a_400_naming_it(rig: Rig, value: str) -> None:
    r = await rig.post(headers={"x-kneegate-ttft-ms": value})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "invalid_header" and err["param"] == "x-kneegate-ttft-ms"
    assert rig.engine.requests == 0


# --- an engine's own valve (vLLM >= 0.32's --max-num-queued-reqs) -------------------------


def _two(full: str, free: str) -> dict[str, object]:
    return {"upstreams": [
        {"name": "full", "url": full, "controller": "fixed", "params": {"initial": 4}},
        {"name": "free", "url": free, "controller": "fixed", "params": {"initial": 4}},
    ]}


async def test_a_request_the_engines_valve_refuses_goes_to_another_upstream() -> None:
    from kneegate.emulator.server import build_app as emulator

    req = {"model": "cpu-tiny", "prompt": "hi", "max_tokens": 2}
    async with serve(emulator(max_num_queued_reqs=0)) as full, serve(emulator()) as free:
        app = build_app(gw_config(**_two(full, free)))
        async with serve(app) as gw, httpx.AsyncClient(timeout=10) as client:
            r = await client.post(gw + "/v1/completions", json=req)
            assert r.status_code == 200, r.text
            m = scrape((await client.get(gw + "/metrics")).text)
            engine = scrape((await client.get(full + "/metrics")).text)
    assert total(engine, "vllm:admission_rejections_total") == 1  # it did refuse it
    assert total(m, "kneegate_upstream_reroutes_total", upstream="full") == 1
    assert total(m, "kneegate_requests_finished_total", upstream="free", outcome="completed") == 1
    assert total(m, "kneegate_in_flight") == 0
    assert_conserved(m)


async def test_with_nowhere_else_a_refused_request_waits_at_the_head_of_its_queue() -> None:
    """An engine that takes one request at a time refuses the others; kneegate, its limit
    set too high by hand, puts them back in its queue (the refusing engine has no room
    until one of its requests ends) and every user is served."""
    from kneegate.emulator.server import build_app as emulator

    req = {"model": "cpu-tiny", "prompt": "hi", "max_tokens": 4}
    async with serve(emulator(max_num_queued_reqs=1)) as one:
        app = build_app(gw_config(one, limit=3))
        async with serve(app) as gw, httpx.AsyncClient(timeout=10) as client:
            answers = await asyncio.gather(
                *[client.post(gw + "/v1/completions", json=req) for _ in range(3)])
            m = scrape((await client.get(gw + "/metrics")).text)
            engine = scrape((await client.get(one + "/metrics")).text)
    assert [r.status_code for r in answers] == [200] * 3
    refused = total(engine, "vllm:admission_rejections_total")
    assert refused >= 2  # the two that found it busy, at least once each
    assert total(m, "kneegate_requests_requeued_total") == refused
    assert total(m, "kneegate_requests_finished_total", outcome="engine_refused") == refused
    assert total(m, "kneegate_requests_finished_total", outcome="completed") == 3
    assert total(m, "kneegate_upstream_failures_total") == 0
    assert total(m, "kneegate_in_flight") == 0
    assert_conserved(m)


async def test_a_refusal_stands_once_the_objective_has_passed() -> None:
    """Refused past its objective, the engine's own 503 is relayed unchanged; refused
    before it, the request waits at the head of the queue, is retried (an idle refusing
    engine once a tick) and, still refused at its objective, told 503 with Retry-After."""
    from kneegate.emulator.server import build_app as emulator

    req = {"model": "cpu-tiny", "prompt": "hi", "max_tokens": 2}
    async with serve(emulator(max_num_queued_reqs=0)) as full:  # refuses everything
        app = build_app(gw_config(full, classes={"default": {"ttft_objective": 0.3}}))
        async with serve(app) as gw, httpx.AsyncClient(timeout=10) as client:
            direct = await client.post(full + "/v1/completions", json=req)
            at_once = await client.post(gw + "/v1/completions", json=req,  # due at once
                                        headers={"x-kneegate-ttft-ms": "0.000001"})
            t0 = time.monotonic()
            retried = await client.post(gw + "/v1/completions", json=req)
            waited = time.monotonic() - t0
            m = scrape((await client.get(gw + "/metrics")).text)
            engine = scrape((await client.get(full + "/metrics")).text)
    assert direct.status_code == at_once.status_code == 503
    assert at_once.content == direct.content
    assert retried.status_code == 503
    assert retried.headers["x-kneegate-reject-reason"] == "queue_timeout"
    assert int(retried.headers["retry-after"]) >= 1
    assert 0.25 <= waited < 1.0  # retried while its 0.3 s objective allowed, then told
    tries = total(engine, "vllm:admission_rejections_total") - 2  # less direct and at_once
    assert tries >= 2  # a retry at least
    assert total(m, "kneegate_requests_requeued_total") == tries
    assert total(m, "kneegate_requests_queue_timeout_total") == 1
    assert total(m, "kneegate_upstream_failures_total", kind="overloaded") == 1  # at_once
    assert total(m, "kneegate_in_flight") == 0
    assert_conserved(m)
