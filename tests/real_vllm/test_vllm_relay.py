"""The gateway in front of a real vLLM: same tokens as direct, vLLM's errors untouched, aborts.

Greedy decoding (temperature 0) with ignore_eos makes vLLM's output a function of the
request, so a request sent direct and the same one through the gateway must give the same
text, finish reason and usage; anything the gateway added, dropped or re-encoded shows.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import httpx
import openai
import pytest
from helpers.gateway import gw_config, scrape, serve, total, until
from vllm_server import VllmServer

from kneegate.gateway.app import build_app
from kneegate_bench.openloop import late_ticks

pytestmark = [pytest.mark.real_vllm, pytest.mark.anyio]

TOKENS = 24
PROMPT = "the gateway admits requests below the knee"


async def generate(base: str, chat: bool, stream: bool) -> dict[str, Any]:
    """One greedy request with the openai client: text, finish reason, usage."""
    kw: dict[str, Any] = {"model": "tiny", "max_tokens": TOKENS, "temperature": 0,
                          "extra_body": {"ignore_eos": True}}
    if stream:
        kw.update(stream=True, stream_options={"include_usage": True})
    async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="k", max_retries=0) as c:
        create: Any = c.chat.completions.create if chat else c.completions.create
        if chat:
            kw["messages"] = [{"role": "user", "content": PROMPT}]
        else:
            kw["prompt"] = PROMPT
        out = await create(**kw)
        if not stream:
            choice = out.choices[0]
            text = choice.message.content if chat else choice.text
            return {"text": text, "finish": choice.finish_reason, "usage": out.usage.model_dump()}
        chunks = [ch async for ch in out]
    choices = [ch.choices[0] for ch in chunks if ch.choices]
    parts = [(ch.delta.content if chat else ch.text) or "" for ch in choices]
    finish = [ch.finish_reason for ch in choices if ch.finish_reason]
    assert chunks[-1].usage is not None, "include_usage asks for a last chunk with usage"
    return {"text": "".join(parts), "finish": finish[-1], "usage": chunks[-1].usage.model_dump()}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
async def test_gateway_relays_the_same_tokens_as_direct(
    vllm: VllmServer, chat: bool, stream: bool
) -> None:
    async with serve(build_app(gw_config(vllm.url, limit=4))) as gw:
        with anyio.fail_after(60):
            direct = await generate(vllm.url, chat, stream)
            relayed = await generate(gw, chat, stream)
    assert relayed == direct
    assert direct["usage"]["completion_tokens"] == TOKENS
    assert direct["finish"] == "length"
    assert len(direct["text"].split()) >= TOKENS // 2  # visible words, not empty strings


@pytest.mark.parametrize("body", [
    {"model": "tiny", "prompt": "x", "max_tokens": 4, "temperature": -1},  # 400
], ids=["temperature"])
async def test_vllm_error_bodies_pass_through_unchanged(
    vllm: VllmServer, body: dict[str, Any]
) -> None:
    app = build_app(gw_config(vllm.url, limit=4))
    async with serve(app) as gw, httpx.AsyncClient(timeout=30) as client:
        for path in ("/v1/completions", "/v1/chat/completions"):
            req = dict(body)
            if "chat" in path:
                req["messages"] = [{"role": "user", "content": req.pop("prompt")}]
            direct = await client.post(vllm.url + path, json=req)
            relayed = await client.post(gw + path, json=req)
            assert direct.status_code in (400, 404), direct.text
            assert (relayed.status_code, relayed.content) == (direct.status_code, direct.content)
            assert relayed.headers["content-type"] == direct.headers["content-type"]
            assert direct.json()["error"]["code"] == direct.status_code
        assert app.gateway.pool.active[0].inflight == 0


async def test_a_model_vllm_does_not_serve_is_answered_404_as_vllm_would_never_sent(
    vllm: VllmServer,
) -> None:
    # the gateway knows what vLLM serves from its /v1/models: a model it does not list gets
    # vLLM's status and message at once, in OpenAI's shape (code model_not_found), unsent
    app = build_app(gw_config(vllm.url, limit=4))
    body = {"model": "no-such-model", "prompt": "x", "max_tokens": 4}
    async with serve(app) as gw, httpx.AsyncClient(timeout=30) as client:
        await until(lambda: app.gateway.pool.context("tiny") == vllm.max_model_len, 30)
        direct = await client.post(vllm.url + "/v1/completions", json=body)
        relayed = await client.post(gw + "/v1/completions", json=body)
        assert (relayed.status_code, direct.status_code) == (404, 404)
        mine, theirs = relayed.json()["error"], direct.json()["error"]
        first = theirs["message"].split(". ")[0]  # vLLM's: "The model `x` does not exist"
        assert mine["message"].startswith(first + ". ") and mine["param"] == "model"
        assert mine["message"].endswith("Available models: tiny.")
        assert mine["code"] == "model_not_found"
        m = scrape((await client.get(gw + "/metrics")).text)
        assert total(m, "kneegate_requests_received_total") == 0


async def test_a_request_over_the_context_is_refused_as_vllm_would_before_admission(
    vllm: VllmServer,
) -> None:
    # the gateway reads max_model_len from vLLM's /v1/models and answers at once
    app = build_app(gw_config(vllm.url, limit=4))
    async with serve(app) as gw, httpx.AsyncClient(timeout=30) as client:
        await until(lambda: app.gateway.pool.context("tiny") == vllm.max_model_len, 30)
        for path in ("/v1/completions", "/v1/chat/completions"):
            req: dict[str, Any] = {"model": "tiny", "max_tokens": vllm.max_model_len + 1}
            if "chat" in path:
                req["messages"] = [{"role": "user", "content": "x"}]
            else:
                req["prompt"] = "x"
            direct = await client.post(vllm.url + path, json=req)
            relayed = await client.post(gw + path, json=req)
            assert direct.status_code == relayed.status_code == 400, direct.text
            err = relayed.json()["error"]
            assert err["code"] == "context_length_exceeded"
            assert f"maximum context length is {vllm.max_model_len} tokens" in err["message"]
        m = scrape((await client.get(gw + "/metrics")).text)
    assert total(m, "kneegate_client_rejections_total", reason="context_length") == 2
    assert total(m, "kneegate_requests_received_total") == 0  # never queued


async def engine_counts(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    m = scrape((await client.get(url + "/metrics")).text)
    return {
        "abort": total(m, "vllm:request_success_total", finished_reason="abort"),
        "finished": total(m, "vllm:request_success_total"),
        "busy": total(m, "vllm:num_requests_running") + total(m, "vllm:num_requests_waiting"),
        "generated": total(m, "vllm:generation_tokens_total"),
    }


async def wait_for(
    client: httpx.AsyncClient, url: str, ok: Callable[[dict[str, float]], bool], seconds: float
) -> dict[str, float]:
    """Poll vLLM's /metrics until `ok(counts)`; fail after `seconds`."""
    with anyio.fail_after(seconds):
        while not ok(counts := await engine_counts(client, url)):
            await asyncio.sleep(0.05)
    return counts


