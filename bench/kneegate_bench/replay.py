"""Replay a production trace open loop: direct, kneegate untuned, fixed limits, vLLM's valve.

    python -m kneegate_bench.replay                                  # conv, 0.7x and 1.5x
    python -m kneegate_bench.replay --trace code --loads 0.5,1,3 --rounds 3
    python -m kneegate_bench.replay --loads 1.5 --seconds 20 --arms direct,kneegate  # smoke

Real traffic is bursty and its lengths heavy-tailed: the Azure 2023 traces (shipped in
`kneegate/sim/traces`, CC-BY 4.0, attribution in its README) have prompts from a few tokens
to 14,050 and answers from 1 token to thousands. Each request is sent at its recorded
spacing, scaled by one factor so that the slice offers `load` x the engine's capacity for
that mix (`kneegate.sim.trace.schedule`), with its recorded lengths fitted to the engine's
context (`kneegate.sim.trace.cap`: answers keep at most half of it, prompts the rest), as token
ids with `ignore_eos`, streamed; no two prompts share a prefix (`prompt_ids`).

The engine's capacity for the mix is measured first (unless `--capacity TOK_S`): a closed
loop of `--capacity-streams` (64) users sending the trace's requests in order, output tokens/s
over `--capacity-seconds` after `--capacity-warmup`; requests/s = that / the mix's mean
answer. Then every (arm, load) cell gets a fresh engine (and gateway), the same arrivals for
every arm of a round; round r replays the trace from row `--start` + r x 997.

Arms (`--arms`, comma-separated):
  direct      the engine alone
  kneegate    `kneegate serve --upstream URL`, no tuning
  fixed-N     `kneegate serve --controller fixed --limit N`: a sweep of these is the oracle
              (the best fixed limit, chosen in hindsight, cell by cell)
  valve-N     the engine alone with vLLM's `--max-num-queued-tokens N`

Columns (each user's times from the moment it sent its request):
  goodput    output tokens/s, by the clock, of users whose first token came within
             `--objective` (2) s of sending
  /direct    goodput / the direct arm's goodput in the same round (the headline: never < 1
             below capacity); /best: goodput / the best fixed-N arm's in the same round
  good       share of the measured users whose first token came within the objective
  refused    measured users answered other than 200, by reason (a gateway's
             x-kneegate-reject-reason, else the status)
  lost       of those, the ones the direct arm served within the objective in the same round
             (the same request, sent at the same moment): refusals without evidence
  TTFT p50/p99  from send, of the users who got a first token
  by size    refused / sent per prompt-size bucket (tokens, after capping)
With `--rounds` > 1 the medians add goodput over the round's best valve-N and over the
hand-sized valve-N and fixed-N (the size with the best median: `figures.family_ratios`).

`--start-vllm` replays onto the real-vLLM tier's vLLM (CPU build, tiny model, context 1024;
tests/real_vllm/vllm_server.py, a source checkout): one engine shared by the cells (each
waits for it to go idle), a vLLM of its own per valve-N cell; prompt ids then stay inside the
tiny model's vocabulary.

`--replicas N` (N > 1) replays onto N emulators: the direct and valve arms send each
request to the next engine in turn (a Kubernetes Service), the gateway arms put one
`kneegate serve` in front of all N (a fixed-N arm: N per engine); the capacity is N x one
engine's (measured on one, as above).

Bounded: each cell sends at most the schedule's requests, and waits at most
`--request-timeout` s after its last arrival; a user with no first token after `--give-up`
s leaves.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import shlex
import statistics
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from kneegate.sim import trace
from kneegate_bench.arms import (
    TINY_VOCAB,
    Arm,
    _child,
    _serving,
    engine_command,
    gateway_command,
    vllm_if_asked,
)
from kneegate_bench.figures import _fmt, family_ratios, summarize
from kneegate_bench.openloop import Record, _Client
from kneegate_bench.overhead import _free_port
from kneegate_bench.refusals import by_bucket, lost, refused

__all__ = ["arms", "main", "prompt_ids", "replay", "run",
           "serving"]

_ROUND_ROWS = 997  # each round replays from this many rows further into the trace


def arms(text: str) -> list[Arm]:
    """The arms named in `--arms`."""
    out: list[Arm] = []
    for name in (n.strip() for n in text.split(",") if n.strip()):
        kind, _, n = name.partition("-")
        if name == "direct":
            out.append(Arm(name))
        elif name == "kneegate":
            out.append(Arm(name, gateway_flags=()))
        elif kind == "fixed" and n.isdigit() and int(n) > 0:
            out.append(Arm(name, gateway_flags=("--controller", "fixed", "--limit", n)))
        elif kind == "valve" and n.isdigit() and int(n) > 0:
            out.append(Arm(name, ("--max-num-queued-tokens", n)))
        else:
            raise ValueError(f"unknown arm {name!r}: direct, kneegate, fixed-N or valve-N")
    return out


VOCAB = 30_100  # token ids 100 .. VOCAB - 1: inside any Llama-sized vocabulary
_STRIDE = 7919  # a prime, coprime to VOCAB - 100 (30,000, and the tiny model's 3,996)


def prompt_ids(n: int, length: int, vocab: int = VOCAB) -> list[int]:
    """Request `n`'s prompt of `length` token ids in 100 .. `vocab` - 1: a run through them
    from a start of its own, so that no two prompts share a prefix (the trace records none),
    as users' prompts do not; prefix affinity and an engine's prefix cache then find nothing
    to reuse. The first `vocab` - 100 requests start apart."""
    span = vocab - 100
    start = n * _STRIDE % span
    return [100 + (start + i) % span for i in range(length)]


def _body(args: argparse.Namespace, req: trace.Request, n: int) -> dict[str, Any]:
    return {"model": args.model or args.profile,
            "prompt": prompt_ids(n, req.prompt, TINY_VOCAB if args.start_vllm else VOCAB),
            "max_tokens": req.output, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}


async def replay(urls: list[str], reqs: list[trace.Request],
                 args: argparse.Namespace) -> list[Record]:
    """Send `reqs` at their `at` (seconds from now), each to the next of `urls` in turn;
    the first `--warmup` s unmeasured."""
    conn = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
    users: list[Record] = []
    tasks: list[asyncio.Task[None]] = []
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
        t0 = time.monotonic()
        window = (t0 + args.warmup, t0 + args.warmup + args.seconds)
        clients = [_Client(session, url, args, window) for url in urls]
        for i, req in enumerate(reqs):
            if (delay := t0 + req.at - time.monotonic()) > 0:
                await asyncio.sleep(delay)
            rec = Record(measured=args.warmup <= req.at, prompt=req.prompt)
            users.append(rec)
            client = clients[i % len(clients)]
            tasks.append(asyncio.create_task(client.one(rec, _body(args, req, i))))
        _, late = await asyncio.wait(tasks, timeout=args.request_timeout) if tasks else ((), ())
        for task in late:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return users


@contextlib.contextmanager
def serving(arm: Arm, args: argparse.Namespace) -> Iterator[list[str]]:
    """A fresh engine (and gateway) for one cell, or `--replicas` of them: the URLs the
    users send to, in turn (one: the engine, or the gateway in front of every engine)."""
    if args.replicas <= 1:
        with _serving(arm, args.profile, args.upstream, args.start_vllm, args.model) as url:
            yield [url]
        return
    with contextlib.ExitStack() as stack:
        engines = []
        for _ in range(args.replicas):
            port = _free_port()
            stack.enter_context(_child(engine_command(args.profile, port, arm.engine_flags),
                                       port))
            engines.append(f"http://127.0.0.1:{port}")
        if arm.gateway_flags is None:
            yield engines
            return
        gp = _free_port()
        stack.enter_context(_child(gateway_command(engines, gp, arm.gateway_flags),
                                   f"http://127.0.0.1:{gp}/health"))
        yield [f"http://127.0.0.1:{gp}"]


async def closed_loop(url: str, reqs: list[trace.Request], args: argparse.Namespace) -> float:
    """Output tokens/s the engine serves `--capacity-streams` users who send `reqs` in
    turn, each its next as soon as its last ends, counted over `--capacity-seconds` after
    `--capacity-warmup`."""
    conn = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
    users: list[Record] = []
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
        t0 = time.monotonic()
        end = t0 + args.capacity_warmup + args.capacity_seconds
        client = _Client(session, url, args, (t0 + args.capacity_warmup, end))
        todo = enumerate(reqs * 100)

        async def user() -> None:
            while time.monotonic() < end:
                rec = Record(measured=True)
                users.append(rec)
                n, req = next(todo)
                await client.one(rec, _body(args, req, n))

        tasks = [asyncio.create_task(user()) for _ in range(args.capacity_streams)]
        await asyncio.wait(tasks, timeout=end - time.monotonic())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return float(sum(r.window_tokens for r in users) / args.capacity_seconds)


def _context(url: str) -> int:
    """The engine's max_model_len, from its /v1/models (vLLM and the emulator list it)."""
    with urllib.request.urlopen(url + "/v1/models", timeout=10) as r:
        return int(json.load(r)["data"][0]["max_model_len"])


