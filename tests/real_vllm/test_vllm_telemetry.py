"""Engine telemetry on vLLM's real /metrics: the parser's names, and the gateway's scraper."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import anyio
import httpx
import pytest
from helpers.gateway import scrape, serve, total
from prometheus_client.parser import text_string_to_metric_families
from vllm_server import VllmServer

from kneegate.gateway.app import build_app
from kneegate.gateway.config.gateway import parse_config
from kneegate.gateway.upstream.telemetry import parse_engine_metrics

pytestmark = [pytest.mark.real_vllm, pytest.mark.anyio]

REQ = {"model": "tiny", "prompt": "the engine", "max_tokens": 16, "ignore_eos": True}


async def test_parser_reads_vllms_real_metric_names(vllm: VllmServer) -> None:
    async with httpx.AsyncClient(timeout=60) as client:
        first = parse_engine_metrics((await client.get(vllm.url + "/metrics")).text, 1.0)
        done = await client.post(vllm.url + "/v1/completions", json=REQ)
        assert done.status_code == 200
        text = (await client.get(vllm.url + "/metrics")).text
    stats = parse_engine_metrics(text, 2.0)
    assert first is not None and stats is not None, "no vllm:num_requests_* gauges found"
    raw = scrape(text)
    assert stats.running == total(raw, "vllm:num_requests_running")
    assert stats.waiting == total(raw, "vllm:num_requests_waiting")
    assert 0.0 <= stats.kv_cache_usage <= 1.0  # not NaN: vllm:kv_cache_usage_perc was read
    assert stats.preemptions_total == total(raw, "vllm:num_preemptions_total")
    assert math.isfinite(stats.preemptions_total)
    assert stats.generation_tokens_total == total(raw, "vllm:generation_tokens_total")
    # the counter is vLLM's own: it moved by at least the 16 tokens we asked for
    assert stats.generation_tokens_total - first.generation_tokens_total >= 16
    # the KV cache's size, from the labels of vLLM's cache_config_info (the token budget's)
    info = [s for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == "vllm:cache_config_info"]
    assert info, "vLLM exports no vllm:cache_config_info"
    blocks, size = int(info[0].labels["num_gpu_blocks"]), int(info[0].labels["block_size"])
    assert stats.kv_capacity_tokens == blocks * size > 0


async def test_gateway_scrapes_vllm_and_shows_a_running_request(vllm: VllmServer) -> None:
    # A scrape may wait 10 s: vLLM binds its model worker to one core and leaves the other
    # to its API server, which here shares it with this test's gateway and client. CI once
    # saw every scrape time out at 3 s while an answer streamed, and answer at once after.
    app = build_app(parse_config({"tick_interval": 0.02, "upstreams": [{
        "name": "vllm", "url": vllm.url, "controller": "fixed", "params": {"initial": 4},
        "scrape": True, "scrape_interval": 0.2, "stale_after": 10.0}]}))
    # Two long answers at a time, one after another, until a scrape has seen one running:
    # the engine is never idle between them. On a fast machine vLLM's CPU build decodes
    # 400 tokens in under a second, which one answer alone can spend between two scrapes.
    long = {**REQ, "max_tokens": 900, "stream": True}
    found = anyio.Event()
    tails: list[bytes] = []

    async def keep_busy(client: httpx.AsyncClient, gw: str) -> None:
        for _ in range(40):  # bounded: the wait below gives up after 60 s anyway
            async with client.stream("POST", gw + "/v1/completions", json=long) as r:
                assert r.status_code == 200
                tails.append(b"".join([c async for c in r.aiter_raw()])[-64:])
            if found.is_set():
                return

    async with serve(app) as gw, httpx.AsyncClient(timeout=60) as client:
        async with anyio.create_task_group() as tg:
            tg.start_soon(keep_busy, client, gw)
            tg.start_soon(keep_busy, client, gw)
            seen = await _wait_status(
                client, gw, lambda e: e.get("running", 0) >= 1 and not e["stale"], 60)
            found.set()
        idle = await _wait_status(client, gw, lambda e: e.get("running") == 0, 30)
        m = scrape((await client.get(gw + "/metrics")).text)
    assert tails and all(b"data: [DONE]" in t for t in tails)
    assert not seen["stalled"]  # progress: the counter advanced while it ran
    assert idle["generation_tokens_total"] >= seen["generation_tokens_total"] + 1
    assert total(m, "kneegate_engine_scrapes_total", outcome="ok") >= 2
    # on 2 busy cores a scrape may time out; none may fail or go unread
    for outcome in ("error", "http_error", "unparsable"):
        assert total(m, "kneegate_engine_scrapes_total", outcome=outcome) == 0
    assert total(m, "kneegate_upstream_usable") == 1


async def _wait_status(
    client: httpx.AsyncClient, gw: str, ok: Any, seconds: float
) -> dict[str, Any]:
    """Poll /kneegate/status until the engine block satisfies `ok`; return that block.
    On timeout, fail with the last blocks seen (what the scrapes showed instead)."""
    seen: list[Any] = []
    try:
        with anyio.fail_after(seconds):
            while True:
                status = (await client.get(gw + "/kneegate/status")).json()
                engine = status["upstreams"][0]["engine"]
                if engine is not None and ok(engine):
                    return dict(engine)
                seen = [*seen[-4:], engine]
                await asyncio.sleep(0.05)
    except TimeoutError:
        m = scrape((await client.get(gw + "/metrics")).text)
        outcomes = {o: total(m, "kneegate_engine_scrapes_total", outcome=o)
                    for o in ("ok", "timeout", "error", "http_error", "unparsable")}
        pytest.fail(f"no such engine figures within {seconds:g}s; the last seen: {seen}; "
                    f"scrapes by outcome: {outcomes}")