# The disconnect test's answer: ~4-7 s of decoding at one client on 2 cores.
LONG = 900
# An attempt through which this process was kept off the CPU for longer than this, in one
# stretch, measured the machine and runs again (see the test's docstring).
LATE_LIMIT = 1.0
ATTEMPTS = 20


async def test_client_disconnect_mid_stream_aborts_in_vllm_and_frees_the_slot(
    vllm: VllmServer,
) -> None:
    """The request leaves vLLM's scheduler soon and never finishes; the slot is free.

    vLLM 0.32.0 does not count an abort that its API server asks for (a client gone) in
    vllm:request_success_total{finished_reason="abort"}: OutputProcessor.abort_requests
    drops the request's state without recording finished-request stats (measured: direct
    and through the gateway alike, the counter stays 0). What shows the abort is that the
    request stops running with under half of its LONG tokens made (1-30 tokens, ~0.3 s
    after the disconnect), its tokens stop, and it is never counted as finished for any
    other reason. The judge is vLLM's token counter, not this process's clock.

    An attempt through which this process was kept off the CPU for over LATE_LIMIT in one
    stretch measured the machine, not the gateway, and runs again (ATTEMPTS at most; the
    failure lists how late each was). On this VM (Firecracker, kernel.sched_vcpu_pack=15),
    while vLLM's CPU build decodes, a CPU-bound task can run 8-9 s without being preempted
    (perf sched timehist), and every other process, this one and an outside sampler alike,
    misses the CPU until the answer is made: 5 of 12 attempts here, 5 of 5 in one CI run.
    docs/experiments/2026-12-07-real-vllm-freezes.md has the measurements."""
    lateness: list[float] = []
    for _ in range(ATTEMPTS):
        seen, late = await _leave_mid_stream(vllm)
        lateness.append(round(late, 1))
        if late <= LATE_LIMIT:
            break
    else:
        pytest.fail(f"this process was kept off the CPU for over {LATE_LIMIT:g} s in each of "
                    f"{ATTEMPTS} attempts (longest stretch per attempt, s: {lateness})")
    assert seen is not None, f"the whole answer came before the first read ({lateness} s late)"
    before, after, later, gw_metrics = seen
    generated = after["generated"] - before["generated"]
    assert 1 <= generated < LONG / 2, (generated, lateness)
    assert later["generated"] == after["generated"]  # no tokens after it left
    # counted as an abort where vLLM counts it, never as finished for another reason
    assert later["finished"] - before["finished"] == later["abort"] - before["abort"]
    assert total(gw_metrics, "kneegate_requests_finished_total", outcome="client_cancelled") == 1
    assert total(gw_metrics, "kneegate_in_flight") == 0