@dataclass
class Report:
    command: str
    trace: str
    context: int = 0
    capacity_tok_s: float = 0.0
    capacity_rps: float = 0.0
    mean_output: float = 0.0
    rows: list[dict[str, Any]] = field(default_factory=list)
    medians: list[dict[str, Any]] = field(default_factory=list)


_COLS = (f"{'arm':<12} {'load':>4} {'sent':>5} {'goodput':>8} {'/direct':>7} {'/best':>6} "
         f"{'good':>5} {'refused':>8} {'lost':>5} {'TTFT p50':>9} {'p99':>7}  "
         "refused by reason / by size")


def _row(r: dict[str, Any]) -> str:
    f = _fmt
    reasons = ",".join(f"{k}:{v}" for k, v in sorted(r["refused_by_reason"].items()))
    sizes = " ".join(f"{k}:{a}/{b}" for k, (a, b) in r["by_size"].items())
    return (f"{r['arm']:<12} {r['load']:>4g} {r['users']:>5} {r['goodput_tok_s']:>8.1f} "
            f"{f(r['over_direct'], '.3f'):>7} {f(r['over_best'], '.3f'):>6} "
            f"{r['good_share']:>5.2f} {r['rejected']:>8} {f(r['lost'], 'd'):>5} "
            f"{f(r['ttft_p50_ms'], '.0f'):>9} "
            f"{f(r['ttft_p99_ms'], '.0f'):>7}  {reasons or '-'} / {sizes}")


