"""Open-loop users: Poisson arrivals, each user one streamed request judged by its own clock.

`run_cell` sends the users of one (arm, load) cell and returns their `Record`s; `_Client`
follows one request to its end under the give-up rule; `_watch_gateway` reads a gateway's
/metrics through the measured window (`metric_totals`); `late_ticks` times this loop's own
stalls. Shared by kneegate_bench.overload and the tools built on it (replay, hostile, coldstart).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import random
import time
import urllib.request
from dataclasses import dataclass
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

__all__ = ["Record", "fetch_metrics", "late_ticks", "metric_totals", "parse_keys", "run_cell"]


_MINTED = itertools.count(1)  # the keys minted by `--keys NAME*:SHARE` users


@dataclass(slots=True)
class Record:
    """One user; times in seconds from the moment the request was sent."""

    measured: bool = False  # sent in the measured window
    status: int | None = None
    answer: float | None = None  # the status line
    ttft: float | None = None
    tokens: int = 0
    window_tokens: int = 0  # received in the measured window (by the clock)
    done: bool = False
    gave_up: bool = False
    error: str | None = None
    key: str = ""  # the API key it sent (`--keys`), "" for none
    retry_after: bool = False  # a rejection that said when to come back
    last: float | None = None  # the last token
    prompt: int = 0  # its prompt's tokens, where they vary (`kneegate_bench.replay`)
    reason: str = ""  # a rejection's x-kneegate-reject-reason (a gateway's), else ""
    model: str = ""  # the model its answer named (the first token's chunk), "" before one
    asked: int = 0  # the max_tokens it sent, where answers vary (`--spread`); 0: the fixed one

    @property
    def tpot(self) -> float | None:
        """Seconds per output token after the first, as the user saw them stream."""
        if self.ttft is None or self.last is None or self.tokens < 2:
            return None
        return (self.last - self.ttft) / (self.tokens - 1)


class _Client:
    """One aiohttp session; each user streams one request and keeps to the give-up rule."""

    def __init__(self, session: aiohttp.ClientSession, url: str, args: argparse.Namespace,
                 window: tuple[float, float]):
        self.session, self.args, self.window = session, args, window
        self.endpoint = url.rstrip("/") + "/v1/completions"
        # token ids, as loadgen sends them: the prompt length is exact; as text (LiteLLM
        # takes no ids), 4 bytes a token: exact as the emulator counts text (getattr: the
        # other tools that use this client parse flags of their own)
        text = getattr(args, "text_prompt", False)
        prompt: str | list[int] = ("abcd" * args.prompt_tokens if text else
                                   [100 + i % 1000 for i in range(args.prompt_tokens)])
        self.body = {
            "model": args.model or args.profile,
            "prompt": prompt,
            "max_tokens": args.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
        }

    async def one(self, rec: Record, body: dict[str, Any] | None = None) -> None:
        """Send `body` (default: the fixed one, asking `rec.asked` tokens where that is set)
        as user `rec`, and follow it to its end."""
        if body is None and rec.asked:
            body = {**self.body, "max_tokens": rec.asked}
        loop = asyncio.get_running_loop()
        sent, sent_loop = time.monotonic(), loop.time()
        bearer = rec.key
        if bearer.endswith("*"):  # a client that mints a key per request
            bearer = f"{bearer[:-1]}-{next(_MINTED)}"
        headers = {"authorization": f"Bearer {bearer}"} if bearer else None
        try:
            async with asyncio.timeout(self.args.give_up) as bound:
                async with self.session.post(self.endpoint, json=body or self.body,
                                             headers=headers) as resp:
                    rec.answer, rec.status = time.monotonic() - sent, resp.status
                    if resp.status != 200:
                        rec.retry_after = "retry-after" in resp.headers
                        rec.reason = resp.headers.get("x-kneegate-reject-reason", "")
                        await resp.read()
                        return
                    await self._stream(rec, resp, sent, bound, sent_loop)
        except TimeoutError:
            if rec.ttft is None:
                rec.gave_up = True  # the user closes the stream (leaving the block closed it)
            else:
                rec.error = "timeout"
        except (aiohttp.ClientError, OSError, ValueError) as exc:
            rec.error = type(exc).__name__

    async def _stream(self, rec: Record, resp: aiohttp.ClientResponse, sent: float,
                      bound: asyncio.Timeout, sent_loop: float) -> None:
        usage: int | None = None
        async for line in resp.content:
            if not line.startswith(b"data: "):
                continue
            if line.startswith(b"data: [DONE]"):
                rec.done = True
                break
            if b'"usage":{' in line:
                usage = int(json.loads(line[6:])["usage"]["completion_tokens"])
            elif b'"choices":[{' in line and b'"text"' in line:  # LiteLLM: an empty last one
                now = time.monotonic()
                if rec.ttft is None:
                    rec.ttft = now - sent
                    rec.model = str(json.loads(line[6:]).get("model", ""))  # once a request
                    # a first token: the user stays until the answer ends (bounded)
                    bound.reschedule(sent_loop + self.args.request_timeout)
                rec.tokens += 1
                rec.last = now - sent
                if self.window[0] <= now < self.window[1]:
                    rec.window_tokens += 1
        if usage is not None:
            rec.tokens = usage
        if not rec.done:
            rec.error = "cut"


_WATCHED = ("kneegate_limit", "kneegate_in_flight", "kneegate_knee_estimate",
            "kneegate_prefill_cap")


async def _watch_gateway(session: aiohttp.ClientSession, url: str, start: float, end: float,
                         into: dict[str, list[float]]) -> None:
    """Read the gateway's limit, in-flight and knee estimate (summed over its upstreams)
    every 0.5 s of the measured window, into `into` by metric name; a failed read is
    skipped (with `--workers 2`, each read is one worker's)."""
    while (now := time.monotonic()) < end:
        if now >= start:
            try:
                async with session.get(url.rstrip("/") + "/metrics") as resp:
                    totals = metric_totals(await resp.text())
            except (aiohttp.ClientError, OSError):
                totals = {}
            for name in _WATCHED:
                value = totals.get(name, math.nan)  # NaN: no knee estimate yet
                if math.isfinite(value):
                    into.setdefault(name, []).append(value)
        await asyncio.sleep(0.5 if now >= start else min(0.5, start - now))


async def late_ticks(late: list[float]) -> None:
    """Append to `late` how many seconds each of this loop's 50 ms ticks came past its
    time, where over 0.1 s: the load generator itself was kept off the CPU (or its loop
    busy), and every time it measured in the meantime is that much late."""
    while True:
        t = time.monotonic()
        await asyncio.sleep(0.05)
        if (over := time.monotonic() - t - 0.05) > 0.1:
            late.append(over)


async def run_cell(url: str, rate: float, args: argparse.Namespace, seed: int,
                   users: list[Record] | None = None,
                   watched: dict[str, list[float]] | None = None,
                   late: list[float] | None = None) -> list[Record]:
    """Poisson arrivals at `rate`; the records of every user sent (`measured` marks those
    sent in the measured window), appended to `users` as they are sent when given (a
    caller may watch it). With `watched`, `url` is a gateway whose limit, in-flight and
    knee estimate are read into it through the measured window (`_watch_gateway`). With
    `late`, this loop's late ticks from the first arrival to the end (`late_ticks`).

    Arrivals: `warmup` s unmeasured, `seconds` s measured, then unmeasured until every
    measured user has ended or `request_timeout` s have passed. Bounded in count and time.
    """
    rng = random.Random(seed)
    keys = parse_keys(args.keys)
    key_rng = random.Random(seed + 1)  # its own stream: the arrival times stay as they were
    # answers of varied length (`--spread S`: max_tokens uniform within +-S of --max-tokens),
    # drawn from a stream of their own too; 0 (or a tool without the flag): every one alike
    spread = getattr(args, "spread", 0.0)
    length_rng = random.Random(seed + 2)
    conn = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
    users = [] if users is None else users
    tasks: set[asyncio.Task[None]] = set()
    pending = 0

    def ended(_: asyncio.Task[None]) -> None:
        nonlocal pending
        pending -= 1

    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
        t0 = time.monotonic()
        start, end = t0 + args.warmup, t0 + args.warmup + args.seconds
        client = _Client(session, url, args, (start, end))
        hard_end = end + args.request_timeout
        max_sent = int(rate * (args.warmup + args.seconds + args.request_timeout) * 2) + 100
        next_at, sent = t0, 0
        watcher = (None if watched is None else
                   asyncio.create_task(_watch_gateway(session, url, start, end, watched)))
        ticker = None if late is None else asyncio.create_task(late_ticks(late))
        while sent < max_sent:
            now = time.monotonic()
            if now >= hard_end or (now >= end and pending == 0):
                break
            if next_at > now:
                await asyncio.sleep(min(next_at - now, 0.5))
                continue
            rec = Record(measured=start <= now < end)
            if keys:
                rec.key = key_rng.choices(list(keys), weights=list(keys.values()))[0]
            if spread:
                low, high = args.max_tokens * (1 - spread), args.max_tokens * (1 + spread)
                rec.asked = max(1, round(length_rng.uniform(low, high)))
            users.append(rec)
            task = asyncio.create_task(client.one(rec))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            if rec.measured:
                pending += 1
                task.add_done_callback(ended)
            sent += 1
            next_at += rng.expovariate(rate)
        tasks.update(t for t in (watcher, ticker) if t is not None)
        for task in list(tasks):  # unmeasured users still waiting, or measured ones past time
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    for rec in users:
        if rec.measured and rec.status is None and not rec.gave_up and rec.error is None:
            rec.error = "cancelled"  # past request_timeout while sending
    return users


def fetch_metrics(url: str, timeout: float = 5.0) -> str:
    """The Prometheus text a server (a gateway, an engine) exposes at `url`/metrics; raises
    OSError when it does not answer."""
    with urllib.request.urlopen(url + "/metrics", timeout=timeout) as r:
        return str(r.read().decode())


def metric_totals(text: str) -> dict[str, float]:
    """A Prometheus text exposition's samples, summed over their labels, by sample name."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def parse_keys(text: str | None) -> dict[str, float]:
    """`heavy:8,light:1` -> {"heavy": 8.0, "light": 1.0}: API keys and their shares."""
    out: dict[str, float] = {}
    for part in (p.strip() for p in (text or "").split(",") if p.strip()):
        name, _, share = part.partition(":")
        out[name] = float(share or 1)
    return out

