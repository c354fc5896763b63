"""What one ordinary client can do to everyone else (issue 44's table, re-run).

    python -m kneegate_bench.hostile                      # every case, ~6 minutes
    python -m kneegate_bench.hostile --cases padded,keys  # some of them

Each case gets a fresh emulator (`--profile`, cpu-tiny) and a fresh `kneegate serve
--upstream URL` (nothing else: untuned). `--clients` (32) honest users stream the uniform
request in a closed loop for the whole case; after `--warmup` s the gateway's limit and
demand ratio are read and the honest completions counted for `--seconds` ("before"), then the
attack runs for `--seconds` while they are counted again ("during"), and the limit, demand
ratio and the gateway's resident memory are read once more ("after"). Compare each case's
"x" (during / before) with the `none` case's: the honest load's own drift between windows.
The attacks:

    none            nothing (the control)
    padded          one request: 8 prompt tokens, max_tokens 2000, 6 MiB of JSON whitespace
    refused-padded  three requests padded to 8x the honest body, each with a 1 ms objective
                    of its own (refused: no first token can come that soon)
    models-flood    8 loops of GET /v1/models
    ttft-header     8 loops of the honest request with `x-kneegate-ttft-ms: 1`
    keys            4,000 requests, each with its own ~60 KB bearer key (8 at a time)

The goals (issue 44): honest completions during >= 0.95x before; the limit and demand ratio
unmoved (within 10%) by padded, refused and non-generation requests; resident memory
growth <= 20 MB after the keys. Every loop is bounded in count and time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from kneegate_bench.openloop import Record, _Client, fetch_metrics, metric_totals
from kneegate_bench.overhead import _free_port, _process

__all__ = ["CASES", "main"]

PAD = 6 << 20  # bytes of whitespace in the padded request
KEY_BYTES = 60_000
KEYS = 4000


@dataclass
class Reading:
    limit: float | None = None
    demand: float | None = None
    rss_mb: float | None = None


@dataclass
class Result:
    case: str
    before: float = 0.0  # honest completions a second
    during: float = 0.0
    start: Reading = field(default_factory=Reading)
    end: Reading = field(default_factory=Reading)
    answers: Counter[int] = field(default_factory=Counter)


@contextlib.contextmanager
def _stack(profile: str) -> Iterator[tuple[str, int]]:
    """A fresh emulator and gateway; yields the gateway's URL and process id."""
    ep, gp = _free_port(), _free_port()
    engine = [sys.executable, "-m", "kneegate.emulator", "--profile", profile,
              "--port", str(ep)]
    gateway = [sys.executable, "-m", "kneegate", "serve", "--upstream",
               f"http://127.0.0.1:{ep}", "--port", str(gp)]
    with _process(engine, ep), _process(gateway, f"http://127.0.0.1:{gp}/health") as gw:
        yield f"http://127.0.0.1:{gp}", gw.pid


def _read(url: str, pid: int) -> Reading:
    totals = metric_totals(fetch_metrics(url))
    rss = None
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) / 1024
    return Reading(totals.get("kneegate_limit"), totals.get("kneegate_demand_ratio"), rss)


# -- the attacks: each runs until `until` (loop time), bounded in count -----------------------

Attack = Callable[[aiohttp.ClientSession, str, dict[str, Any], float, Counter[int]],
                  Awaitable[None]]


async def _post(session: aiohttp.ClientSession, url: str, data: bytes, answers: Counter[int],
                headers: dict[str, str] | None = None) -> None:
    hdrs = {"content-type": "application/json", **(headers or {})}
    try:
        # a file-like body: aiohttp sends it in pieces (raw bytes of megabytes would hold
        # the event loop, and it warns so), with its Content-Length all the same
        async with session.post(url + "/v1/completions", data=io.BytesIO(data),
                                headers=hdrs) as resp:
            answers[resp.status] += 1
            await resp.read()
    except (aiohttp.ClientError, OSError):
        answers[0] += 1  # no answer: the connection broke


async def padded(session: aiohttp.ClientSession, url: str, honest: dict[str, Any],
                 until: float, answers: Counter[int]) -> None:
    body = {**honest, "prompt": honest["prompt"][:8], "max_tokens": 2000}
    data = json.dumps(body).encode()[:-1] + b" " * PAD + b"}"
    with contextlib.suppress(TimeoutError):  # it streams for ~2 minutes: cut at the end
        await asyncio.wait_for(_post(session, url, data, answers),
                               max(1.0, until - asyncio.get_running_loop().time()))


async def refused_padded(session: aiohttp.ClientSession, url: str, honest: dict[str, Any],
                         until: float, answers: Counter[int]) -> None:
    data = json.dumps(honest).encode()
    data = data[:-1] + b" " * (7 * len(data)) + b"}"
    for _ in range(3):
        await _post(session, url, data, answers, {"x-kneegate-ttft-ms": "1"})