def run(args: argparse.Namespace) -> Report:
    """Capacity for the mix, then every (arm, load, round) cell; prints as it goes."""
    with vllm_if_asked(args):
        return _run(args)


def _run(args: argparse.Namespace) -> Report:
    rep = Report(command=shlex.join(["python", "-m", "kneegate_bench.replay", *args.argv]),
                 trace=args.trace)
    print(rep.command, flush=True)
    the_arms = arms(args.arms)
    rows = trace.load(args.trace)
    with _serving(Arm("direct"), args.profile, args.upstream) as url:
        rep.context = args.context or _context(url)
        rows = (trace.cap(rows, rep.context) if args.max_prompt is None else
                [trace.Request(r.at, min(r.prompt, args.max_prompt), r.output) for r in rows])
        rep.mean_output = statistics.fmean(r.output for r in rows)
        if args.capacity is not None:
            rep.capacity_tok_s = args.capacity
        else:
            rep.capacity_tok_s = asyncio.run(closed_loop(url, rows[args.start:], args))
            rep.capacity_tok_s *= max(1, args.replicas)  # one engine's, times the replicas
    rep.capacity_rps = rep.capacity_tok_s / rep.mean_output
    if rep.capacity_rps <= 0:
        raise RuntimeError("the engine completed nothing in the capacity run")
    print(f"trace {args.trace}: context {rep.context}, mean answer {rep.mean_output:.0f} tokens;"
          f" capacity {rep.capacity_tok_s:.0f} output tok/s = {rep.capacity_rps:.2f} req/s "
          f"({'given' if args.capacity else f'{args.capacity_streams} streams closed loop'}"
          f"{f', x {args.replicas} replicas' if args.replicas > 1 else ''});"
          f" objective {args.objective:g} s from send", flush=True)
    print(_COLS, flush=True)
    for load in (float(x) for x in args.loads.split(",") if x.strip()):
        rate = load * rep.capacity_rps
        for rnd in range(args.rounds):
            reqs = trace.schedule(rows, rate, args.warmup + args.seconds,
                                  args.start + _ROUND_ROWS * rnd)
            cells = []
            seen: dict[str, list[Record]] = {}
            for arm in the_arms:
                with serving(arm, args) as urls:
                    users = seen[arm.name] = asyncio.run(replay(urls, reqs, args))
                s = summarize(users, args.seconds, rep.capacity_tok_s, args.objective)
                measured = [u for u in users if u.measured]
                good = [u for u in measured if u.ttft is not None and u.ttft <= args.objective]
                reasons = collections.Counter(
                    u.reason or str(u.status) for u in measured if refused(u))
                cells.append({"arm": arm.name, "load": load, "round": rnd, **s,
                              "good_share": len(good) / len(measured) if measured else 0.0,
                              "refused_by_reason": dict(reasons),
                              "by_size": by_bucket(users)})
            direct = next((c["goodput_tok_s"] for c in cells if c["arm"] == "direct"), None)
            best = max((c["goodput_tok_s"] for c in cells if c["arm"].startswith("fixed-")),
                       default=None)
            for c in cells:
                c["lost"] = (lost(seen[c["arm"]], seen["direct"], args.objective)
                             if "direct" in seen else None)
                c["over_direct"] = c["goodput_tok_s"] / direct if direct else None
                c["over_best"] = c["goodput_tok_s"] / best if best else None
                rep.rows.append(c)
                print(_row(c), flush=True)
    if args.rounds > 1:
        hand = family_ratios(rep.rows)
        rep.medians = medians(rep.rows)
        print(f"\nmedians over {args.rounds} rounds (ratios taken within each round); sized "
              f"by hand (the best median): {hand}")
        for m in rep.medians:
            print("  ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                            for k, v in m.items()))
    return rep


def medians(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each (arm, load)'s medians over its rounds of goodput, /direct, /best, good share,
    and of the ratios `family_ratios` set (absent: None)."""
    groups: dict[tuple[str, float], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["arm"], r["load"]), []).append(r)
    out = []
    for (arm, load), rs in groups.items():
        m: dict[str, Any] = {"arm": arm, "load": load}
        for k in ("goodput_tok_s", "over_direct", "over_best", "over_best_valve",
                  "over_hand_fixed", "over_hand_valve", "good_share"):
            vals = [r[k] for r in rs if r.get(k) is not None]
            m[k] = statistics.median(vals) if vals else None
        m["refused"] = statistics.median(r["rejected"] for r in rs)
        if all(r.get("lost") is not None for r in rs):
            m["lost"] = statistics.median(r["lost"] for r in rs)
        out.append(m)
    return out


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m kneegate_bench.replay", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default="conv", help="conv, code, or an Azure-format CSV file")
    ap.add_argument("--arms", default="direct,kneegate,fixed-16,fixed-32,fixed-64,fixed-128")
    ap.add_argument("--loads", default="0.7,1.5", help="x the engine's capacity for the mix")
    ap.add_argument("--seconds", type=float, default=60.0, help="measured arrivals per cell")
    ap.add_argument("--warmup", type=float, default=5.0, help="unmeasured arrivals first")
    ap.add_argument("--start", type=int, default=0, help="the trace row the replay starts at")
    ap.add_argument("--rounds", type=int, default=1, help="replays per load, each from its own"
                    " place in the trace; prints medians of the ratios taken within rounds")
    ap.add_argument("--objective", type=float, default=2.0, help="TTFT from send, seconds")
    ap.add_argument("--give-up", type=float, default=20.0, help="no first token by then: leave")
    ap.add_argument("--request-timeout", type=float, default=120.0,
                    help="the most a cell waits for its users after its last arrival")
    ap.add_argument("--profile", default="cpu-tiny", help="emulator profile")
    ap.add_argument("--upstream", help="a running engine instead of a fresh emulator per cell")
    ap.add_argument("--start-vllm", action="store_true",
                    help="start the real-vLLM tier's vLLM (CPU build, tiny model; a source "
                    "checkout) and replay onto it; valve-N arms start one with the flag each")
    ap.add_argument("--replicas", type=int, default=1,
                    help="emulators per cell: round robin without a gateway, one gateway "
                    "in front of all with one")
    ap.add_argument("--model", help="the model name requests carry (default: the profile)")
    ap.add_argument("--context", type=int, help="the engine's context (default: its /v1/models)")
    ap.add_argument("--max-prompt", type=int, help="cap prompts at this many tokens and keep "
                    "answers as recorded, instead of fitting both to the context: requests "
                    "over the context are then answered 400 in every arm")
    ap.add_argument("--capacity", type=float, help="output tokens/s taken as the capacity "
                    "(with --replicas, the whole pool's)")
    ap.add_argument("--capacity-streams", type=int, default=64)
    ap.add_argument("--capacity-seconds", type=float, default=20.0)
    ap.add_argument("--capacity-warmup", type=float, default=5.0)
    ap.add_argument("--json", type=Path, help="write the run here")
    ap.set_defaults(prompt_tokens=1, max_tokens=1)  # `openloop._Client`'s own body, unused
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    args.argv = argv
    try:
        arms(args.arms)
    except ValueError as exc:
        raise SystemExit(f"--arms: {exc}") from exc
    if args.replicas > 1 and (args.upstream or args.start_vllm):
        raise SystemExit("--replicas starts emulators: it takes no --upstream or --start-vllm")
    if args.upstream and any(a.engine_flags for a in arms(args.arms)):
        raise SystemExit("valve-N arms set engine flags: the emulator or --start-vllm")
    rep = run(args)
    if args.json:
        args.json.write_text(json.dumps(rep.__dict__, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
