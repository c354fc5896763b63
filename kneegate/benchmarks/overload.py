"""Wall-clock overload: open-loop Poisson arrivals past capacity, judged by the user's clock.

    python -m kneegate.benchmarks.overload                                  # every arm, 1.5x/3x/10x
    python -m kneegate.benchmarks.overload --loads 3 --seconds 10 --arms direct,kneegate  # smoke

One run, so the ratios are measured side by side. First the engine (`python -m
benchmarks.engine --profile cpu-tiny`, its own process) is measured alone: closed loop,
`--capacity-streams` (64) streams for `--capacity-seconds` after `--capacity-warmup` (2 s;
a fresh vLLM needs more: its first requests are slow); capacity in requests/s =
output tokens/s / `--max-tokens` (tokens, not loadgen's requests_per_s, which leaves out the
requests started in the warm-up); `--capacity TOK_S` takes it as given instead (two builds
run one after the other then offer the same rate). Then, for every arm and load, a fresh
engine (and gateway) receives Poisson arrivals at load x capacity (with `--upstream`, that
engine, once it runs and queues nothing: `_wait_idle`): streamed, `--prompt-tokens` (128)
token ids, `--max-tokens` (64) output tokens, ignore_eos. A user with no first token
`--give-up` (20) s after sending closes the stream (gave up); a rejection is not retried.

Arms (`--arms`, comma-separated):
  direct          the engine alone
  valve           the engine with vLLM's `--max-num-queued-tokens`, one arm per size
                  (`valve-N`): by default objective x the engine's prefill rate at saturation
                  (capacity x prompt tokens: the rate its waiting queue drains) x 0.25, 0.5
                  and 1, in whole prompts; `--valve-tokens 1280,2560` sets them; `valve-N` names one
  kneegate        `python -m kneegate serve --upstream URL` with no tuning flags
  kneegate-w2     the same with `--workers 2`
  kneegate-fixed  `--controller fixed --limit L`, L the operators' safe level: `--fixed-limit`,
                  or a short closed-loop sweep of the engine (`--sweep-levels`, the 5% rule and
                  the 20% back-off of benchmarks.sweep; keep each step longer than one answer
                  at the top level, or that level reads low)
  litellm, litellm-N, vllm-router, vllm-router-N
                  the gateways a vLLM user would pick instead (benchmarks.peers; installed
                  apart, named with `--peer-bin DIR`; not among the default arms)

`--rounds N` runs every arm N times per load, round by round (round r's arrivals drawn with
the seed + 7919 r, the same for every arm in it), then prints each arm's medians: goodput,
/cap, /direct and /valve (goodput over the round's best valve arm) taken within each round,
its TTFT p99 from send (median and worst) and every round's goodput. vLLM's CPU build drifts
by +-10% between runs of one arm; a ratio from one round cannot tell 0.86 from 0.95.

`--keys heavy:8,light:1` gives each user an API key (`Authorization: Bearer NAME`), drawn by
those shares: the tenants of issue 15; a name ending in `*` (`heavy*:8`) is a client that
mints a fresh key for every request (`heavy-1`, `heavy-2`, ...), counted as one in the
table. Each cell then prints a line per key: its demand
(output tokens/s its measured users asked for), the fraction of that demand completed with a
first token within the objective, its rejections and how many carried Retry-After.

`--upstream URL --model NAME` measures a running engine (real vLLM) instead: every cell uses
it as it is (no valve arms; its own flags are set where it was started). `--start-vllm`
starts the real-vLLM tier's vLLM (tests/real_vllm/vllm_server.py) for the run, and a vLLM of
their own for `valve-N` arms (`--max-num-queued-tokens N`, started per cell, ~70 s each).

Each (arm, load) cell: `--warmup` s of arrivals that are not measured, then `--seconds` s whose
arrivals are the measured requests, then arrivals go on (unmeasured, so the measured ones see
the same load to the end) until every measured request has ended, at most `--request-timeout`
s. Token rates are by the clock: tokens that reached users during the measured `--seconds`
(whoever sent them), so a backlog served after the window does not inflate them. The other
columns follow the measured users to their end. Columns:

  offered    arrivals per second (load x capacity)
  goodput    output tokens/s received by users whose first token reached them within
             `--objective` (2) s of sending
  /cap       goodput / capacity (capacity x max tokens, tokens/s)
  /direct    goodput / the direct arm's done tok/s at the same load (when `direct` ran
             first): what this engine completed, under this client, with every request
             offered to it; at 1.5x, the tokens that could be served (the closed-loop
             capacity is measured without the gateway's and this client's CPU beside the
             emulator on these 2 cores)
  SLO gp     goodput of the users who also saw their answer stream at most
             `--tpot-objective` (0.1) s a token: both objectives met, as DistServe and
             `vllm bench serve --goodput ttft:2000 tpot:100` count goodput (here in tokens)
  done tok/s output tokens/s received by users whose answer completed ([DONE])
  rejected   measured users answered other than 200 (never retried); rej p99 ms: their time
             from send to the status line
  TTFT p50/p99  from send, of the measured users who got a first token
  TPOT p50   seconds per output token after the first, as completed answers streamed to
             their users (goodput, judged by the first token, leaves it out; p99 in the JSON)
  gave up    measured users with no first token after `--give-up` s
  errors     measured users with a transport error, a cut stream, or past `--request-timeout`
  limit, in flight  the gateway's, medians of its /metrics read every 0.5 s of the measured
             window (kneegate arms; the JSON also has the knee estimate's, `knee_p50`, and
             the prefill backlog's cap, `prefill_cap_p50`)
  stall ms   this load generator's longest late tick (`late_ticks`): it was kept off the
             CPU that long, and what it timed meanwhile reads that much late. On the 2-core
             VM, while vLLM's CPU build generates, every process beside it can miss the CPU
             for 4-8 s at once (tests/real_vllm/test_vllm_relay.py's disconnect test): a
             rejection p99 or TTFT tail of seconds in such a cell is the machine's
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import itertools
import json
import math
import random
import shlex
import statistics
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kneegate.benchmarks.loadgen import LoadConfig, closed_loop
from kneegate.benchmarks.overhead import _free_port, _process
from kneegate.benchmarks.peers import Peer, find, parse_peer
from kneegate.benchmarks.peers import serving as peer_serving
from kneegate.benchmarks.sweep import run_sweep

__all__ = ["Arm", "Record", "gateway_medians", "late_ticks", "main", "metric_totals", "parse_arms",
           "round_medians", "run", "summarize", "valve_sizes"]

ARMS = ("direct", "valve", "kneegate", "kneegate-w2", "kneegate-fixed")
_ROUND_SEED = 7919  # a round's arrivals: seed + this x the round (round 0: the seed's own)
_STARTUP_S = 10.0  # what the table's time bound allows per cell to start and stop processes


@dataclass(frozen=True, slots=True)
class Arm:
    name: str
    engine_flags: tuple[str, ...] = ()
    gateway_flags: tuple[str, ...] | None = None  # None: the client talks to the engine
    peer: Peer | None = None  # another gateway in front of the engine (benchmarks.peers)


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
    prompt: int = 0  # its prompt's tokens, where they vary (`benchmarks.replay`)
    reason: str = ""  # a rejection's x-kneegate-reject-reason (a gateway's), else ""

    @property
    def tpot(self) -> float | None:
        """Seconds per output token after the first, as the user saw them stream."""
        if self.ttft is None or self.last is None or self.tokens < 2:
            return None
        return (self.last - self.ttft) / (self.tokens - 1)


# -- the client ----------------------------------------------------------------------------


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
        """Send `body` (default: the fixed one) as user `rec`, and follow it to its end."""
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


# -- figures -------------------------------------------------------------------------------


def _pct(values: list[float], q: int) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def summarize(users: list[Record], seconds: float, capacity_tok_s: float,
              objective: float, tpot_objective: float | None = None) -> dict[str, Any]:
    """One table row's figures: token rates by the clock, the rest over the measured users.

    With `tpot_objective`, also the goodput of users who met both objectives: first token
    within `objective` and their answer streamed at most `tpot_objective` s a token (so far,
    for an answer still streaming; a one-token answer has no TPOT to miss). That is
    DistServe's goodput, and `vllm bench serve --goodput ttft:MS tpot:MS`'s, in tokens.
    """
    on_time = [r for r in users if r.ttft is not None and r.ttft <= objective]
    good = sum(r.window_tokens for r in on_time)
    slo_good = (None if tpot_objective is None else
                sum(r.window_tokens for r in on_time
                    if (t := r.tpot) is None or t <= tpot_objective) / seconds)
    recs = [r for r in users if r.measured]
    first = [r for r in recs if r.ttft is not None]
    rejected = [r for r in recs if r.status is not None and r.status != 200 and not r.gave_up]
    statuses: dict[str, int] = collections.Counter(str(r.status) for r in rejected)
    tpots = [t for r in recs if r.done and (t := r.tpot) is not None]
    goodput = good / seconds
    return {
        "users": len(recs),
        "goodput_tok_s": goodput,
        "goodput_over_capacity": goodput / capacity_tok_s if capacity_tok_s > 0 else None,
        "slo_goodput_tok_s": slo_good,  # first token and TPOT both within their objectives
        "completed_tok_s": sum(r.window_tokens for r in users if r.done) / seconds,
        "completed": sum(r.done for r in recs),
        "rejected": len(rejected),
        "rejected_by_status": dict(sorted(statuses.items())),
        "rejection_p99_ms": _ms(_pct([r.answer for r in rejected if r.answer is not None], 99)),
        "ttft_p50_ms": _ms(_pct([r.ttft for r in first if r.ttft is not None], 50)),
        "ttft_p99_ms": _ms(_pct([r.ttft for r in first if r.ttft is not None], 99)),
        # the answers' streaming speed, which goodput (judged by the first token) leaves out
        "tpot_p50_ms": _ms(_pct(tpots, 50)),
        "tpot_p99_ms": _ms(_pct(tpots, 99)),
        "gave_up": sum(r.gave_up for r in recs),
        "errors": sum(r.error is not None for r in recs),
    }


def metric_totals(text: str) -> dict[str, float]:
    """A Prometheus text exposition's samples, summed over their labels, by sample name."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def gateway_medians(watched: dict[str, list[float]]) -> dict[str, float | None]:
    """The medians of what `_watch_gateway` read: limit_p50, in_flight_p50, knee_p50 and
    prefill_cap_p50 (0: no cap on the engine's prefill backlog)."""
    def med(name: str) -> float | None:
        values = watched.get(name)
        return statistics.median(values) if values else None

    return {"limit_p50": med("kneegate_limit"), "in_flight_p50": med("kneegate_in_flight"),
            "knee_p50": med("kneegate_knee_estimate"),
            "prefill_cap_p50": med("kneegate_prefill_cap")}


