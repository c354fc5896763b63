"""Tenants over real sockets (issue 15): who a request is for, its fair turn, its own caps,
and what the metrics say of it (never the key)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import anyio
import httpx
import pytest
from helpers.gateway import (
    answer_lifespan,
    assert_conserved,
    gw_config,
    read_request_body,
    reply,
    scrape,
    serve,
    total,
    until,
)

from kneegate.gateway.app import KneegateApp, build_app

pytestmark = pytest.mark.anyio


class Turnstile:
    """An engine that answers one request per `turn()`; `seen` is the order they came in,
    each named by the `user` field of its body."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        self._turns = asyncio.Semaphore(0)
        self.arrived = asyncio.Event()

    def turn(self) -> None:
        self._turns.release()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await answer_lifespan(receive, send)
            return
        body = await read_request_body(receive)
        if scope["path"] != "/v1/completions":
            await reply(send, 404, b"{}")
            return
        self.seen.append(json.loads(body)["user"])
        self.arrived.set()
        await self._turns.acquire()
        await reply(send, 200, json.dumps({
            "choices": [{"text": "ok"}],
            "usage": {"prompt_tokens": 4, "completion_tokens": 1}}).encode())


@dataclass
class Rig:
    engine: Turnstile
    app: KneegateApp
    gw: str
    client: httpx.AsyncClient

    def send(self, who: str, key: str | None = None, **headers: str
             ) -> asyncio.Task[httpx.Response]:
        if key is not None:
            headers["authorization"] = f"Bearer {key}"
        return asyncio.create_task(self.client.post(
            self.gw + "/v1/completions", json={"prompt": "hi", "user": who},
            headers=headers))

    async def at_engine(self, n: int) -> None:
        await until(lambda: len(self.engine.seen) >= n)

    async def queued(self, n: int) -> None:
        await until(lambda: self.app.gateway.queue.depth() == n)

    async def metrics(self) -> dict[Any, float]:
        return scrape((await self.client.get(self.gw + "/metrics")).text)


async def rig_for(**config: Any) -> AsyncIterator[Rig]:
    engine = Turnstile()
    async with serve(engine) as up:
        # a long objective: these tests are about order, and before any answer ends the
        # queue guesses a request's wait from how long the one in flight has run (tens of
        # ms here, more on a busy machine)
        config.setdefault("classes", {"default": {"ttft_objective": 60.0}})
        app = build_app(gw_config(up, limit=1, **config))
        async with serve(app) as gw, httpx.AsyncClient(timeout=10) as client:
            rig = Rig(engine, app, gw, client)
            yield rig
            m = await rig.metrics()
            assert total(m, "kneegate_in_flight") == 0
            assert_conserved(m)


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    async for r in rig_for():
        yield r


async def test_a_light_key_is_served_before_a_heavy_keys_queue(rig: Rig) -> None:
    heavy = [rig.send(f"h{i}", key="sk-heavy-0123456789") for i in range(1)]
    await rig.at_engine(1)  # h0 holds the only slot
    heavy += [rig.send(f"h{i}", key="sk-heavy-0123456789") for i in range(1, 4)]
    await rig.queued(3)
    light = rig.send("l0", key="sk-light-9876543210")
    await rig.queued(4)
    for n in range(2, 6):
        rig.engine.turn()
        await rig.at_engine(n)
    rig.engine.turn()
    # the light key waited for the request being served, not for the heavy key's queue
    assert rig.engine.seen == ["h0", "l0", "h1", "h2", "h3"]
    assert [r.status_code for r in await asyncio.gather(*heavy, light)] == [200] * 5
    text = (await rig.client.get(rig.gw + "/metrics")).text
    assert "sk-heavy" not in text and "sk-light" not in text  # tenants by hash, never key
    m = scrape(text)
    admitted = {dict(ls)["tenant"]: v for (n, ls), v in m.items()
                if n == "kneegate_tenant_admitted_total"}
    assert sorted(admitted.values()) == [1.0, 4.0]
    assert all(t.startswith("key-") and len(t) == 16 for t in admitted)


async def test_keys_minted_per_request_take_one_turn_between_them(rig: Rig) -> None:
    # issue 44: keys never served wait in one pool; a key once served has its own turn
    first = rig.send("l0", key="sk-light-9876543210")
    await rig.at_engine(1)  # l0 holds the only slot: the light key has been served
    rest = [rig.send(f"m{i}", key=f"sk-minted-{i:04d}") for i in range(1, 4)]
    await rig.queued(3)
    rest += [rig.send("l1", key="sk-light-9876543210")]
    await rig.queued(4)
    rest += [rig.send("l2", key="sk-light-9876543210")]
    await rig.queued(5)
    for n in range(2, 7):
        rig.engine.turn()
        await rig.at_engine(n)
    rig.engine.turn()
    # each minted key alone would start level with the light one, three turns to its one
    assert rig.engine.seen == ["l0", "l1", "m1", "l2", "m2", "m3"]
    assert [r.status_code for r in await asyncio.gather(first, *rest)] == [200] * 6


async def test_without_keys_everyone_is_one_tenant_first_come_first_served(rig: Rig) -> None:
    first = rig.send("a0")
    await rig.at_engine(1)
    rest = [rig.send(w) for w in ("a1", "a2")]
    await rig.queued(2)
    rest.append(rig.send("b0"))
    await rig.queued(3)
    for n in range(2, 5):
        rig.engine.turn()
        await rig.at_engine(n)
    rig.engine.turn()
    assert rig.engine.seen == ["a0", "a1", "a2", "b0"]
    assert [r.status_code for r in await asyncio.gather(first, *rest)] == [200] * 4
    assert total(await rig.metrics(), "kneegate_tenant_admitted_total",
                 tenant="anonymous") == 4


async def test_a_tenant_over_its_own_cap_gets_429_with_retry_after() -> None:
    config = {"tenants": {"acme": {"keys": ["sk-acme"], "max_inflight": 1}},
              "tenant_header": "x-tenant"}
    async for rig in rig_for(**config):
        held = rig.send("a0", key="sk-acme")
        await rig.at_engine(1)
        r = await rig.send("a1", key="sk-acme")
        assert r.status_code == 429
        assert r.headers["x-kneegate-reject-reason"] == "tenant_quota"
        assert int(r.headers["retry-after"]) >= 1
        body = r.json()["error"]
        assert body["code"] == "tenant_quota" and "'acme'" in body["message"]
        other = rig.send("b0", **{"x-tenant": "beta"})  # another tenant: queued, not refused
        await rig.queued(1)
        rig.engine.turn()
        await rig.at_engine(2)
        rig.engine.turn()
        assert [(await held).status_code, (await other).status_code] == [200, 200]
        m = await rig.metrics()
        assert total(m, "kneegate_tenant_rejected_total", tenant="acme",
                     reason="tenant_quota") == 1
        assert total(m, "kneegate_tenant_admitted_total", tenant="beta") == 1
        assert total(m, "kneegate_requests_shed_total", reason="tenant_quota") == 1


async def test_the_fairness_gauge_is_exported_per_class(rig: Rig) -> None:
    rig.app.gateway.tick()  # a reading: nobody waits, so 1
    with anyio.fail_after(5):
        m = await rig.metrics()
    assert total(m, "kneegate_fairness_jain", **{"class": "default"}) == 1.0
