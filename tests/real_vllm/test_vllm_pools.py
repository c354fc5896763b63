"""Pools in front of two real vLLMs: each model to an engine that serves it, and affinity.

Two vLLM servers of the tiny model, started for this module, each under two served names:
A serves `tiny-a` and `chat`, B serves `tiny-b` and `chat`. Their models overlap (`chat`), so
the gateway makes one pool of them, and within it sends `tiny-a` only to A and `tiny-b` only
to B (`admission.pools`: an upstream must list the request's model); `chat` may go to
either, and prefix affinity decides which. vLLM names its first served name in every
answer's `model`, so an answer says which engine made it.

1. Routing under load: concurrent streams for `tiny-a` and `tiny-b` through one gateway
   that read both engines' /v1/models: every answer comes from an engine serving the model
   asked for, and each engine's own request counter moved by exactly its model's requests.
2. Affinity: multi-turn chats on `chat` (each turn carries every earlier turn; vLLM's
   prefix cache is on by default in its V1 engine), once with `routing.affinity` off and
   once on, each with conversations of its own: vLLM's own prefix-cache hit rate
   (`vllm:prefix_cache_hits` over `_queries`, summed over both engines) is higher with it on.

Opt-in (`-m real_vllm`, and `slow`: two more vLLM servers, ~2-3 minutes to start on 2 cores).
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anyio
import httpx
import pytest
from helpers.gateway import scrape, serve, total
from vllm_server import VllmServer, ensure_env, ensure_model, start_vllm, stop

from kneegate.gateway.app import build_app
from kneegate.gateway.config.gateway import parse_config

pytestmark = [pytest.mark.real_vllm, pytest.mark.slow, pytest.mark.anyio]

ENGINES = {"a": ("tiny-a", "chat"), "b": ("tiny-b", "chat")}


@pytest.fixture(scope="module")
def engines() -> Iterator[dict[str, VllmServer]]:
    """A and B, started side by side; stopped at the module's end."""
    py = ensure_env()
    model = ensure_model(py)
    with ThreadPoolExecutor(2) as pool:
        futures = {k: pool.submit(start_vllm, py, model, names=names)
                   for k, names in ENGINES.items()}
        started = {}
        try:
            for k, f in futures.items():
                started[k] = f.result()
        finally:
            if len(started) < len(futures):  # one failed: stop the other as it comes
                for f in futures.values():
                    if f.exception() is None:
                        stop(f.result()[0])
    try:
        yield {k: server for k, (_, server) in started.items()}
    finally:
        for proc, _ in started.values():
            stop(proc)


def gateway(engines: dict[str, VllmServer], affinity: bool = True) -> Any:
    """One gateway, both engines at fixed limits of 4, models read from their /v1/models."""
    return build_app(parse_config({
        "tick_interval": 0.02,
        "routing": {"affinity": affinity},
        "upstreams": [{"name": k, "url": s.url, "controller": "fixed", "params": {"initial": 4}}
                      for k, s in engines.items()],
    }))


async def one_pool_of_three_models(client: httpx.AsyncClient, gw: str) -> None:
    """Wait until the gateway has read both engines' models: one pool serving all three."""
    with anyio.fail_after(30):
        while True:
            pools = (await client.get(gw + "/kneegate/status")).json()["pools"]
            if [p["models"] for p in pools] == [["chat", "tiny-a", "tiny-b"]]:
                return
            await asyncio.sleep(0.1)


async def engine_totals(client: httpx.AsyncClient, engines: dict[str, VllmServer],
                        name: str) -> dict[str, float]:
    return {k: total(scrape((await client.get(s.url + "/metrics")).text), name)
            for k, s in engines.items()}


async def test_each_model_is_answered_by_an_engine_that_serves_it_under_load(
    engines: dict[str, VllmServer],
) -> None:
    app = gateway(engines)
    models = ["tiny-a", "tiny-b"] * 12  # 24 streams, 16 at once: both engines' limits full
    answered: list[tuple[str, str]] = []

    async def stream(client: httpx.AsyncClient, gw: str, model: str) -> None:
        body = {"model": model, "prompt": "route me", "max_tokens": 32, "stream": True,
                "ignore_eos": True}
        async with client.stream("POST", gw + "/v1/completions", json=body) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    answered.append((model, json.loads(line[6:])["model"]))
                    break
            async for _ in r.aiter_raw():
                pass

    async with serve(app) as gw, httpx.AsyncClient(timeout=120) as client:
        await one_pool_of_three_models(client, gw)
        before = await engine_totals(client, engines, "vllm:request_success_total")
        sem = asyncio.Semaphore(16)

        async def bounded(model: str) -> None:
            async with sem:
                await stream(client, gw, model)

        with anyio.fail_after(300):
            await asyncio.gather(*(bounded(m) for m in models))
        after = await engine_totals(client, engines, "vllm:request_success_total")
        m = scrape((await client.get(gw + "/metrics")).text)
    assert len(answered) == len(models)
    assert all(asked == made for asked, made in answered), answered
    assert {k: after[k] - before[k] for k in engines} == {"a": 12, "b": 12}
    assert total(m, "kneegate_requests_finished_total", outcome="ok") == len(models)


async def hit_rate(engines: dict[str, VllmServer], affinity: bool, tag: str) -> float:
    """Multi-turn chats on `chat` through a gateway with affinity on or off: vLLM's prefix
    cache hit rate over them, summed over both engines. Six conversations at once, four
    turns each, each turn sent once the last one's answer came and carrying all of them."""
    app = gateway(engines, affinity)
    rng = random.Random(tag)

    def words(n: int) -> str:
        return " ".join(f"{tag}{rng.randrange(10_000)}" for _ in range(n))

    async def conversation(client: httpx.AsyncClient, gw: str) -> None:
        messages: list[dict[str, str]] = [{"role": "system", "content": words(48)}]
        for _ in range(4):
            messages.append({"role": "user", "content": words(48)})
            body = {"model": "chat", "messages": messages, "max_tokens": 24,
                    "temperature": 0, "ignore_eos": True}
            r = await client.post(gw + "/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            messages.append({"role": "assistant",
                             "content": r.json()["choices"][0]["message"]["content"]})

    async with serve(app) as gw, httpx.AsyncClient(timeout=120) as client:
        await one_pool_of_three_models(client, gw)
        hits0 = await engine_totals(client, engines, "vllm:prefix_cache_hits_total")
        queries0 = await engine_totals(client, engines, "vllm:prefix_cache_queries_total")
        with anyio.fail_after(300):
            await asyncio.gather(*(conversation(client, gw) for _ in range(6)))
        hits1 = await engine_totals(client, engines, "vllm:prefix_cache_hits_total")
        queries1 = await engine_totals(client, engines, "vllm:prefix_cache_queries_total")
    queries = sum(queries1.values()) - sum(queries0.values())
    assert queries > 0, "vLLM counted no prefix-cache queries: is its prefix caching off?"
    return (sum(hits1.values()) - sum(hits0.values())) / queries


async def test_affinity_raises_vllms_own_prefix_cache_hit_rate(
    engines: dict[str, VllmServer],
) -> None:
    off = await hit_rate(engines, affinity=False, tag="off")
    on = await hit_rate(engines, affinity=True, tag="on")
    print(f"vLLM's prefix-cache hit rate: affinity off {off:.2f}, on {on:.2f}")
    assert on > off + 0.1, (off, on)