def parse_keys(text: str | None) -> dict[str, float]:
    """`heavy:8,light:1` -> {"heavy": 8.0, "light": 1.0}: API keys and their shares."""
    out: dict[str, float] = {}
    for part in (p.strip() for p in (text or "").split(",") if p.strip()):
        name, _, share = part.partition(":")
        out[name] = float(share or 1)
    return out


def per_key(users: list[Record], seconds: float, max_tokens: int,
            objective: float) -> dict[str, dict[str, Any]]:
    """Per API key, over its measured users: demand (output tokens/s asked for), the part of
    it completed with a first token within `objective`, rejections and their Retry-After."""
    out: dict[str, dict[str, Any]] = {}
    for key in sorted({r.key for r in users if r.measured}):
        recs = [r for r in users if r.measured and r.key == key]
        asked = len(recs) * max_tokens
        served = sum(r.tokens for r in recs
                     if r.done and r.ttft is not None and r.ttft <= objective)
        rejected = [r for r in recs if r.status is not None and r.status != 200]
        reasons = Counter(r.reason or str(r.status) for r in rejected)
        out[key] = {"users": len(recs), "demand_tok_s": asked / seconds,
                    "served_within_objective": served / asked if asked else None,
                    "rejected": len(rejected),
                    "with_retry_after": sum(r.retry_after for r in rejected),
                    "reasons": dict(reasons.most_common())}
    return out


