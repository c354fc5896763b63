"""The gateway in front of a deliberately faulty upstream (issue 11): one case per fault.

Each case runs a real gateway (uvicorn, tiny timeouts where the fault needs one) in front
of `faulty_upstream.FaultyUpstream` and checks what the client gets — a 502/504 with an
OpenAI-style body that names the upstream by its configured name only, a cut stream, or
the right answer — and that afterwards nothing is in flight and the outcome identities
hold on /metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import anyio
import httpx
import pytest
from helpers.faulty_upstream import FaultyUpstream, faulty_upstream
from helpers.gateway import assert_conserved, gw_config, scrape, serve, total

from kneegate.controllers.base import Sample
from kneegate.gateway.app import KneegateApp, build_app
from kneegate.gateway.config.gateway import GatewayConfig

pytestmark = pytest.mark.anyio

FAST = {"connect": 0.2, "first_byte": 0.5, "idle": 0.3}


class Gw:
    def __init__(self, app: KneegateApp, url: str, client: httpx.AsyncClient) -> None:
        self.app, self.url, self.client = app, url, client

    async def post(self, path: str = "/v1/completions", **body: Any) -> httpx.Response:
        return await self.client.post(self.url + path, json=body)

    async def metrics(self) -> dict[Any, float]:
        return scrape((await self.client.get(self.url + "/metrics")).text)

    async def settled(self) -> dict[Any, float]:
        """/metrics once nothing is in flight; the identities checked."""
        with anyio.fail_after(3):
            while total(m := await self.metrics(), "kneegate_in_flight"):
                await asyncio.sleep(0.01)
        assert_conserved(m)
        return m

    async def ready(self) -> int:
        return (await self.client.get(self.url + "/ready")).status_code


@contextlib.asynccontextmanager
async def gateway(cfg: GatewayConfig) -> AsyncIterator[Gw]:
    app = build_app(cfg)
    async with serve(app) as url, httpx.AsyncClient(timeout=5) as client:
        yield Gw(app, url, client)


def upstreams(*ups: FaultyUpstream, limit: int = 4, **extra: Any) -> list[dict[str, Any]]:
    return [{"name": f"e{i}", "url": u.url, "controller": "fixed", "params": {"initial": limit},
             **extra}
            for i, u in enumerate(ups)]


def assert_public_error(r: httpx.Response, status: int, code: str, up: FaultyUpstream) -> None:
    """An OpenAI-style error naming the upstream by its name: no address, no Python."""
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == code
    assert "upstream 'e0'" in err["message"]
    port = up.url.rsplit(":", 1)[1]
    for internal in (port, "127.0.0.1", "Error(", "Errno", "http://"):
        assert internal not in r.text, (internal, r.text)


# --- one fault, one answer --------------------------------------------------------------

ANSWERED = [  # mode, status, code
    ("refused", 502, "upstream_unreachable"),
    ("blackhole", 504, "upstream_timeout"),
    ("reset_before_headers", 502, "upstream_error"),
    ("hang_before_headers", 504, "upstream_timeout"),
    ("garbage", 502, "upstream_error"),
    ("huge_headers", 502, "upstream_error"),
    ("switching_101", 502, "upstream_error"),
]


@pytest.mark.parametrize(("mode", "status", "code"), ANSWERED, ids=[a[0] for a in ANSWERED])
async def test_a_fault_before_the_response_is_a_clean_error(
    mode: str, status: int, code: str,
) -> None:
    async with faulty_upstream(mode) as up, gateway(gw_config(up.url, timeouts=FAST)) as gw:
        with anyio.fail_after(3):
            r = await gw.post(max_tokens=1)
        assert_public_error(r, status, code, up)
        m = await gw.settled()
        assert total(m, "kneegate_requests_finished_total", outcome="upstream_error") == 1


CUT = ["reset_mid_body", "stall_mid_stream", "short_content_length"]


@pytest.mark.parametrize("mode", CUT)
async def test_a_fault_mid_response_cuts_the_client_off(relay: str, mode: str) -> None:
    async with faulty_upstream(mode) as up, gateway(gw_config(up.url, timeouts=FAST)) as gw:
        with anyio.fail_after(3), pytest.raises(httpx.RemoteProtocolError):
            await gw.post(max_tokens=1, stream=True)  # the head came: only a cut can tell
        m = await gw.settled()
        assert total(m, "kneegate_requests_finished_total", outcome="upstream_error") == 1


async def test_interim_responses_reach_nobody_and_the_final_one_its_client() -> None:
    async with faulty_upstream("interim_1xx") as up, gateway(gw_config(up.url)) as gw:
        for n in (1, 2):
            r = await gw.post(max_tokens=1)
            assert (r.status_code, r.json()) == (200, {"n": n})
            assert "link" not in r.headers
        m = await gw.settled()
        assert total(m, "kneegate_requests_finished_total", outcome="completed") == 2


async def test_an_unsolicited_response_never_reaches_the_next_client() -> None:
    async with faulty_upstream("unsolicited") as up, gateway(gw_config(up.url)) as gw:
        assert (await gw.post(max_tokens=1)).json() == {"n": 1}
        with anyio.fail_after(2):
            await up.unsolicited_sent.wait()  # in the gateway's pooled connection now
        r = await gw.post(max_tokens=1)
        assert (r.status_code, r.json()) == (200, {"n": 2})  # its own, not {"stolen": true}
        assert up.connections == 2
        await gw.settled()


async def test_a_slow_drip_within_the_idle_timeout_is_relayed_whole(relay: str) -> None:
    # ~35 bytes 30 ms apart: about 1 s in all, over three times the 0.3 s idle timeout
    async with faulty_upstream("slow_drip", drip=0.03) as up, \
            gateway(gw_config(up.url, timeouts=FAST)) as gw:
        with anyio.fail_after(5):
            r = await gw.post(max_tokens=1, stream=True)
        assert r.status_code == 200
        assert r.content == b'data: {"n": 1}\n\ndata: [DONE]\n\n'
        m = await gw.settled()
        assert total(m, "kneegate_requests_finished_total", outcome="completed") == 1


# --- an unreachable upstream is left for one that answers (defect 3) -----------------------

async def test_a_refused_connect_moves_the_request_to_another_upstream() -> None:
    async with faulty_upstream("refused") as dead, faulty_upstream("ok") as ok:
        cfg = gw_config(upstreams=upstreams(dead, ok))
        async with gateway(cfg) as gw:
            e0 = gw.app.gateway.pool.active[0]
            samples: list[Sample] = []
            e0.controller.on_sample = samples.append  # type: ignore[method-assign]
            for _ in range(3):
                r = await gw.post(max_tokens=1)
                assert r.status_code == 200, r.text
            assert not e0.usable and samples == []  # no latency sample from a connect failure
            m = await gw.settled()
            assert total(m, "kneegate_upstream_reroutes_total", upstream="e0") == 1
            assert total(m, "kneegate_requests_admitted_total") == 3
            assert total(m, "kneegate_requests_finished_total", outcome="completed") == 3
            assert total(m, "kneegate_requests_finished_total", upstream="e1") == 3


async def test_a_connect_timeout_takes_the_upstream_out_of_rotation() -> None:
    async with faulty_upstream("blackhole") as dead, faulty_upstream("ok") as ok:
        cfg = gw_config(upstreams=upstreams(dead, ok), timeouts=FAST)
        async with gateway(cfg) as gw:
            for _ in range(4):
                with anyio.fail_after(2):
                    r = await gw.post(max_tokens=1)
                assert r.status_code == 200, r.text
            e0 = gw.app.gateway.pool.active[0]
            assert not e0.usable and not e0.healthy
            assert await gw.ready() == 200
            m = await gw.settled()
            assert total(m, "kneegate_upstream_reroutes_total", upstream="e0") == 1
            assert total(m, "kneegate_requests_finished_total", outcome="completed") == 4


async def test_an_upstream_killed_under_load_sends_nobody_a_502() -> None:
    async with faulty_upstream("ok") as a, faulty_upstream("ok") as b, gateway(
            gw_config(upstreams=upstreams(a, b, limit=8))) as gw:
        async def burst() -> list[int]:
            rs = await asyncio.gather(*(gw.post(max_tokens=1) for _ in range(8)))
            return [r.status_code for r in rs]

        with anyio.fail_after(5):
            assert await burst() == [200] * 8
            assert a.requests > 0 and b.requests > 0  # both in use, connections pooled
            a.kill()
            assert await burst() == [200] * 8
        m = await gw.settled()
        assert total(m, "kneegate_requests_finished_total", outcome="completed") == 16


async def test_with_no_other_upstream_a_refused_connect_is_a_502() -> None:
    async with faulty_upstream("refused") as dead, gateway(gw_config(dead.url)) as gw:
        samples: list[Sample] = []
        e0 = gw.app.gateway.pool.active[0]
        e0.controller.on_sample = samples.append  # type: ignore[method-assign]
        assert_public_error(await gw.post(), 502, "upstream_unreachable", dead)
        assert samples == []
        m = await gw.settled()
        assert total(m, "kneegate_upstream_reroutes_total") == 0


# --- /ready and a frozen engine (defects 11 and 6) -------------------------------------------

async def test_ready_waits_for_an_upstream_that_answered() -> None:
    async with faulty_upstream("refused") as dead, gateway(gw_config(dead.url)) as gw:
        e0 = gw.app.gateway.pool.active[0]
        with anyio.fail_after(2):  # the start-up probe has its verdict
            while e0.busy:
                await asyncio.sleep(0.01)
        assert await gw.ready() == 503  # never contacted successfully: not ready
        assert not e0.confirmed and e0.usable  # unknown, and still tried by admission
    async with faulty_upstream("ok") as up, gateway(gw_config(up.url)) as gw:
        assert gw.app.gateway.pool.active[0].confirmed  # probed at start-up
        assert await gw.ready() == 200


async def test_a_frozen_engine_is_taken_out_and_comes_back_when_it_answers() -> None:
    async with faulty_upstream("freezable") as up:
        cfg = gw_config(upstreams=upstreams(up, scrape=True, scrape_interval=0.05,
                                            stale_after=0.1, stall_after=0.3))
        async with gateway(cfg) as gw:
            assert await gw.ready() == 200
            up.freeze()  # SIGSTOP: connects succeed, nothing answers
            stuck = asyncio.create_task(gw.post(max_tokens=1))
            with anyio.fail_after(5):
                while await gw.ready() != 503:
                    await asyncio.sleep(0.02)
            e0 = gw.app.gateway.pool.active[0]
            assert e0.frozen and e0.healthy and e0.inflight == 1
            r = await gw.post(max_tokens=1)
            assert r.status_code == 503 and r.json()["error"]["code"] == "no_upstream"
            up.thaw()  # SIGCONT
            with anyio.fail_after(5):
                assert (await stuck).json() == {"n": 1}
                while await gw.ready() != 200:
                    await asyncio.sleep(0.02)
            assert not e0.frozen
            assert json.loads((await gw.post(max_tokens=1)).content) == {"n": 2}
            await gw.settled()


async def test_a_client_gone_while_a_valve_refusal_is_read_closes_its_connection(
    relay: str,
) -> None:
    # the body read of a small 503 (is it vLLM's valve?) is cancelled by the client
    # leaving: the upstream connection must be closed, not leaked
    async with faulty_upstream("valve_stall") as up, gateway(gw_config(up.url)) as gw:
        host, port = gw.url.removeprefix("http://").split(":")
        _, writer = await asyncio.open_connection(host, int(port))
        body = b'{"prompt": "hi", "max_tokens": 1}'
        writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: "
                     b"application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        with anyio.fail_after(3):
            while up.requests == 0:  # the engine has it, and is sending half its refusal
                await asyncio.sleep(0.01)
        writer.close()
        with anyio.fail_after(3):
            await up.peer_closed.wait()
        m = await gw.settled()
        assert total(m, "kneegate_requests_finished_total", outcome="client_cancelled") == 1
        assert total(m, "kneegate_requests_received_total") == 1
        assert await gw.ready() == 200  # the gateway serves on


def test_the_upstream_head_limit_comes_from_the_config() -> None:
    cfg = gw_config("http://127.0.0.1:9", limits={"max_upstream_header_bytes": 4 << 20})
    assert build_app(cfg).gateway.client.max_header_bytes == 4 << 20
    assert build_app(gw_config("http://127.0.0.1:9")).gateway.client.max_header_bytes == 65536
