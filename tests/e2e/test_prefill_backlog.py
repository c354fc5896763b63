"""The engine's prefill backlog over real sockets: the relay tells admission of each streamed
answer's first token (`kneegate_awaiting_first_token`), and a non-streamed one is not
counted. The cap's arithmetic is in tests/admission/test_queue.py."""

from __future__ import annotations

import asyncio

import anyio
import httpx
import pytest
from helpers.gateway import FakeEngine, gw_config, scrape, serve, total

from kneegate.gateway.app import build_app


async def gauges(client: httpx.AsyncClient, gw: str) -> tuple[float, float]:
    m = scrape((await client.get(gw + "/metrics")).text)
    return total(m, "kneegate_awaiting_first_token"), total(m, "kneegate_in_flight")


@pytest.mark.anyio
async def test_a_streamed_answer_awaits_its_first_token_and_a_plain_one_is_not_counted() -> None:
    engine = FakeEngine(interval=0.05, first_delay=1.0)
    async with serve(engine) as up:
        app = build_app(gw_config(up, limit=4))
        async with serve(app) as gw, httpx.AsyncClient(timeout=10) as client:
            body = {"max_tokens": 10, "stream": True}
            async with client.stream("POST", gw + "/v1/completions", json=body) as r:
                with anyio.fail_after(5):  # the engine has it; its first token is 1 s off
                    await engine.started.wait()
                assert await gauges(client, gw) == (1, 1)
                lines = r.aiter_lines()
                while not (await anext(lines)).startswith("data:"):
                    pass
                assert await gauges(client, gw) == (0, 1)  # streaming: no longer awaiting
                async for _ in lines:
                    pass
            assert await gauges(client, gw) == (0, 0)
            engine.started.clear()
            plain = asyncio.create_task(  # its answer's head comes with its end
                client.post(gw + "/v1/completions", json={"max_tokens": 10}))
            with anyio.fail_after(5):
                await engine.started.wait()
            assert await gauges(client, gw) == (0, 1)  # no "stream": true: never awaiting
            assert (await plain).status_code == 200