def _key_row(key: str, k: dict[str, Any]) -> str:
    served = k["served_within_objective"]
    return (f"    key {key}: {k['users']} users, demand {k['demand_tok_s']:.0f} tok/s, "
            f"{'-' if served is None else format(served, '.2f')} of it completed with a "
            f"first token within the objective; {k['rejected']} rejected, "
            f"{k['with_retry_after']} with Retry-After"
            + "".join(f"; {n} {why}" for why, n in k.get("reasons", {}).items()))


def _ms(x: float | None) -> float | None:
    return None if x is None else x * 1e3


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


_COLS = (f"{'arm':<16}{'load':>5}{'offered':>9}{'goodput':>9}{'/cap':>6}{'/direct':>8}"
         f"{'SLO gp':>7}{'done tok/s':>11}"
         f"{'rejected':>9}{'rej p99 ms':>11}{'TTFT p50':>9}{'TTFT p99':>9}{'TPOT p50':>9}"
         f"{'gave up':>8}"
         f"{'errors':>7}{'limit':>7}{'in flight':>10}{'stall ms':>9}")


def _row(arm: str, load: float, offered: float, s: dict[str, Any]) -> str:
    return (f"{arm:<16}{load:>5g}{offered:>9.1f}{s['goodput_tok_s']:>9.0f}"
            f"{_fmt(s['goodput_over_capacity'], '.2f'):>6}"
            f"{_fmt(s.get('goodput_over_direct_done'), '.2f'):>8}"
            f"{_fmt(s.get('slo_goodput_tok_s'), '.0f'):>7}{s['completed_tok_s']:>11.0f}"
            f"{s['rejected']:>9d}{_fmt(s['rejection_p99_ms'], '.0f'):>11}"
            f"{_fmt(s['ttft_p50_ms'], '.0f'):>9}{_fmt(s['ttft_p99_ms'], '.0f'):>9}"
            f"{_fmt(s['tpot_p50_ms'], '.0f'):>9}{s['gave_up']:>8d}{s['errors']:>7d}"
            f"{_fmt(s.get('limit_p50'), '.0f'):>7}{_fmt(s.get('in_flight_p50'), '.0f'):>10}"
            f"{_fmt(s.get('client_stall_max_ms'), '.0f'):>9}")


