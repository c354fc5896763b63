"""The gateway tells controllers each request's prompt-size estimate: at arrival and admission.

`on_arrival` goes to every usable upstream's controller as a generation request arrives (a
shed one too); `on_admit` to the controller of the upstream it is dispatched
to. Both get the prompt's tokens read from its content (gateway/request_size.py: a text
prompt is ceil(bytes / 4)), whatever else the body holds.
"""

from __future__ import annotations

import asyncio
import json

import anyio
import httpx
import pytest
from helpers.gateway import FakeEngine, gw_config, serve

from kneegate.gateway.app import build_app

pytestmark = pytest.mark.anyio

SMALL = json.dumps({"prompt": "x" * 40, "max_tokens": 3}).encode()
LARGE = json.dumps({"prompt": "x" * 4000, "max_tokens": 3}).encode()
PADDED = SMALL[:-1] + b" " * 40_000 + b', "user": "' + b"u" * 4000 + b'"}'  # SMALL's prompt
JSON = {"content-type": "application/json"}


def _upstream(name: str, url: str) -> dict[str, object]:
    return {"name": name, "url": url, "controller": "fixed", "params": {"initial": 1}}


async def test_controller_sees_on_admit_with_the_prompt_size_padding_aside() -> None:
    engine = FakeEngine(interval=0.002)
    async with serve(engine) as up:
        app = build_app(gw_config(up, limit=4))
        seen: list[int] = []
        ctl = app.gateway.pool.active[0].controller
        ctl.on_admit = seen.append  # type: ignore[method-assign]
        async with serve(app) as gw, httpx.AsyncClient(timeout=10) as client:
            for body in (SMALL, LARGE, PADDED):
                r = await client.post(gw + "/v1/completions", content=body, headers=JSON)
                assert r.status_code == 200
        # one call per admitted request, before its answer; whitespace and unknown fields
        # count nothing
        assert seen == [10, 1000, 10]


async def test_every_usable_upstream_hears_each_arrival_shed_ones_included() -> None:
    engine = FakeEngine(interval=0.2)  # 5 events: each request holds its slot ~1 s
    async with serve(engine) as up:
        cfg = gw_config(upstreams=[_upstream("e0", up), _upstream("e1", up)], max_queue=0)
        app = build_app(cfg)
        arrivals: dict[str, list[int]] = {"e0": [], "e1": []}
        admits: list[int] = []
        for u in app.gateway.pool.active:
            u.controller.on_arrival = arrivals[u.name].append  # type: ignore[method-assign]
            u.controller.on_admit = admits.append  # type: ignore[method-assign]
        body = json.dumps({"prompt": "y" * 400, "max_tokens": 5, "stream": True}).encode()
        async with serve(app) as gw, httpx.AsyncClient(timeout=10) as client:
            # two fill both slots (limit 1 each); a third, with no queue, is shed
            first = [asyncio.create_task(client.post(gw + "/v1/completions", content=body,
                                                     headers=JSON)) for _ in range(2)]
            with anyio.fail_after(5):
                while engine.running < 2:
                    await engine.started.wait()
                    engine.started.clear()
            shed = await client.post(gw + "/v1/completions", content=SMALL, headers=JSON)
            assert shed.status_code == 429
            assert [r.status_code for r in await asyncio.gather(*first)] == [200, 200]
    for name in ("e0", "e1"):
        assert sorted(arrivals[name]) == [10, 100, 100], name
    assert admits == [100, 100]  # the shed request was never admitted


async def test_a_request_over_the_token_budget_waits_for_room() -> None:
    engine = FakeEngine(interval=0.1)  # an event per token: the first large one holds ~2 s
    async with serve(engine) as up:
        app = build_app(gw_config(up, limit=4))
        state = app.gateway.pool.active[0]
        large = json.dumps({"prompt": "z" * 4000, "max_tokens": 20, "stream": True}).encode()
        later = json.dumps({"prompt": "z" * 4000, "max_tokens": 2, "stream": True}).encode()
        budget = 1000 + 10  # one large and one small at a time
        asked: list[tuple[int, int, int]] = []

        def fits(inflight: int, inflight_tokens: int, tokens: int) -> bool:
            asked.append((inflight, inflight_tokens, tokens))
            return inflight_tokens + tokens <= budget

        state.controller.fits = fits  # type: ignore[method-assign]
        async with serve(app) as gw, httpx.AsyncClient(timeout=10) as client:
            def post(body: bytes) -> asyncio.Task[httpx.Response]:
                return asyncio.create_task(
                    client.post(gw + "/v1/completions", content=body, headers=JSON))

            first = post(large)
            with anyio.fail_after(5):
                await engine.started.wait()
            engine.started.clear()
            small = await post(SMALL)  # fits beside the large one: served at once
            assert small.status_code == 200
            second = post(later)
            with anyio.fail_after(5):  # the count has room (1 of 4) but the budget not
                while app.gateway.queue.depth() == 0:
                    await anyio.sleep(0.01)
            assert engine.running == 1
            status = (await client.get(gw + "/kneegate/status")).json()["upstreams"][0]
            assert (status["in_flight"], status["in_flight_tokens"]) == (1, 1000)
            assert [r.status_code for r in await asyncio.gather(first, second)] == [200, 200]
    assert (1, 1000, 10) in asked and (1, 1000, 1000) in asked
    assert (state.inflight, state.inflight_tokens) == (0, 0)  # every release gave its share
