"""End to end: one gateway in front of engines serving different models, on real sockets,
with the real `openai` client."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
from helpers.gateway import assert_conserved, scrape, serve, total

from kneegate.gateway.app import KneegateApp, build_app
from kneegate.gateway.config.gateway import parse_config

pytestmark = pytest.mark.anyio

engine_server = pytest.importorskip("kneegate.emulator.server")


def config(engines: dict[str, str], **extra: Any) -> Any:
    ups = [{"name": name, "url": url, "controller": "fixed", "params": {"initial": 4}}
           for name, url in engines.items()]
    return parse_config({"tick_interval": 0.02, "upstreams": ups, **extra})


@contextlib.asynccontextmanager
async def two_models(**extra: Any) -> AsyncIterator[tuple[str, KneegateApp, dict[str, str]]]:
    async with serve(engine_server.build_app("cpu-tiny", model_name="llama")) as llama, \
            serve(engine_server.build_app("cpu-tiny", model_name="qwen")) as qwen:
        app = build_app(config({"llama-0": llama, "qwen-0": qwen}, **extra))
        async with serve(app) as gw:
            yield gw, app, {"llama": llama, "qwen": qwen}


async def test_each_request_reaches_an_engine_that_serves_its_model() -> None:
    async with two_models() as (gw, app, engines), openai.AsyncOpenAI(
            base_url=gw + "/v1", api_key="k", max_retries=0) as client:
        listed = sorted(m.id for m in (await client.models.list()).data)
        assert listed == ["llama", "qwen"]  # the union, answered by the gateway
        calls = [client.chat.completions.create(
                     model=model, messages=[{"role": "user", "content": f"hi {i}"}],
                     max_tokens=4, stream=True)
                 for i in range(12) for model in ("llama", "qwen")]
        streams = await asyncio.gather(*calls)
        for stream in streams:
            models = {chunk.model async for chunk in stream}
            assert len(models) == 1
        async with httpx.AsyncClient() as raw:
            m = scrape((await raw.get(gw + "/metrics")).text)
            for name, url in engines.items():
                served = scrape((await raw.get(url + "/metrics")).text)
                assert total(served, "vllm:request_success_total") == 12, name
        assert total(m, "kneegate_requests_admitted_total", upstream="llama-0") == 12
        assert total(m, "kneegate_requests_admitted_total", upstream="qwen-0") == 12
        assert_conserved(m)
        assert total(m, "kneegate_upstream_model", upstream="llama-0", model="llama") == 1
        assert total(m, "kneegate_upstream_model", upstream="llama-0", model="qwen") == 0
        pools = app.gateway.status()["pools"]
        assert [p["models"] for p in pools] == [["llama"], ["qwen"]]


async def test_an_unknown_model_is_answered_404_at_once_and_never_queued() -> None:
    async with two_models() as (gw, _app, _), httpx.AsyncClient() as raw:
        body = {"model": "gpt-4", "prompt": "hi", "max_tokens": 4}
        t0 = time.monotonic()
        r = await raw.post(gw + "/v1/completions", json=body)
        took = time.monotonic() - t0
        assert r.status_code == 404
        assert r.json()["error"]["code"] == "model_not_found"
        assert r.json()["error"]["param"] == "model"
        assert r.json()["error"]["message"] == (
            "The model `gpt-4` does not exist. Available models: llama, qwen.")
        assert took < 1.0  # answered by the gateway: no engine, no queue
        nameless = await raw.post(gw + "/v1/completions", json={"prompt": "hi"})
        assert nameless.status_code == 400
        assert nameless.json()["error"]["code"] == "model_required"
        assert "llama, qwen" in nameless.json()["error"]["message"]
        m = scrape((await raw.get(gw + "/metrics")).text)
        assert total(m, "kneegate_client_rejections_total", reason="model_not_found") == 1
        assert total(m, "kneegate_client_rejections_total", reason="model_required") == 1
        assert total(m, "kneegate_requests_received_total") == 0


async def test_a_full_pool_never_holds_the_other_back() -> None:
    async with two_models() as (gw, app, _), httpx.AsyncClient(timeout=30) as raw:
        hog = {"model": "llama", "prompt": "x", "max_tokens": 1500, "stream": True}
        held = [await raw.send(raw.build_request("POST", gw + "/v1/completions", json=hog),
                               stream=True) for _ in range(4)]  # llama's 4 slots
        queued = asyncio.create_task(raw.post(gw + "/v1/completions", json=hog))
        llama_pool = app.gateway.queue.pool_of("llama")
        assert llama_pool is not None
        for _ in range(200):
            if llama_pool.queue.depth():
                break
            await asyncio.sleep(0.01)
        assert llama_pool.queue.depth() == 1
        pools = {p["models"][0]: p for p in app.gateway.status()["pools"]}
        assert (pools["llama"]["queue"], pools["qwen"]["queue"]) == (1, 0)  # the live page's
        t0 = time.monotonic()
        r = await raw.post(gw + "/v1/completions",
                           json={"model": "qwen", "prompt": "x", "max_tokens": 2})
        assert r.status_code == 200 and time.monotonic() - t0 < 2.0
        for h in held:
            await h.aclose()
        queued.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await queued


@contextlib.asynccontextmanager
async def replicas(**extra: Any) -> AsyncIterator[tuple[str, KneegateApp, list[str]]]:
    """Two emulated replicas of one model, prefix caching on, behind one gateway."""
    async with serve(engine_server.build_app("cpu-tiny", enable_prefix_caching=True)) as r0, \
            serve(engine_server.build_app("cpu-tiny", enable_prefix_caching=True)) as r1:
        app = build_app(config({"r0": r0, "r1": r1}, **extra))
        async with serve(app) as gw:
            yield gw, app, [r0, r1]


def turn(conversation: str, k: int) -> dict[str, Any]:
    """Turn `k` of a conversation: its system prompt and every earlier turn, then a new one."""
    messages = [{"role": "system", "content": f"{conversation} " + "s" * 600}]
    for i in range(k):
        messages += [{"role": "user", "content": f"question {i} " + "q" * 200},
                     {"role": "assistant", "content": "answer " * 20}]
    messages.append({"role": "user", "content": f"question {k} " + "q" * 200})
    return {"model": "cpu-tiny", "messages": messages, "max_tokens": 2}


async def second_turn_hits(gw: str, engines: list[str]) -> list[float]:
    """Conversations a and b each take one replica for their first turn (b while a holds
    r0, so the least full is r1); then b's second turn comes alone, both replicas idle.
    The prefix-cache hits, in tokens, each replica counted for that second turn."""
    async with httpx.AsyncClient(timeout=30) as raw:
        hog = {**turn("a", 0), "max_tokens": 400, "stream": True}
        a = await raw.send(raw.build_request("POST", gw + "/v1/chat/completions", json=hog),
                           stream=True)
        assert a.status_code == 200
        assert (await raw.post(gw + "/v1/chat/completions", json=turn("b", 0))).status_code == 200
        await a.aclose()
        before = [total(scrape((await raw.get(e + "/metrics")).text),
                        "vllm:prefix_cache_hits_total") for e in engines]
        assert (await raw.post(gw + "/v1/chat/completions", json=turn("b", 1))).status_code == 200
        after = [total(scrape((await raw.get(e + "/metrics")).text),
                       "vllm:prefix_cache_hits_total") for e in engines]
    return [y - x for x, y in zip(before, after, strict=True)]


async def test_a_conversations_next_turn_goes_to_the_replica_holding_its_prefix() -> None:
    async with replicas() as (gw, app, engines):
        assert app.gateway.status()["pools"][0]["affinity"] is True
        hits = await second_turn_hits(gw, engines)
    assert hits[0] == 0 and hits[1] > 0  # r1 held b's first turn, and served its second


async def test_with_affinity_off_the_least_full_replica_takes_it() -> None:
    async with replicas(routing={"affinity": False}) as (gw, app, engines):
        assert app.gateway.status()["pools"][0]["affinity"] is False
        hits = await second_turn_hits(gw, engines)
    assert hits == [0, 0]  # both idle: the first, r0, which never saw b