# -- arms and processes --------------------------------------------------------------------


def valve_sizes(objective: float, capacity_rps: float, prompt_tokens: int) -> list[int]:
    """objective x the queue's drain rate (capacity x prompt) x 0.25, 0.5, 1, in whole prompts.

    The valve counts the prompts of requests without a first token; at saturation they leave
    that state at the engine's completion rate, so this many tokens wait about objective x f.
    """
    base = objective * capacity_rps
    return sorted({max(1, round(base * f)) * prompt_tokens for f in (0.25, 0.5, 1.0)})


def parse_arms(text: str, valves: list[int], fixed_limit: int | None) -> list[Arm]:
    """The arms named in `--arms`; `valve` expands to one arm per size in `valves`."""
    arms: list[Arm] = []
    for name in (n.strip() for n in text.split(",") if n.strip()):
        if name == "direct":
            arms.append(Arm(name))
        elif name == "valve":
            arms += [Arm(f"valve-{n}", ("--max-num-queued-tokens", str(n))) for n in valves]
        elif name.startswith("valve-") and name[6:].isdigit() and int(name[6:]) > 0:
            arms.append(Arm(name, ("--max-num-queued-tokens", name[6:])))
        elif name == "kneegate":
            arms.append(Arm(name, gateway_flags=()))
        elif name == "kneegate-w2":
            arms.append(Arm(name, gateway_flags=("--workers", "2")))
        elif name == "kneegate-fixed":
            if fixed_limit is None:
                raise ValueError("kneegate-fixed needs a limit (--fixed-limit or the sweep)")
            arms.append(Arm(name, gateway_flags=("--controller", "fixed", "--limit",
                                                 str(fixed_limit))))
        elif (peer := parse_peer(name)) is not None:
            arms.append(Arm(name, peer=peer))
        else:
            raise ValueError(f"unknown arm {name!r}: one of {', '.join(ARMS)}, valve-N, "
                             "litellm[-N] or vllm-router[-N]")
    return arms


def _arm_names(text: str) -> list[str]:
    return [n.strip() for n in text.split(",") if n.strip()]


@contextlib.contextmanager
def _child(cmd: list[str], ready: str | int) -> Iterator[None]:
    """overhead._process (its output dropped: a gateway logs a line per request)."""
    with _process(cmd, ready):
        yield


