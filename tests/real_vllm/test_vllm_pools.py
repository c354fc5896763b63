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
   once on, each with conversations of its own: with it on every turn goes back to the
   engine of the turn before, and vLLM's own prefix-cache hit rate (`vllm:prefix_cache_hits`
   over `_queries`, summed over both engines) is higher. At this light load most-room
   routing is mostly sticky by itself, so the difference is small here (0.42 against
   0.34-0.39); under load, on the emulator: docs/benchmarks.md, "Pools: multi-turn chat
   on four replicas".

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


LIMIT = 4  # each engine's fixed limit: the tests never have more in flight for one engine


def gateway(engines: dict[str, VllmServer], affinity: bool = True) -> Any:
    """One gateway, both engines at fixed limits of LIMIT, models read from /v1/models."""
    return build_app(parse_config({
        "tick_interval": 0.02,
        "routing": {"affinity": affinity},
        "upstreams": [{"name": k, "url": s.url, "controller": "fixed",
                       "params": {"initial": LIMIT}}
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
    models = ["tiny-a", "tiny-b"] * 16  # 32 streams, 4 at once: both engines busy, none queued
    answered: list[tuple[str, str]] = []

    async def stream(client: httpx.AsyncClient, gw: str, model: str) -> None:
        body = {"model": model, "prompt": "route me", "max_tokens": 32, "stream": True,
                "ignore_eos": True}
        async with client.stream("POST", gw + "/v1/completions", json=body) as r:
            assert r.status_code == 200, await r.aread()
            made = [json.loads(line[6:])["model"] async for line in r.aiter_lines()
                    if line.startswith("data: {")]
            assert made, "no chunk in the stream"
            answered.append((model, made[0]))

    async with serve(app) as gw, httpx.AsyncClient(timeout=120) as client:
        await one_pool_of_three_models(client, gw)
        before = await engine_totals(client, engines, "vllm:request_success_total")
        sem = asyncio.Semaphore(LIMIT)

        async def bounded(model: str) -> None:
            async with sem:
                await stream(client, gw, model)

        with anyio.fail_after(300):
            await asyncio.gather(*(bounded(m) for m in models))
        after = await engine_totals(client, engines, "vllm:request_success_total")
        m = scrape((await client.get(gw + "/metrics")).text)
    assert len(answered) == len(models)
    assert all(asked == made for asked, made in answered), answered
    assert {k: after[k] - before[k] for k in engines} == {"a": 16, "b": 16}
    assert total(m, "kneegate_requests_finished_total", outcome="completed") == len(models)


CONVERSATIONS = 8  # at once, at most LIMIT on one engine: affinity never has to spill


async def hit_rate(engines: dict[str, VllmServer], affinity: bool, tag: str
                   ) -> tuple[float, float]:
    """Multi-turn chats on `chat` through a gateway with affinity on or off: vLLM's prefix
    cache hit rate over them, summed over both engines, and the share of turns after the
    first served by the engine that served the turn before (an answer names its engine).
    CONVERSATIONS at once (none queued), three turns each, each turn sent 0-2 s (the
    user's think time) after the last one's answer came and carrying all of them; each turn
    adds more than it repeats, so the engine a turn goes to decides most of its hits.

    Why think times: without them most-room routing is sticky by itself, since the next
    turn arrives as its own answer frees a slot, so the engine that served it has the most
    room (measured: 0.81 of turns went back with affinity off)."""
    app = gateway(engines, affinity)
    rng, think = random.Random(tag), random.Random(tag + "think")
    stayed: list[bool] = []

    def words(n: int) -> str:  # words of the tiny model's vocabulary: a token each
        return " ".join(f"w{rng.randrange(1000, 4096)}" for _ in range(n))

    async def conversation(client: httpx.AsyncClient, gw: str) -> None:
        messages: list[dict[str, str]] = [{"role": "system", "content": words(16)}]
        last = None
        for _ in range(3):
            messages.append({"role": "user", "content": words(96)})
            body = {"model": "chat", "messages": messages, "max_tokens": 24,
                    "temperature": 0, "ignore_eos": True}
            r = await client.post(gw + "/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            answer = r.json()
            if last is not None:
                stayed.append(answer["model"] == last)
            last = answer["model"]
            messages.append({"role": "assistant",
                             "content": answer["choices"][0]["message"]["content"]})
            await asyncio.sleep(think.uniform(0.0, 2.0))  # the workload: a user reads, types

    async with serve(app) as gw, httpx.AsyncClient(timeout=120) as client:
        await one_pool_of_three_models(client, gw)
        hits0 = await engine_totals(client, engines, "vllm:prefix_cache_hits_total")
        queries0 = await engine_totals(client, engines, "vllm:prefix_cache_queries_total")
        with anyio.fail_after(300):
            await asyncio.gather(*(conversation(client, gw) for _ in range(CONVERSATIONS)))
        hits1 = await engine_totals(client, engines, "vllm:prefix_cache_hits_total")
        queries1 = await engine_totals(client, engines, "vllm:prefix_cache_queries_total")
    queries = sum(queries1.values()) - sum(queries0.values())
    assert queries > 0, "vLLM counted no prefix-cache queries: is its prefix caching off?"
    return (sum(hits1.values()) - sum(hits0.values())) / queries, sum(stayed) / len(stayed)


async def test_affinity_raises_vllms_own_prefix_cache_hit_rate(
    engines: dict[str, VllmServer],
) -> None:
    off, off_stayed = await hit_rate(engines, affinity=False, tag="off")
    on, on_stayed = await hit_rate(engines, affinity=True, tag="on")
    print(f"vLLM's prefix-cache hit rate: affinity off {off:.2f} ({off_stayed:.2f} of turns "
          f"on the last turn's engine), on {on:.2f} ({on_stayed:.2f})")
    # never full: with affinity every next turn goes back to its engine; without, most-room
    # routing sends some elsewhere (and at this light load, ties going to the first engine,
    # keeps most where they were: 0.75-0.91 of turns, hit rates 0.34-0.39 against 0.42)
    assert on_stayed == 1.0 and off_stayed < 1.0, (off_stayed, on_stayed)
    assert on > off, (off, on)