async def _loops(n: int, until: float, one: Callable[[], Awaitable[None]],
                 most: int = 1_000_000) -> None:
    loop = asyncio.get_running_loop()
    sent = 0

    async def run() -> None:
        nonlocal sent
        while loop.time() < until and sent < most:
            sent += 1
            await one()

    await asyncio.gather(*(run() for _ in range(n)))


async def models_flood(session: aiohttp.ClientSession, url: str, honest: dict[str, Any],
                       until: float, answers: Counter[int]) -> None:
    async def one() -> None:
        async with session.get(url + "/v1/models") as resp:
            answers[resp.status] += 1
            await resp.read()

    await _loops(8, until, one)


async def ttft_header(session: aiohttp.ClientSession, url: str, honest: dict[str, Any],
                      until: float, answers: Counter[int]) -> None:
    data = json.dumps(honest).encode()
    await _loops(8, until, lambda: _post(session, url, data, answers,
                                         {"x-kneegate-ttft-ms": "1"}))


async def keys(session: aiohttp.ClientSession, url: str, honest: dict[str, Any],
               until: float, answers: Counter[int]) -> None:
    count = 0

    async def one() -> None:
        nonlocal count
        count += 1
        key = f"{count:08d}" * (KEY_BYTES // 8)
        await _post(session, url, b"{not json", answers, {"authorization": f"Bearer {key}"})

    await _loops(8, until + 60.0, one, most=KEYS)  # all of them, however long they take


async def none(session: aiohttp.ClientSession, url: str, honest: dict[str, Any],
               until: float, answers: Counter[int]) -> None:
    """No attack: what the honest load does by itself from one window to the next."""


CASES: dict[str, Attack] = {
    "none": none, "padded": padded, "refused-padded": refused_padded, "models-flood": models_flood,
    "ttft-header": ttft_header, "keys": keys,
}


# -- one case --------------------------------------------------------------------------------


async def _case(name: str, url: str, pid: int, args: argparse.Namespace) -> Result:
    res = Result(name)
    loop = asyncio.get_running_loop()
    conn = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
    done: list[float] = []  # loop times of honest completions
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
        client = _Client(session, url, args, (0.0, float("inf")))
        stop = loop.time() + args.warmup + 2 * args.seconds

        async def user(i: int) -> None:
            # first requests spread over about one answer's time: no waves of completions
            await asyncio.sleep(2.0 * i / args.clients)
            while loop.time() < stop:
                rec = Record(measured=True)
                await client.one(rec)
                if rec.done:
                    done.append(loop.time())
                elif rec.status != 200:
                    await asyncio.sleep(0.2)  # refused: honest users wait a little

        users = [asyncio.create_task(user(i)) for i in range(args.clients)]
        t0 = loop.time() + args.warmup
        await asyncio.sleep(args.warmup)
        res.start = await asyncio.to_thread(_read, url, pid)
        await asyncio.sleep(args.seconds)
        t1 = loop.time()
        await CASES[name](session, url, client.body, t1 + args.seconds, res.answers)
        await asyncio.sleep(max(0.0, t1 + args.seconds - loop.time()))
        t2 = loop.time()
        res.end = await asyncio.to_thread(_read, url, pid)
        for task in users:
            task.cancel()
        await asyncio.gather(*users, return_exceptions=True)
    res.before = sum(t0 <= t < t1 for t in done) / (t1 - t0)
    res.during = sum(t1 <= t < t2 for t in done) / (t2 - t1)
    return res


def _f(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kneegate_bench.hostile",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--clients", type=int, default=32, help="honest closed-loop users")
    ap.add_argument("--warmup", type=float, default=15.0)
    ap.add_argument("--seconds", type=float, default=20.0, help="before, and during")
    ap.add_argument("--profile", default="cpu-tiny")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--give-up", type=float, default=20.0)
    ap.add_argument("--request-timeout", type=float, default=60.0)
    ap.add_argument("--model")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    print(f"{'case':<15} {'honest/s before':>15} {'during':>7} {'x':>5} {'limit':>11} "
          f"{'demand ratio':>13} {'RSS MB':>11}  attack answers", flush=True)
    for name in (c.strip() for c in args.cases.split(",")):
        started = time.monotonic()
        with _stack(args.profile) as (url, pid):
            r = asyncio.run(_case(name, url, pid, args))
        ratio = r.during / r.before if r.before else None
        print(f"{name:<15} {r.before:>15.1f} {r.during:>7.1f} {_f(ratio, '.2f'):>5} "
              f"{_f(r.start.limit, '.0f'):>5}->{_f(r.end.limit, '.0f'):<5} "
              f"{_f(r.start.demand, '.2f'):>6}->{_f(r.end.demand, '.2f'):<6} "
              f"{_f(r.start.rss_mb, '.0f'):>5}->{_f(r.end.rss_mb, '.0f'):<5}  "
              f"{dict(sorted(r.answers.items()))}  ({time.monotonic() - started:.0f} s)",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