IDLE_WAIT_S = 60.0  # how long a shared engine may take to drop the last cell's requests


def _wait_idle(url: str, limit: float = IDLE_WAIT_S) -> float:
    """Wait until a shared engine runs and queues nothing (vLLM's series on its /metrics);
    the seconds waited. A cell's users end, but the engine drops what they left only
    as it notices them gone: vLLM still held 233 of direct's requests at 3x a second after
    its cell ended, and the kneegate cell after it read their TTFT as its own (its first
    window: engine in-flight 56 where it held 14). No such series: no wait."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        if not engine_holds(url):
            return time.monotonic() - t0
        time.sleep(0.25)  # another process's state, read over HTTP: no event to wait on
    raise RuntimeError(f"{url} still busy {limit:g} s after the last cell")


def engine_holds(url: str) -> float | None:
    """The requests an engine runs and queues, by vLLM's series on its /metrics; None when
    it does not answer with them."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
            totals = metric_totals(r.read().decode())
    except OSError:
        return None
    series = [totals.get(f"vllm:num_requests_{s}") for s in ("running", "waiting")]
    return None if None in series else sum(x or 0.0 for x in series)


@contextlib.contextmanager
def _serving(arm: Arm, profile: str, upstream: str | None = None,
             start_vllm: bool = False, model: str | None = None,
             peer_bin: Path | None = None) -> Iterator[str]:
    """A fresh engine (and gateway) for one cell; yields the URL the users talk to.
    With `upstream`, that running engine instead of a fresh emulator; with `start_vllm` as
    well, an arm with engine flags (the valve) gets a vLLM of its own started with them.
    A peer arm puts that gateway (from `peer_bin`) in front of the engine."""
    if arm.peer is not None:
        with _serving(Arm("direct"), profile, upstream, start_vllm) as engine_url, \
                peer_serving(arm.peer, engine_url, model or profile, peer_bin) as url:
            yield url
        return
    if upstream is not None:
        if not arm.engine_flags:
            _wait_idle(upstream)
        if arm.engine_flags and start_vllm:
            from kneegate.benchmarks.calibrate_vllm import _started_vllm

            with _started_vllm(*arm.engine_flags) as own:
                yield own
            return
        if arm.engine_flags:
            raise ValueError(f"arm {arm.name} sets engine flags: it needs the emulator")
        if arm.gateway_flags is None:
            yield upstream
            return
        gp = _free_port()
        gateway = [sys.executable, "-m", "kneegate", "serve", "--upstream", upstream,
                   "--port", str(gp), *arm.gateway_flags]
        with _child(gateway, f"http://127.0.0.1:{gp}/health"):
            yield f"http://127.0.0.1:{gp}"
        return
    ep = _free_port()
    engine = [sys.executable, "-m", "kneegate.benchmarks.engine", "--profile", profile,
              "--port", str(ep), *arm.engine_flags]
    with _child(engine, ep):
        if arm.gateway_flags is None:
            yield f"http://127.0.0.1:{ep}"
            return
        gp = _free_port()
        gateway = [sys.executable, "-m", "kneegate", "serve", "--upstream",
                   f"http://127.0.0.1:{ep}", "--port", str(gp), *arm.gateway_flags]
        with _child(gateway, f"http://127.0.0.1:{gp}/health"):
            yield f"http://127.0.0.1:{gp}"


def _measure_engine(args: argparse.Namespace, sweep: bool) -> tuple[float, int | None, Any]:
    """Capacity (requests/s) of the engine alone, and the sweep's safe level when asked."""
    with _serving(Arm("direct"), args.profile, args.upstream) as url:
        cfg = LoadConfig(url=url, model=args.model or args.profile,
                         prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens,
                         max_seconds=args.capacity_seconds + args.capacity_warmup,
                         warmup=args.capacity_warmup,
                         max_requests=10**9)
        cap = asyncio.run(closed_loop(cfg, args.capacity_streams)).summary()
        capacity_rps = float(cap["throughput_tok_s"]) / args.max_tokens
        if not sweep:
            return capacity_rps, None, None
        levels = [int(x) for x in args.sweep_levels.split(",")]
        print(f"sweep of the engine for kneegate-fixed: levels {levels}, "
              f"{args.sweep_seconds:g} s + 3 s warm-up each", flush=True)
        points, knee = asyncio.run(run_sweep(
            url, levels, step_seconds=args.sweep_seconds, warmup=3.0,
            model=args.model or args.profile,
            prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens))
        # no knee inside the levels: back off from the best level, as the operator would
        safe = knee.safe if knee.safe is not None else max(1, int(0.8 * knee.peak_level))
        return capacity_rps, safe, {"points": [asdict(p) for p in points], "knee": asdict(knee)}