async def _leave_mid_stream(vllm: VllmServer) -> tuple[tuple[Any, ...] | None, float]:
    """Stream a LONG-token answer through the gateway and leave after its first text.

    Returns vLLM's counts before / when it stopped / a moment later and the gateway's
    /metrics (None when the whole answer came before the first read), and the longest
    stretch, in seconds, by which this loop's ticks came late meanwhile."""
    assert vllm.max_model_len > LONG + 32, "the prompt and LONG tokens fit the context"
    app = build_app(gw_config(vllm.url, limit=2))
    up = app.gateway.pool.active[0]
    req = {"model": "tiny", "prompt": PROMPT, "max_tokens": LONG, "stream": True,
           "ignore_eos": True}
    async with serve(app) as gw, httpx.AsyncClient(timeout=30) as client:
        before = await wait_for(client, vllm.url, lambda c: c["busy"] == 0, 60)
        async with loop_ticks() as late:
            async with client.stream("POST", gw + "/v1/completions", json=req) as r:
                assert r.status_code == 200
                with anyio.fail_after(30):
                    async for chunk in r.aiter_raw():
                        if b'"text":' in chunk:
                            break  # vLLM is generating; now the client goes away
                still_running = up.inflight == 1
            after = await wait_for(client, vllm.url, lambda c: c["busy"] == 0, 30)
            longest = max(late, default=0.0)
        with anyio.fail_after(5):
            while up.inflight:
                await asyncio.sleep(0.01)
        gw_metrics = scrape((await client.get(gw + "/metrics")).text)
        later = await engine_counts(client, vllm.url)
    if not still_running:  # the whole answer came before the first read
        return None, longest
    return (before, after, later, gw_metrics), longest


@asynccontextmanager
async def loop_ticks() -> AsyncIterator[list[float]]:
    """The seconds by which this loop's 50 ms ticks came late (over 0.1 s), as they come
    (the overload benchmark's `late_ticks`)."""
    late: list[float] = []
    ticker = asyncio.create_task(late_ticks(late))
    try:
        yield late
    finally:
        ticker.cancel()
