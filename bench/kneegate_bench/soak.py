"""Soak: sustained overload through a real gateway; memory, file descriptors, counting.

    python -m kneegate_bench.soak --seconds 300          # ~5.5 minutes; exits 1 on a failure
    pytest -m slow tests/bench/test_soak.py     # the same, 90 s

The emulator (`cpu-tiny`) and `kneegate serve` run as their own processes on loopback. The
engine's capacity is measured first (closed loop, direct, 64 streams); then Poisson arrivals
at `--overload` times that rate go through the gateway for `--seconds`: 80% streamed, of
which `--hangup` (5%) hang up after the first event, the rest not streamed. Every second
the gateway's /metrics is scraped and the two identities are checked:

    received = admitted + shed + queue_timeout + queue_depth
    admitted = finished (every outcome) + in_flight

Every `--sample-every` seconds the gateway's RSS and open file descriptors are read from
/proc. At the end, once the load has stopped and in-flight is back to 0, it prints the
samples and start / end / peak, and fails when an identity broke, in-flight did not return
to 0, or RSS grew after the warm-up (the first third) by more than `--rss-growth` (20%) and
8 MiB, or open fds stayed more than 48 above where they started once the clients left (idle
keep-alive connections to the engine, up to the limit, stay open).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from kneegate_bench.loadgen import LoadConfig, closed_loop
from kneegate_bench.openloop import metric_totals
from kneegate_bench.overhead import _free_port, _process

__all__ = ["SoakResult", "main", "run_soak"]

_FINISHED_LIMIT = 30.0  # seconds the gateway gets to drain after the load stops
# fds a healthy gateway may hold beyond its start: idle keep-alive connections to the engine
# (at most its concurrency limit, 32 by default) and a few more
_FD_SLACK = 48


@dataclass
class SoakResult:
    capacity_rps: float = 0.0
    offered: int = 0
    answers: dict[str, int] = field(default_factory=dict)
    scrapes: int = 0
    violations: list[str] = field(default_factory=list)
    samples: list[tuple[float, int, int]] = field(default_factory=list)  # (t, rss KiB, fds)
    final_in_flight: float = -1.0
    failures: list[str] = field(default_factory=list)


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def _fds(pid: int) -> int:
    return len(list(Path(f"/proc/{pid}/fd").iterdir()))


def identity_errors(m: dict[str, float]) -> list[str]:
    """What breaks the two counting identities in one scrape (summed over labels)."""
    def g(name: str) -> float:
        return m.get(name, 0.0)

    received = g("kneegate_requests_received_total") + g("kneegate_requests_requeued_total")
    admitted = g("kneegate_requests_admitted_total")
    rest = (g("kneegate_requests_shed_total") + g("kneegate_requests_queue_timeout_total")
            + g("kneegate_queue_depth"))
    finished = g("kneegate_requests_finished_total") + g("kneegate_in_flight")
    errors = []
    if received != admitted + rest:
        errors.append(f"received + requeued {received:g} != admitted {admitted:g} "
                      f"+ shed/timeout/queued {rest:g}")
    if admitted != finished:
        errors.append(f"admitted {admitted:g} != finished + in flight {finished:g}")
    return errors


class _Load:
    """Open-loop arrivals through the gateway, bounded in count and time."""

    def __init__(self, session: aiohttp.ClientSession, url: str, rng: random.Random,
                 hangup: float) -> None:
        self.session, self.url, self.rng, self.hangup = session, url, rng, hangup
        self.answers: dict[str, int] = {}
        self.tasks: set[asyncio.Task[None]] = set()

    def _count(self, key: str) -> None:
        self.answers[key] = self.answers.get(key, 0) + 1

    async def one(self) -> None:
        stream = self.rng.random() < 0.8
        hang = stream and self.rng.random() < self.hangup
        body = {"model": "cpu-tiny", "prompt": [100 + i for i in range(128)], "max_tokens": 64,
                "stream": stream, "ignore_eos": True}
        try:
            async with asyncio.timeout(60), self.session.post(self.url, json=body) as r:
                if r.status != 200 or not stream:
                    await r.read()
                    self._count(str(r.status))
                    return
                async for _line in r.content:
                    if hang:  # the first event, then the user closes the tab
                        r.close()
                        self._count("hung_up")
                        return
                self._count("200")
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            self._count(type(exc).__name__)

    async def run(self, rate: float, seconds: float, max_requests: int) -> int:
        t0 = time.monotonic()
        sent = 0
        next_at = t0
        while sent < max_requests and (now := time.monotonic()) - t0 < seconds:
            if now < next_at:
                await asyncio.sleep(next_at - now)
            task = asyncio.create_task(self.one())
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
            sent += 1
            next_at += self.rng.expovariate(rate)
        return sent


async def _watch(session: aiohttp.ClientSession, base: str, pid: int, res: SoakResult,
                 stop: asyncio.Event, sample_every: float, t0: float) -> None:
    next_sample = 0.0
    while not stop.is_set():
        async with session.get(base + "/metrics") as r:
            m = metric_totals(await r.text())
        res.scrapes += 1
        res.violations += [f"t={time.monotonic() - t0:.0f}s {e}" for e in identity_errors(m)]
        elapsed = time.monotonic() - t0
        if elapsed >= next_sample:
            res.samples.append((elapsed, _rss_kib(pid), _fds(pid)))
            next_sample += sample_every
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 1.0)


async def _drain(session: aiohttp.ClientSession, base: str) -> float:
    deadline = time.monotonic() + _FINISHED_LIMIT
    while True:
        async with session.get(base + "/metrics") as r:
            inflight = metric_totals(await r.text()).get("kneegate_in_flight", 0.0)
        if inflight == 0 or time.monotonic() > deadline:
            return inflight
        await asyncio.sleep(0.2)


async def _soak(engine: str, gateway: str, pid: int, args: argparse.Namespace) -> SoakResult:
    res = SoakResult()
    cap = await closed_loop(LoadConfig(url=engine, max_tokens=64, max_seconds=6.0,
                                       warmup=2.0), 64)
    # tokens/s over the answer's length: requests that started in the warm-up count too
    res.capacity_rps = float(cap.summary()["throughput_tok_s"]) / 64
    rate = args.overload * res.capacity_rps
    if rate <= 0:
        raise RuntimeError("the engine completed nothing in the capacity run")
    print(f"engine capacity {res.capacity_rps:.1f} req/s; offering {rate:.0f} req/s "
          f"({args.overload:g}x) for {args.seconds:g}s", flush=True)
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as session:
        load = _Load(session, gateway + "/v1/completions", random.Random(args.seed), args.hangup)
        stop = asyncio.Event()
        t0 = time.monotonic()
        watch = asyncio.create_task(
            _watch(session, gateway, pid, res, stop, args.sample_every, t0))
        res.offered = await load.run(rate, args.seconds, int(rate * args.seconds * 2) + 10)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(70):  # each request is bounded at 60 s
                await asyncio.gather(*load.tasks, return_exceptions=True)
        res.final_in_flight = await _drain(session, gateway)
        stop.set()
        await watch
        res.answers = load.answers
    # the clients' keep-alive connections are closed now: give the gateway a moment to see
    # the last of them go (bounded), then the final sample
    deadline = time.monotonic() + 5
    while _fds(pid) > res.samples[0][2] + _FD_SLACK and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    res.samples.append((time.monotonic() - t0, _rss_kib(pid), _fds(pid)))
    return res


def judge(res: SoakResult, rss_growth: float) -> list[str]:
    """The failures of one soak (empty: it passed)."""
    failures = list(res.violations[:5])
    if res.final_in_flight != 0:
        failures.append(f"in flight did not return to 0 (reads {res.final_in_flight:g})")
    if len(res.samples) >= 3:
        warm = res.samples[max(1, len(res.samples) // 3)]
        end = res.samples[-1]
        limit = max(warm[1] * (1 + rss_growth), warm[1] + 8 * 1024)
        if end[1] > limit:
            failures.append(f"RSS grew after warm-up: {warm[1] / 1024:.1f} -> "
                            f"{end[1] / 1024:.1f} MiB")
        if end[2] > res.samples[0][2] + _FD_SLACK:
            failures.append(f"open fds {res.samples[0][2]} at the start, {end[2]} at the end")
    return failures


def report(res: SoakResult) -> None:
    print(f"{'t (s)':>6} {'RSS MiB':>8} {'fds':>5}")
    for t, kib, n in res.samples:
        print(f"{t:6.0f} {kib / 1024:8.1f} {n:5d}")
    rss = [s[1] / 1024 for s in res.samples]
    fds = [s[2] for s in res.samples]
    print(f"RSS start {rss[0]:.1f} MiB, end {rss[-1]:.1f}, peak {max(rss):.1f}; "
          f"fds start {fds[0]}, end {fds[-1]}, peak {max(fds)}")
    print(f"offered {res.offered}; answers {dict(sorted(res.answers.items()))}")
    print(f"{res.scrapes} scrapes, {len(res.violations)} identity violations; "
          f"in flight at the end {res.final_in_flight:g}")


@contextlib.contextmanager
def _processes(extra: list[str]) -> Iterator[tuple[str, str, int]]:
    ep, gp = _free_port(), _free_port()
    engine_cmd = [sys.executable, "-m", "kneegate.emulator", "--profile", "cpu-tiny",
                  "--port", str(ep)]
    gw_cmd = [sys.executable, "-m", "kneegate", "serve", "--upstream",
              f"http://127.0.0.1:{ep}", "--port", str(gp), *extra]
    with _process(engine_cmd, ep), _process(gw_cmd, f"http://127.0.0.1:{gp}/health") as gw:
        yield f"http://127.0.0.1:{ep}", f"http://127.0.0.1:{gp}", gw.pid


def run_soak(args: argparse.Namespace) -> SoakResult:
    with _processes(args.gateway_args) as (engine, gateway, pid):
        res = asyncio.run(_soak(engine, gateway, pid, args))
    res.failures = judge(res, args.rss_growth)
    return res


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m kneegate_bench.soak", description=__doc__)
    ap.add_argument("--seconds", type=float, default=300.0, help="length of the overload")
    ap.add_argument("--overload", type=float, default=10.0, help="x the engine's capacity")
    ap.add_argument("--hangup", type=float, default=0.05, help="streams hung up mid-way")
    ap.add_argument("--sample-every", type=float, default=10.0, help="RSS/fd sample period")
    ap.add_argument("--rss-growth", type=float, default=0.2, help="allowed after warm-up")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("gateway_args", nargs="*", help="after --: extra `kneegate serve` flags")
    return ap


def main(argv: list[str] | None = None) -> int:
    res = run_soak(parser().parse_args(argv))
    report(res)
    for f in res.failures:
        print(f"FAIL: {f}")
    print("soak passed" if not res.failures else "soak FAILED")
    return 1 if res.failures else 0


if __name__ == "__main__":
    sys.exit(main())
