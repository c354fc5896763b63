"""Multi-turn chat on several emulated replicas: how routing uses their prefix caches.

    python -m kneegate_bench.conversations                       # 4 replicas, 0.7x and 1.5x
    python -m kneegate_bench.conversations --loads 1.5 --rounds 3 --arms most-room,affinity
    python -m kneegate_bench.conversations --shared-system 0 --turns 1   # no shared prefixes

Conversations start open loop (Poisson, at a rate that offers `load` x the pool's capacity
in output tokens); each has `--turns` turns, and every turn carries the system prompt and
every earlier turn (the user's messages and the answers), as chat clients send them; the
next turn is sent `--think` s (exponential mean) after the answer ends. With
`--shared-system N`, every conversation begins with one system prompt of N tokens shared by
all (else each has its own). The replicas are `kneegate engine` emulators with vLLM's prefix
caching on (`--enable-prefix-caching`): a block of a prompt seen before skips its prefill.

Arms (`--arms`):
  round-robin  no gateway: each request to the next replica in turn (a Kubernetes Service)
  sticky       no gateway: each conversation always to one replica (a hash of it): for this
               workload the replica holding its longest prefix, so the hit-rate oracle
  most-room    kneegate in front of all replicas, prefix affinity off: the least full
  affinity     kneegate, prefix affinity on (its default)
  vllm-router  vLLM's own router in front of all replicas, in its cache-aware mode (its
               default policy and thresholds); installed apart (`kneegate_bench.peers`), named
               with `--peer-bin DIR` (else the PATH); not among the default arms

Columns: hit rate (the replicas' `vllm:prefix_cache_hits` / `_queries` over the cell), and
by the user's clock, from send: goodput (output tokens/s of turns whose first token came
within `--objective` s), TTFT p50 / p99, refused. Capacity: the pool's, `--replicas` x one
replica's output tokens/s for this mix with caching off (measured first unless
`--capacity`), so a load is the same for every arm.

Bounded: each cell starts conversations for `--seconds` s and waits at most
`--request-timeout` s for the last turn's answer; a turn with no first token after
`--give-up` s ends its conversation.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from kneegate.emulator.protocol import token_text
from kneegate_bench.arms import engine_command
from kneegate_bench.openloop import fetch_metrics, metric_totals
from kneegate_bench.overhead import _free_port, _process
from kneegate_bench.peers import START_S
from kneegate_bench.peers import find as find_peer

__all__ = ["ARMS", "PEER_ARMS", "main", "router_command", "run_cell"]

ARMS = ("round-robin", "sticky", "most-room", "affinity")  # the default arms
PEER_ARMS = ("vllm-router",)  # the gateways installed apart, run where asked for
MODEL = "cpu-tiny"
_LETTERS = "abcdefghijklmnopqrstuvwxyz "


@dataclass(slots=True)
class Turn:
    """One request of a conversation; times in seconds from its send."""

    ttft: float | None = None
    tokens: int = 0
    status: int | None = None
    measured: bool = False
    window_tokens: int = 0


@dataclass
class Cell:
    turns: list[Turn] = field(default_factory=list)
    hits: float = 0.0
    queries: float = 0.0


def _text(tokens: int, tag: str) -> str:
    """About `tokens` of the emulator's tokens (4 bytes each): `tag`, then letters drawn from
    a generator seeded by it. Two texts differ all along, as real prompts do, for a router
    that matches prefixes by characters (vllm-router's cache-aware policy); the engine's
    blocks differ from the tag on, whatever follows it."""
    rng = random.Random(tag)
    body = "".join(rng.choices(_LETTERS, k=4 * tokens))
    return (tag + " " + body)[: 4 * tokens]


def _answer(n: int) -> str:
    """The text the emulator streams for `n` tokens."""
    return "".join(token_text(i) for i in range(1, n + 1))


class Conversations:
    def __init__(self, urls: list[str], arm: str, args: argparse.Namespace, seed: int) -> None:
        self.urls, self.arm, self.args = urls, arm, args
        self.rng = random.Random(seed)
        self.next_url = 0
        self.cell = Cell()

    def _url(self, conversation: int) -> str:
        if self.arm == "sticky":
            return self.urls[hash(("conv", conversation)) % len(self.urls)]
        if self.arm == "round-robin":
            self.next_url = (self.next_url + 1) % len(self.urls)
            return self.urls[self.next_url]
        return self.urls[0]  # the gateway (kneegate, or vllm-router)

    async def one(self, session: aiohttp.ClientSession, conv: int, window: tuple[float, float],
                  end: float) -> None:
        a = self.args
        system = (_text(a.shared_system, "shared") if a.shared_system
                  else _text(a.system_tokens, f"conv{conv}"))
        messages: list[dict[str, str]] = [{"role": "system", "content": system}]
        for k in range(a.turns):
            messages.append({"role": "user", "content": _text(a.user_tokens, f"c{conv}t{k}")})
            turn = Turn(measured=window[0] <= time.monotonic() < window[1])
            self.cell.turns.append(turn)
            await self._send(session, self._url(conv), messages, turn, window)
            if turn.status != 200 or turn.ttft is None:
                return  # refused or gave up: the user leaves
            messages.append({"role": "assistant", "content": _answer(a.max_tokens)})
            await asyncio.sleep(min(self.rng.expovariate(1.0 / a.think), 10 * a.think))
            if time.monotonic() >= end:
                return

    async def _send(self, session: aiohttp.ClientSession, url: str,
                    messages: list[dict[str, str]], turn: Turn,
                    window: tuple[float, float]) -> None:
        a = self.args
        body = {"model": MODEL, "messages": messages, "max_tokens": a.max_tokens,
                "stream": True, "ignore_eos": True}
        sent = time.monotonic()
        try:
            async with asyncio.timeout(a.give_up) as bound:
                async with session.post(url + "/v1/chat/completions", json=body) as resp:
                    turn.status = resp.status
                    if resp.status != 200:
                        await resp.read()
                        return
                    async for line in resp.content:
                        if not line.startswith(b"data: {") or b'"content":"' not in line:
                            continue
                        if b'"content":""' in line:
                            continue  # the role chunk
                        now = time.monotonic()
                        if turn.ttft is None:
                            turn.ttft = now - sent
                            bound.reschedule(asyncio.get_running_loop().time()
                                             + a.request_timeout)
                        turn.tokens += 1
                        if window[0] <= now < window[1]:
                            turn.window_tokens += 1
        except (TimeoutError, aiohttp.ClientError, OSError):
            return


async def run_cell(urls: list[str], arm: str, rate: float, args: argparse.Namespace,
                   seed: int) -> Cell:
    """Start conversations at `rate` a second for `--seconds`; follow them to their end."""
    talk = Conversations(urls, arm, args, seed)
    arrivals = random.Random(seed + 1)
    start = time.monotonic()
    window = (start + args.warmup, start + args.seconds)
    end = start + args.seconds
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=None)) as session:
        tasks = []
        t, conv = start, 0
        while True:
            t += arrivals.expovariate(rate)
            if t >= end:
                break
            await asyncio.sleep(max(0.0, t - time.monotonic()))
            tasks.append(asyncio.create_task(talk.one(session, conv, window, end)))
            conv += 1
        await asyncio.wait(tasks, timeout=args.request_timeout + args.give_up)
        for task in tasks:
            task.cancel()
    return talk.cell


def _cache_counts(engine_urls: list[str]) -> tuple[float, float]:
    hits = queries = 0.0
    for url in engine_urls:
        totals = metric_totals(fetch_metrics(url))
        hits += totals.get("vllm:prefix_cache_hits_total", 0.0)
        queries += totals.get("vllm:prefix_cache_queries_total", 0.0)
    return hits, queries


@contextlib.contextmanager
def _replicas(n: int, caching: bool) -> Iterator[list[str]]:
    with contextlib.ExitStack() as stack:
        urls = []
        for _ in range(n):
            port = _free_port()
            flag = "--enable-prefix-caching" if caching else "--no-enable-prefix-caching"
            stack.enter_context(_process(engine_command(MODEL, port, [flag]), port))
            urls.append(f"http://127.0.0.1:{port}")
        yield urls


@contextlib.contextmanager
def _gateway(engines: list[str], affinity: bool, workdir: Path) -> Iterator[str]:
    port = _free_port()
    config = workdir / f"pool-{port}.yaml"
    lines = ["server:", "  host: 127.0.0.1", f"  port: {port}", "  access_log: false",
             "routing:", f"  affinity: {'true' if affinity else 'false'}", "upstreams:"]
    for i, url in enumerate(engines):
        lines += [f"  - name: replica-{i}", f"    url: {url}"]
    config.write_text("\n".join(lines) + "\n")
    cmd = [sys.executable, "-m", "kneegate", "serve", "--config", str(config)]
    with _process(cmd, f"http://127.0.0.1:{port}/ready"):
        yield f"http://127.0.0.1:{port}"


def router_command(program: str, engines: list[str], port: int) -> list[str]:
    """vllm-router's command line in front of `engines`: its cache-aware policy (its
    default, named so that a later default cannot change the arm), its thresholds."""
    return [program, "--worker-urls", *engines, "--policy", "cache_aware",
            "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]


@contextlib.contextmanager
def _vllm_router(engines: list[str], bin_dir: Path | None) -> Iterator[str]:
    """vllm-router in front of `engines`, until the block ends; yields its URL."""
    port = _free_port()
    cmd = router_command(find_peer("vllm-router", bin_dir), engines, port)
    with _process(cmd, f"http://127.0.0.1:{port}/health", start_s=START_S):
        yield f"http://127.0.0.1:{port}"


def measure_capacity(args: argparse.Namespace) -> float:
    """One replica's output tokens/s for this mix, caching off: a closed loop of
    `--capacity-streams` conversations' worth of prompts of the mean turn's size."""
    from kneegate_bench.loadgen import LoadConfig, closed_loop

    mean_prompt = (args.shared_system or args.system_tokens) + 4 + (args.turns + 1) / 2 * (
        args.user_tokens + 4) + (args.turns - 1) / 2 * (args.max_tokens + 4)
    with _replicas(1, caching=False) as (url,):
        cfg = LoadConfig(url=url, model=MODEL, prompt_tokens=int(mean_prompt),
                         max_tokens=args.max_tokens, max_seconds=args.capacity_seconds + 3,
                         warmup=3.0, max_requests=10**9)
        summary = asyncio.run(closed_loop(cfg, args.capacity_streams)).summary()
    return float(summary["throughput_tok_s"])


def summarize(cell: Cell, seconds: float, objective: float) -> dict[str, Any]:
    measured = [t for t in cell.turns if t.measured]
    firsts = sorted(t.ttft for t in measured if t.ttft is not None)
    good = sum(t.window_tokens for t in cell.turns
               if t.ttft is not None and t.ttft <= objective)

    def pct(q: float) -> float | None:
        return firsts[min(len(firsts) - 1, int(q * len(firsts)))] * 1000 if firsts else None

    return {
        "turns": len(measured),
        "hit_rate": cell.hits / cell.queries if cell.queries else 0.0,
        "goodput_tok_s": good / seconds,
        "ttft_p50_ms": pct(0.5),
        "ttft_p99_ms": pct(0.99),
        "refused": sum(1 for t in measured if t.status not in (None, 200)),
    }


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    capacity = args.capacity or measure_capacity(args)
    pool = capacity * args.replicas
    print(f"one replica: {capacity:.0f} tok/s for this mix; the pool of {args.replicas}: "
          f"{pool:.0f}", flush=True)
    rows = []
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    for r in range(args.rounds):
        for load in args.loads:
            rate = load * pool / (args.turns * args.max_tokens)  # conversations a second
            for arm in args.arms:
                with _replicas(args.replicas, caching=True) as engines, contextlib.ExitStack() as s:
                    if arm in ("most-room", "affinity"):
                        urls = [s.enter_context(_gateway(engines, arm == "affinity", workdir))]
                    elif arm == "vllm-router":
                        urls = [s.enter_context(_vllm_router(engines, args.peer_bin))]
                    else:
                        urls = engines
                    cell = asyncio.run(run_cell(urls, arm, rate, args, seed=1000 * r + 7))
                    cell.hits, cell.queries = _cache_counts(engines)
                row = {"round": r, "load": load, "arm": arm,
                       **summarize(cell, args.seconds - args.warmup, args.objective)}
                rows.append(row)
                print(_row(row), flush=True)
    print("medians over rounds:")
    for load in args.loads:
        for arm in args.arms:
            cells = [x for x in rows if x["load"] == load and x["arm"] == arm]
            med = {k: statistics.median(c[k] for c in cells if c[k] is not None)
                   for k in ("hit_rate", "goodput_tok_s", "ttft_p50_ms", "ttft_p99_ms",
                             "refused") if any(c[k] is not None for c in cells)}
            print(_row({"round": "med", "load": load, "arm": arm, "turns": "", **med}),
                  flush=True)
    return rows


def _row(r: dict[str, Any]) -> str:
    def f(key: str, spec: str) -> str:
        v = r.get(key)
        return "-" if v is None else format(v, spec)

    return (f"  round {r['round']!s:>3}  {r['load']:>4}x  {r['arm']:<12} turns {r['turns']!s:>5}"
            f"  hit rate {f('hit_rate', '.2f')}  goodput {f('goodput_tok_s', '7.0f')} tok/s"
            f"  TTFT p50 {f('ttft_p50_ms', '6.0f')} / p99 {f('ttft_p99_ms', '6.0f')} ms"
            f"  refused {f('refused', '.0f')}")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m kneegate_bench.conversations",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--loads", type=lambda s: [float(x) for x in s.split(",")],
                    default=[0.7, 1.5])
    ap.add_argument("--arms", type=lambda s: [x for x in s.split(",") if x],
                    default=list(ARMS))
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--warmup", type=float, default=15.0)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--think", type=float, default=2.0, help="mean seconds between turns")
    ap.add_argument("--system-tokens", type=int, default=256,
                    help="each conversation's own system prompt")
    ap.add_argument("--shared-system", type=int, default=0,
                    help="tokens of one system prompt shared by every conversation (0: none)")
    ap.add_argument("--user-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--objective", type=float, default=2.0)
    ap.add_argument("--give-up", type=float, default=20.0)
    ap.add_argument("--request-timeout", type=float, default=60.0)
    ap.add_argument("--capacity", type=float, default=None,
                    help="one replica's tok/s for this mix (skips measuring it)")
    ap.add_argument("--capacity-streams", type=int, default=64)
    ap.add_argument("--capacity-seconds", type=float, default=15.0)
    ap.add_argument("--workdir", default="/tmp/kneegate-conversations")
    ap.add_argument("--peer-bin", type=Path, metavar="DIR",
                    help="where the vllm-router arm's program is (default: the PATH)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    unknown = set(args.arms) - set(ARMS) - set(PEER_ARMS)
    if unknown:
        parser().error(f"unknown arm(s) {sorted(unknown)}; choose from "
                       f"{', '.join(ARMS + PEER_ARMS)}")
    for peer in set(args.arms) & set(PEER_ARMS):  # missing: say what to install, at once
        find_peer(peer, args.peer_bin)
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