@dataclass
class Report:
    command: str
    capacity_rps: float = 0.0
    capacity_tok_s: float = 0.0
    fixed_limit: int | None = None
    fixed_limit_from: str = ""
    valve_tokens: list[int] = field(default_factory=list)
    sweep: Any = None
    rows: list[dict[str, Any]] = field(default_factory=list)
    medians: list[dict[str, Any]] = field(default_factory=list)  # `--rounds` > 1


def run(args: argparse.Namespace) -> Report:
    """The whole benchmark: capacity first, then every (arm, load) cell; prints the table."""
    if args.start_vllm:  # one vLLM for the plain arms; each valve arm starts its own
        from kneegate.benchmarks.calibrate_vllm import _started_vllm

        with _started_vllm() as url:
            args.upstream, args.model = url, args.model or "tiny"
            return _run(args)
    return _run(args)


def _run(args: argparse.Namespace) -> Report:
    loads = [float(x) for x in args.loads.split(",") if x.strip()]
    names = _arm_names(args.arms)
    rep = Report(command=shlex.join(["python", "-m", "kneegate.benchmarks.overload", *args.argv]))
    print(rep.command)
    n_valves = 0 if "valve" not in names else (
        len(args.valve_tokens.split(",")) if args.valve_tokens else 3)
    cells = (len(names) - ("valve" in names) + n_valves) * len(loads) * args.rounds
    per_cell = args.warmup + args.seconds + args.request_timeout + _STARTUP_S
    print(f"{cells} cells (arms x loads x rounds), each at most {per_cell:g} s (warm-up "
          f"{args.warmup:g} + measured {args.seconds:g} + drain <= {args.request_timeout:g} "
          f"+ start/stop); "
          f"total <= {cells * per_cell / 60:.1f} min after the capacity phase", flush=True)
    need_sweep = "kneegate-fixed" in names and args.fixed_limit is None
    if args.capacity is not None:  # taken as given: runs side by side offer the same rate
        if need_sweep:
            raise SystemExit("--capacity with kneegate-fixed needs --fixed-limit")
        rep.capacity_rps, safe = args.capacity / args.max_tokens, None
    else:
        rep.capacity_rps, safe, rep.sweep = _measure_engine(args, need_sweep)
    rep.capacity_tok_s = rep.capacity_rps * args.max_tokens
    if rep.capacity_rps <= 0:
        raise RuntimeError("the engine completed nothing in the capacity run")
    if args.fixed_limit is not None:
        rep.fixed_limit, rep.fixed_limit_from = args.fixed_limit, "--fixed-limit"
    elif safe is not None:
        rep.fixed_limit, rep.fixed_limit_from = safe, "sweep (5% rule, 20% back-off)"
    rep.valve_tokens = ([int(x) for x in args.valve_tokens.split(",")] if args.valve_tokens
                        else valve_sizes(args.objective, rep.capacity_rps, args.prompt_tokens))
    arms = parse_arms(args.arms, rep.valve_tokens, rep.fixed_limit)
    how = ("given, --capacity" if args.capacity is not None else
           f"closed loop, {args.capacity_streams} streams, {args.capacity_seconds:g} s")
    print(f"capacity {rep.capacity_rps:.2f} req/s = {rep.capacity_tok_s:.0f} output tok/s "
          f"({how}); objective {args.objective:g} s from send; give-up {args.give_up:g} s",
          flush=True)
    if "valve" in names:
        print(f"valve sizes (--max-num-queued-tokens): {rep.valve_tokens}", flush=True)
    if rep.fixed_limit is not None:
        print(f"kneegate-fixed limit {rep.fixed_limit} ({rep.fixed_limit_from})", flush=True)
    print(_COLS, flush=True)
    for load in loads:
        rate = load * rep.capacity_rps
        for rnd in range(args.rounds):
            if args.rounds > 1:
                print(f"round {rnd + 1} of {args.rounds}, load {load:g}", flush=True)
            direct_done: float | None = None  # the direct arm's completed tok/s this round
            for arm in arms:
                watched: dict[str, list[float]] | None = (
                    None if arm.gateway_flags is None else {})
                # every arm of a round meets the same arrivals; each round draws its own
                seed = args.seed + int(load * 1000) + _ROUND_SEED * rnd
                late: list[float] = []
                with _serving(arm, args.profile, args.upstream, args.start_vllm, args.model,
                              args.peer_bin) as url:
                    recs = asyncio.run(run_cell(url, rate, args, seed=seed, watched=watched,
                                                late=late))
                s = summarize(recs, args.seconds, rep.capacity_tok_s, args.objective,
                              args.tpot_objective)
                s["client_stall_max_ms"] = max(late, default=0.0) * 1e3
                s.update(gateway_medians(watched or {}))
                if arm.name == "direct":
                    direct_done = s["completed_tok_s"]
                s["goodput_over_direct_done"] = (
                    s["goodput_tok_s"] / direct_done if direct_done else None)
                keys = per_key(recs, args.seconds, args.max_tokens, args.objective)
                rep.rows.append({"arm": arm.name, "load": load, "round": rnd,
                                 "offered_rps": rate, "sent_rps": s["users"] / args.seconds, **s,
                                 **({"keys": keys} if args.keys else {})})
                print(_row(arm.name, load, rate, s), flush=True)
                if args.keys:
                    for key, k in keys.items():
                        print(_key_row(key, k), flush=True)
    if args.rounds > 1:
        rep.medians = round_medians(rep.rows)
        print(f"\nmedians over {args.rounds} rounds (ratios taken within each round)")
        print(_MEDIAN_COLS)
        for m in rep.medians:
            print(_median_row(m))
    return rep


