"""`kneegate demo`: the emulator, a gateway in front of it, and a load ramp past the knee.

Everything runs in this process on loopback sockets: the emulator (`cpu-tiny` profile,
loaded lazily from `benchmarks`), the gateway with the chosen controller, and closed-loop
streaming clients whose number climbs step by step to `peak`. Rejected clients honour
Retry-After (capped at 2 s). Once a second it prints what reached the engine (running and
waiting, from the emulator's own /metrics) next to what the gateway held back (queued,
shed with 429, timed out with 503). Bounded: `seconds` of wall time, `max_requests` in all.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass, field
from typing import Any

from gateway.app import build_app
from gateway.config import parse_config
from gateway.server import serving
from gateway.telemetry import parse_engine_metrics
from gateway.upstream_client import UpstreamClient

__all__ = ["run_demo"]

_BODY = json.dumps({"model": "cpu-tiny", "prompt": "tell me a story " * 8,
                    "max_tokens": 64, "stream": True}).encode()


@dataclass
class _Tally:
    ok: int = 0
    shed: int = 0
    timed_out: int = 0
    failed: int = 0
    ttfts: list[float] = field(default_factory=list)

    def take(self) -> _Tally:
        out = _Tally(self.ok, self.shed, self.timed_out, self.failed, self.ttfts)
        self.ok = self.shed = self.timed_out = self.failed = 0
        self.ttfts = []
        return out


async def _client(client: UpstreamClient, gw: str, tally: _Tally, stop: asyncio.Event,
                  budget: list[int]) -> None:
    headers = [(b"content-type", b"application/json")]
    while not stop.is_set() and budget[0] > 0:
        budget[0] -= 1
        start = time.monotonic()
        resp = await client.open("POST", gw, b"/v1/completions", headers, _BODY)
        first = await resp.read()
        if resp.status != 200:
            await resp.read_all()
            resp.release()
            tally.shed += resp.status == 429
            tally.timed_out += resp.status == 503
            tally.failed += resp.status not in (429, 503)
            retry = dict(resp.headers).get(b"retry-after", b"1")
            await asyncio.sleep(min(2.0, float(retry)))
            continue
        tally.ttfts.append(time.monotonic() - start)
        while first:
            first = await resp.read()
        resp.release()
        tally.ok += 1


def _line(t: float, clients: int, engine: tuple[float, float], gw: dict[str, Any],
          tally: _Tally, max_seqs: int) -> str:
    ttft = sorted(tally.ttfts)
    p50 = f"{ttft[len(ttft) // 2] * 1000:.0f}ms" if ttft else "-"
    up = gw["upstreams"][0]
    knee = up["controller"].get("knee_estimate")
    if not isinstance(knee, (int, float)):
        knee_s = "-"
    elif knee > max_seqs:  # only a bound so far (e.g. KV room): the engine runs no more
        knee_s = f">{max_seqs}"
    else:
        knee_s = f"{knee:.0f}"
    return (f"{t:5.0f}s {clients:7d} {engine[0]:7.0f} {engine[1]:7.0f} {up['limit']:7d}"
            f" {knee_s:>6} {up['in_flight']:8d} {gw['queue_total']:6d} {tally.ok:6d}"
            f" {tally.shed:6d} {tally.timed_out:6d} {p50:>8}")


_PROFILE = "cpu-tiny"  # the embedded default engine
_HEADER = (f"{'t':>6} {'clients':>7} {'running':>7} {'waiting':>7} {'limit':>7} {'knee':>6} "
           f"{'inflight':>8} {'queued':>6} {'done':>6} {'429s':>6} {'503s':>6} {'ttft p50':>8}")


async def _engine_load(client: UpstreamClient, up: str) -> tuple[float, float]:
    _, text = await client.get_text(up + "/metrics", timeout=2)
    stats = parse_engine_metrics(text, 0.0)
    return (stats.running, stats.waiting) if stats else (float("nan"), float("nan"))


async def _demo(seconds: float, limit: int, peak: int, controller: str,
                max_requests: int) -> None:
    from benchmarks.engine.profiles import load_profile
    from benchmarks.engine.server import build_app as build_engine

    max_seqs = load_profile(_PROFILE).engine.max_num_seqs
    async with serving(build_engine(_PROFILE), log_level="error") as up:
        cfg = parse_config({
            "upstreams": [{"name": "emulator", "url": up, "controller": controller,
                           "params": {"initial": limit}, "scrape": True}],
            "max_queue": max(4, limit), "classes": {"default": {"max_wait": 3.0}}})
        gateway = build_app(cfg)
        async with serving(gateway, log_level="error") as gw:
            await _ramp(gw, up, gateway.gateway.status, seconds, peak, max_requests, max_seqs)


async def _ramp(gw: str, up: str, status: Any, seconds: float, peak: int,
                max_requests: int, max_seqs: int) -> None:
    client = UpstreamClient(connect_timeout=5)
    tally, stop, budget = _Tally(), asyncio.Event(), [max_requests]
    steps = sorted({1, 2, 4, *range(8, peak + 1, 8), peak})
    per_step = seconds / len(steps)
    tasks: list[asyncio.Task[None]] = []
    most_in_engine = most_limit = 0.0
    print("engine: running/waiting as the emulator reports them; gateway: limit, knee "
          "estimate, inflight, queued; clients: done, shed (429), timed out (503) per second")
    print(f"watch it live: {gw}/kneegate/")
    print(_HEADER)
    start = time.monotonic()
    try:
        for n in steps:
            while len(tasks) < n:
                tasks.append(asyncio.create_task(_client(client, gw, tally, stop, budget)))
            step_end = start + per_step * (steps.index(n) + 1)
            while (now := time.monotonic()) < step_end:
                await asyncio.sleep(min(1.0, step_end - now))
                engine, gw_status = await _engine_load(client, up), status()
                most_in_engine = max(most_in_engine, engine[0] + engine[1])
                most_limit = max(most_limit, gw_status["upstreams"][0]["limit"])
                print(_line(now - start, n, engine, gw_status, tally.take(), max_seqs),
                      flush=True)
    finally:
        stop.set()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await client.close()
    print(f"at most {most_in_engine:.0f} requests were inside the engine (running + waiting, "
          f"sampled once a second) with the limit peaking at {most_limit:.0f}; the other "
          f"clients waited in the gateway's queue or were told when to retry")


def run_demo(seconds: float = 60.0, limit: int = 8, peak: int = 96, controller: str = "knee",
             max_requests: int = 100_000) -> int:
    """Run the demo in this process; returns an exit status."""
    import uvloop

    with contextlib.suppress(KeyboardInterrupt):
        uvloop.run(_demo(seconds, limit, peak, controller, max_requests))
    return 0
