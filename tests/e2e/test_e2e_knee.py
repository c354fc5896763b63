"""End to end (issue 4): the `knee` limit moves when the engine's capacity changes.

The real gateway (uvicorn) in front of the real emulator (uvicorn, `cpu-tiny` at a quarter
of real time so the event rate stays low on a busy machine), scraped every 0.25 s, under a
closed loop of clients that always wants more than the engine should take. The limit
settles; then the emulator's step times are multiplied by 4 (`POST /admin/slowdown`), each
token now takes 4x as long, the TPOT objective breaks and the limit must come down.

Objectives are set so that there is room on both sides: before the slowdown TPOT is ~50 ms
at 24 clients (objective 100 ms); after it, ~200 ms. Every wait is a condition polled on
/kneegate/status inside `anyio.fail_after`; the client loop is bounded in requests and in
time. About 15 s of wall time: the slow tier (`pytest -m slow tests/e2e/test_e2e_knee.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Iterator
from typing import Any

import anyio
import httpx
import pytest
from helpers.gateway import gw_config, scrape, serve, total

from kneegate.gateway.app import build_app

# slow: 15 s of wall clock on a shared machine (about 1 run in 6 flaked); the same scenario
# in virtual time is tests/sim/test_knee_slowdown_sim.py, in the default suite
pytestmark = [pytest.mark.anyio, pytest.mark.slow]

engine_server = pytest.importorskip("kneegate.emulator.server")

CLIENTS = 24
MAX_REQUESTS = 4000  # the loop's request cap; its time cap is the test's fail_after
SLOWDOWN = 4.0
KNEE = {
    "initial": 4, "max_limit": 64,
    "window": 1.0, "min_samples": 4, "max_window": 3.0,  # seconds-long windows, small quorum
    "tpot_objective": 0.1, "ttft_objective": 30.0,  # TPOT is the signal the slowdown moves
    "backoff": 0.7,
}
REQUEST = {"model": "cpu-tiny", "prompt": "p " * 32, "max_tokens": 16, "stream": True}


class Loop:
    """A closed loop of CLIENTS streaming clients; at most MAX_REQUESTS requests in all."""

    def __init__(self, client: httpx.AsyncClient, gw: str) -> None:
        self.client, self.gw = client, gw
        self.sent = self.ok = 0
        self.stopping = False
        self.tasks = [asyncio.create_task(self._one()) for _ in range(CLIENTS)]

    async def _one(self) -> None:
        while self.sent < MAX_REQUESTS and not self.stopping:
            self.sent += 1
            async with self.client.stream("POST", self.gw + "/v1/completions",
                                          json=REQUEST) as r:
                async for _ in r.aiter_raw():
                    pass
            self.ok += r.status_code == 200

    async def stop(self) -> None:
        """Let every client finish its request (the queue drains), then cancel stragglers."""
        self.stopping = True
        with anyio.move_on_after(30):
            await asyncio.gather(*self.tasks, return_exceptions=True)
        for t in self.tasks:
            t.cancel()
        done = await asyncio.gather(*self.tasks, return_exceptions=True)
        errors = [d for d in done if not isinstance(d, asyncio.CancelledError | type(None))]
        assert not errors, errors


class Watch:
    """Polls /kneegate/status; remembers each limit and since when it has held."""

    def __init__(self, client: httpx.AsyncClient, gw: str) -> None:
        self.client, self.gw = client, gw
        self.limit, self.since = -1, time.monotonic()
        self.up: dict[str, Any] = {}
        self.history: list[tuple[float, int]] = []  # (when, limit) at each change

    async def poll(self) -> dict[str, Any]:
        self.up = (await self.client.get(self.gw + "/kneegate/status")).json()["upstreams"][0]
        if self.up["limit"] != self.limit:
            self.limit, self.since = self.up["limit"], time.monotonic()
            self.history.append((self.since, self.limit))
        await asyncio.sleep(0.1)
        return self.up

    def held_for(self) -> float:
        return time.monotonic() - self.since

    def story(self) -> str:
        """The limit's changes so far, for a failure message."""
        t0 = self.history[0][0] if self.history else 0.0
        steps = ", ".join(f"{t - t0:.1f}s:{limit}" for t, limit in self.history)
        return f"limit history [{steps}]; controller state {self.up.get('controller')}"


@contextlib.contextmanager
def _explained(watch: Watch, what: str) -> Iterator[None]:
    try:
        yield
    except TimeoutError:
        pytest.fail(f"{what}: {watch.story()}")


async def test_knee_limit_settles_then_falls_when_the_engine_slows_down() -> None:
    async with serve(engine_server.build_app("cpu-tiny", speed=0.25)) as up:
        # the class's objective as loose as the controller's: this test is about TPOT moving
        # the limit, not about the queue refusing what cannot make a 2 s first token
        cfg = gw_config(upstreams=[{"name": "e0", "url": up, "controller": "knee",
                                    "params": KNEE, "scrape": True, "scrape_interval": 0.25}],
                        classes={"default": {"ttft_objective": 30.0}})
        async with serve(build_app(cfg)) as gw, httpx.AsyncClient(
                timeout=30, limits=httpx.Limits(max_connections=CLIENTS + 8)) as client:
            loop, watch = Loop(client, gw), Watch(client, gw)
            try:
                # 1. settle: the limit grew out of slow start, learned a curve, and holds
                with _explained(watch, "the limit did not settle within 20 s"), \
                        anyio.fail_after(20):
                    while not (watch.held_for() >= 2.0 and watch.up["controller"]["curve"]
                               and watch.up["engine"]["stale"] is False):
                        await watch.poll()
                settled = watch.limit
                state = watch.up["controller"]
                assert settled > KNEE["initial"], "the limit never grew under demand"
                assert state["curve_of"] == "engine"  # scraped counters make the curve
                assert all(p["throughput"] > 0 for p in state["curve"])

                # 2. capacity drops: every step takes SLOWDOWN x as long
                r = await client.post(up + "/admin/slowdown", json={"factor": SLOWDOWN})
                assert r.status_code == 200
                slowed_at = time.monotonic()
                target = 0.7 * min(settled, CLIENTS)
                with _explained(watch, f"the limit did not fall to {target:g} within 20 s "
                                       f"of the slowdown (settled at {settled})"), \
                        anyio.fail_after(20):
                    while watch.limit > target:
                        await watch.poll()
                fell_in = time.monotonic() - slowed_at
            finally:
                # back to full speed so the clients' last requests drain quickly
                await client.post(up + "/admin/slowdown", json={"factor": 1.0})
                await loop.stop()
            m = scrape((await client.get(gw + "/metrics")).text)
    assert watch.limit <= target < settled
    assert loop.ok > 0
    assert total(m, "kneegate_engine_scrapes_total", outcome="ok") > 0
    assert total(m, "kneegate_limit", upstream="e0") >= 1
    knee = total(m, "kneegate_knee_estimate", upstream="e0")
    assert math.isnan(knee) or knee > 0
    print(f"settled at {settled}, fell to {watch.limit} in {fell_in:.1f}s "
          f"after a {SLOWDOWN:g}x slowdown; {loop.sent} requests")