def round_medians(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each (arm, load)'s medians over its rounds. The ratios are taken within a round (its
    arms met the same arrivals, one after another on one machine), then their median: an
    engine whose speed drifts between rounds moves every arm of a round together.

    `over_best_valve`: goodput over the best valve arm's in the same round (None in a
    round without one), the ratio issue 12's real-vLLM goal is judged by."""
    best_valve: dict[tuple[float, int], float] = {}
    for r in rows:
        if r["arm"].startswith("valve-"):
            key = (r["load"], r["round"])
            best_valve[key] = max(best_valve.get(key, 0.0), r["goodput_tok_s"])
    cells: dict[tuple[str, float], list[dict[str, Any]]] = {}
    for r in rows:
        cells.setdefault((r["arm"], r["load"]), []).append(r)

    def med(values: Iterable[float | None]) -> float | None:
        known = [v for v in values if v is not None]
        return statistics.median(known) if known else None

    out = []
    for (arm, load), rs in cells.items():
        valve = [best_valve.get((load, r["round"])) for r in rs]
        goodputs = [r["goodput_tok_s"] for r in rs]
        ratios = [g / v if v else None for g, v in zip(goodputs, valve, strict=True)]
        out.append({
            "arm": arm, "load": load, "rounds": len(rs), "goodput_tok_s": goodputs,
            "goodput_p50": med(goodputs),
            "goodput_over_capacity_p50": med([r["goodput_over_capacity"] for r in rs]),
            "over_direct_p50": med([r["goodput_over_direct_done"] for r in rs]),
            "over_best_valve": ratios,
            "over_best_valve_p50": med(ratios),
            "ttft_p99_ms_p50": med([r["ttft_p99_ms"] for r in rs]),
            "ttft_p99_ms_max": max(
                (r["ttft_p99_ms"] for r in rs if r["ttft_p99_ms"] is not None), default=None),
        })
    return out


_MEDIAN_COLS = (f"{'arm':<16}{'load':>5}{'goodput':>9}{'/cap':>6}{'/direct':>8}"
                f"{'/valve':>7}  {'TTFT p99 (worst)':<17}{'goodput, each round'}")


