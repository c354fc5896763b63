"""Cold start: closed loops of clients that never retry, started as a fresh gateway is ready.

    python -m kneegate_bench.coldstart                        # 32 and 64 clients, 3 rounds
    python -m kneegate_bench.coldstart --clients 64 --rounds 1  # one cell

Every restart, rollout, reload or new replica starts cold: the gateway knows nothing of its
engine yet. For each client count and arm, a fresh emulator (and a fresh `kneegate serve
--upstream URL`, nothing else) is started; as soon as it answers /health, `--clients` users
each send `--requests` (10) streamed requests one after another (`--prompt-tokens` 128 token
ids, `--max-tokens` 64, ignore_eos), the next as soon as the last ended, none retried. A user
with no first token after `--give-up` s leaves that request.

Columns, per arm: requests served within `--objective` (2) s of sending (first token by then),
that count over the direct arm's in the same round, refusals (not 200) and the TTFT p99 from
send of those that got a first token. Medians over `--rounds` of the ratio taken within each
round. The goal (issue 43): kneegate >= 0.95 of direct at 32 and at 64 clients.

`--start-vllm` (or `--upstream URL` for a running engine) measures in front of real vLLM
instead: one engine, started once and kept warm, shared by every cell (each waits for it to
go idle); only the gateway starts cold. The goal there: 16 clients, >= 0.95 of direct.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from collections import Counter

import aiohttp

from kneegate_bench.arms import Arm, _serving, vllm_if_asked
from kneegate_bench.figures import _pct
from kneegate_bench.openloop import Record, _Client

__all__ = ["main", "run_loop"]


async def run_loop(url: str, args: argparse.Namespace, clients: int) -> list[Record]:
    """`clients` users, each sending `--requests` requests in turn; their records."""
    conn = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
    users: list[Record] = []
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
        client = _Client(session, url, args, (0.0, float("inf")))

        async def user() -> None:
            for _ in range(args.requests):
                rec = Record(measured=True)
                users.append(rec)
                await client.one(rec)

        tasks = [asyncio.create_task(user()) for _ in range(clients)]
        bound = args.requests * args.request_timeout
        _, late = await asyncio.wait(tasks, timeout=bound)
        for task in late:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return users


def _cell(users: list[Record], objective: float) -> dict[str, float | int | str | None]:
    good = sum(r.ttft is not None and r.ttft <= objective for r in users)
    refused = [r.reason or str(r.status) for r in users if r.status is not None and r.status != 200]
    ttfts = [r.ttft for r in users if r.ttft is not None]
    p99 = _pct(ttfts, 99)
    return {"sent": len(users), "good": good, "refused": len(refused),
            "reasons": ",".join(f"{k}:{v}" for k, v in sorted(Counter(refused).items())),
            "ttft_p99_ms": None if p99 is None else p99 * 1e3}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kneegate_bench.coldstart",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", default="32,64", help="closed-loop sizes, comma-separated")
    ap.add_argument("--requests", type=int, default=10, help="requests per client")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--arms", default="direct,kneegate", help="direct, kneegate")
    ap.add_argument("--objective", type=float, default=2.0)
    ap.add_argument("--give-up", type=float, default=20.0)
    ap.add_argument("--request-timeout", type=float, default=60.0)
    ap.add_argument("--profile", default="cpu-tiny")
    ap.add_argument("--upstream", help="a running engine, shared by the cells, instead of a "
                    "fresh emulator per cell")
    ap.add_argument("--start-vllm", action="store_true",
                    help="start the real-vLLM tier's vLLM (CPU build, tiny model; a source "
                    "checkout) and use it as --upstream")
    ap.add_argument("--model")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    with vllm_if_asked(args):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    arms = {"direct": Arm("direct"), "kneegate": Arm("kneegate", gateway_flags=())}
    print(f"{'clients':>7} {'round':>5} {'arm':<9} {'sent':>5} {'good':>5} {'/direct':>7} "
          f"{'refused':>7} {'TTFT p99 ms':>11}", flush=True)
    for clients in (int(x) for x in args.clients.split(",")):
        ratios: list[float] = []
        for rnd in range(args.rounds):
            direct_good: int | None = None
            for name in (n.strip() for n in args.arms.split(",")):
                with _serving(arms[name], args.profile, args.upstream) as url:
                    cell = _cell(asyncio.run(run_loop(url, args, clients)), args.objective)
                good = int(cell["good"] or 0)
                if name == "direct":
                    direct_good = good
                ratio = good / direct_good if direct_good else None
                if name == "kneegate" and ratio is not None:
                    ratios.append(ratio)
                p99 = cell["ttft_p99_ms"]
                assert p99 is None or isinstance(p99, float)
                print(f"{clients:>7} {rnd + 1:>5} {name:<9} {cell['sent']:>5} {good:>5} "
                      f"{'-' if ratio is None else format(ratio, '.3f'):>7} "
                      f"{cell['refused']:>7} {'-' if p99 is None else format(p99, '.0f'):>11}"
                      f"  {cell['reasons']}",
                      flush=True)
        if ratios:
            print(f"{clients} clients: kneegate / direct, median over {len(ratios)} rounds: "
                  f"{statistics.median(ratios):.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