def _median_row(m: dict[str, Any]) -> str:
    each = " ".join(f"{g:.0f}" for g in m["goodput_tok_s"])
    tail = f"{_fmt(m['ttft_p99_ms_p50'], '.0f')} ({_fmt(m['ttft_p99_ms_max'], '.0f')})"
    return (f"{m['arm']:<16}{m['load']:>5g}{_fmt(m['goodput_p50'], '.0f'):>9}"
            f"{_fmt(m['goodput_over_capacity_p50'], '.2f'):>6}"
            f"{_fmt(m['over_direct_p50'], '.2f'):>8}"
            f"{_fmt(m['over_best_valve_p50'], '.2f'):>7}  {tail:<17}{each}")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m kneegate.benchmarks.overload", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arms", default=",".join(ARMS), help="comma-separated, see above")
    ap.add_argument("--loads", default="1.5,3,10", help="x the measured capacity")
    ap.add_argument("--seconds", type=float, default=60.0, help="measured arrivals per cell")
    ap.add_argument("--warmup", type=float, default=5.0, help="unmeasured arrivals first")
    ap.add_argument("--objective", type=float, default=2.0, help="TTFT from send, seconds")
    ap.add_argument("--tpot-objective", type=float, default=0.1,
                    help="seconds a token after the first, for the SLO goodput column (the "
                    "controllers' default tpot_objective)")
    ap.add_argument("--give-up", type=float, default=20.0, help="no first token by then: leave")
    ap.add_argument("--request-timeout", type=float, default=60.0,
                    help="a user's whole time, and the most a cell drains")
    ap.add_argument("--profile", default="cpu-tiny", help="emulator profile")
    ap.add_argument("--upstream", help="a running engine (e.g. vLLM) instead of a fresh "
                    "emulator per cell: arms direct, kneegate, kneegate-w2, kneegate-fixed")
    ap.add_argument("--model", help="the model name requests carry (default: the profile)")
    ap.add_argument("--start-vllm", action="store_true",
                    help="start the real-vLLM tier's vLLM (CPU build, tiny model; a source "
                    "checkout) and measure it; valve-N arms start one with the flag each")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--capacity", type=float,
                    help="output tokens/s taken as the engine's capacity instead of measuring "
                    "it (builds compared side by side then offer one rate)")
    ap.add_argument("--capacity-streams", type=int, default=64)
    ap.add_argument("--capacity-seconds", type=float, default=8.0)
    ap.add_argument("--capacity-warmup", type=float, default=2.0,
                    help="unmeasured seconds first: a fresh vLLM's first requests are slow, "
                    "and 64 streams start with 64 prefills")
    ap.add_argument("--valve-tokens", help="sizes for the valve arm, e.g. 1280,2560,5120")
    ap.add_argument("--fixed-limit", type=int, help="kneegate-fixed's limit (else a sweep)")
    ap.add_argument("--sweep-levels", default="4,8,16,32,64")
    ap.add_argument("--sweep-seconds", type=float, default=10.0, help="measured, per level")
    ap.add_argument("--keys", help="API keys and their shares of the users, e.g. heavy:8,light:1")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every arm this many times per load, in turn, and print each "
                    "arm's medians (ratios taken within a round): for an engine whose speed "
                    "drifts between runs, as vLLM's CPU build does by +-10%%")
    ap.add_argument("--peer-bin", type=Path, metavar="DIR",
                    help="where the peer arms' programs are (litellm, vllm-router: installed "
                    "apart, e.g. .venv-compare/bin); default: the PATH")
    ap.add_argument("--text-prompt", action="store_true",
                    help="send the prompt as text (4 bytes a token, as the emulator counts "
                    "it), not token ids; on with a litellm arm, which takes no ids")
    ap.add_argument("--json", type=Path, help="write the run (rows and settings) here")
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = parser()
    args = ap.parse_args(argv)
    args.argv = argv
    try:
        arms = parse_arms(args.arms, [1], 1)
    except ValueError as exc:
        ap.error(str(exc))
    for peer in {a.peer.program for a in arms if a.peer is not None}:
        find(peer, args.peer_bin)  # a missing one stops the run now, saying what to install
    if any(a.peer is not None and a.peer.program == "litellm" for a in arms):
        args.text_prompt = True  # every arm meets the same requests
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    rep = run(args)
    if args.json:
        args.json.write_text(json.dumps(asdict(rep), indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
