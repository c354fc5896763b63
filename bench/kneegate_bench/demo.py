"""`kneegate demo`: the same overload sent to the engine directly, then through kneegate.

Everything runs on this machine, on loopback: the engine emulator (`cpu-tiny`, its own
process), and for the second half `kneegate serve` in front of a fresh emulator with no
tuning flags. First the engine's capacity is measured (closed loop, a few seconds); then
each arm gets Poisson arrivals at `load` x that capacity for `seconds` (after a short
unmeasured warm-up), streamed, from users who close the stream when no first token has come
`give_up` s after sending and who never retry a rejection. Once a second it prints what the
users see (and, through kneegate, its limit, knee estimate, in-flight and queue), each line
labelled with its phase: `warm-up`, `measured`, then `finishing` (new users still arrive,
unmeasured, until every measured one has its answer or gave up: the direct arm's users
wait longest, so its finishing lines are more). At the end the two arms side by side,
judged by the user's clock: goodput is the output of the users sent in the measured window
whose first token came within the objective (2 s) of sending; under the share served, its
ceiling at that load (capacity / load: 33% at 3x). Then what kneegate learned: its curve of the
engine, the knee and where the limit sits on it (`kneegate_bench.learned`), drawn into `plot`
as well when matplotlib is installed.

The machinery is `kneegate_bench.overload` (one cell of its table per arm); this module adds
the running commentary and the side-by-side summary. Bounded: the capacity run, and per arm
warm-up + `seconds` + at most `drain` s for the measured users to finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path
from typing import Any

import aiohttp

from kneegate_bench.arms import Arm, _serving
from kneegate_bench.figures import summarize
from kneegate_bench.learned import curve_lines, picture
from kneegate_bench.openloop import Record, run_cell
from kneegate_bench.overload import _measure_engine, parser

__all__ = ["run_demo"]

ARMS = (Arm("direct"), Arm("kneegate", gateway_flags=()))
WARMUP = 5.0  # seconds of arrivals before the measured ones: kneegate learns from them


def _settings(load: float, seconds: float, profile: str, drain: float) -> Any:
    return parser().parse_args([
        "--loads", str(load), "--seconds", str(seconds), "--warmup", str(WARMUP),
        "--request-timeout", str(drain), "--capacity-seconds", "4", "--profile", profile])


def _tally(users: list[Record], objective: float) -> tuple[int, int, int, int]:
    """(sent, first token within the objective, rejected, still waiting for a first token)."""
    good = sum(r.ttft is not None and r.ttft <= objective for r in users)
    rejected = sum(r.status is not None and r.status != 200 for r in users)
    waiting = sum(r.ttft is None and r.status in (None, 200) and not r.gave_up
                  and r.error is None for r in users)
    return len(users), good, rejected, waiting


async def _status(session: aiohttp.ClientSession, url: str) -> dict[str, Any] | None:
    with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError, ValueError):
        async with session.get(url + "/kneegate/status") as r:
            if r.status == 200:
                out: dict[str, Any] = await r.json()
                return out
    return None


def _gateway_part(status: dict[str, Any] | None) -> str:
    if status is None:
        return ""
    up = status["upstreams"][0]
    knee = up["controller"].get("knee_estimate")
    knee_s = "-" if not isinstance(knee, (int, float)) else f"{knee:.0f}"
    return (f"   limit {up['limit']:3d}  knee {knee_s:>3}  in flight {up['in_flight']:3d}  "
            f"queued {status['queue_total']:3d}")


def _phase(second: int, seconds: float) -> str:
    """What the arm is doing in its `second`th second (1-based): warm-up, the measured
    window, or finishing (new users still arrive, unmeasured, while the measured ones end)."""
    if second <= WARMUP:
        return f"warm-up {second:2d}s"
    if second <= WARMUP + seconds:
        return f"measured {second - WARMUP:2.0f}s"
    return f"finishing {second - WARMUP - seconds:2.0f}s"


async def _arm(arm: Arm, url: str, rate: float, args: Any, last: dict[str, Any]) -> list[Record]:
    """One arm's cell, with a line a second while it runs; `last` gets kneegate's status."""
    users: list[Record] = []
    if arm.gateway_flags is not None:
        print(f"kneegate at {url}; watch it live: {url}/kneegate/", flush=True)
    cell = asyncio.create_task(run_cell(url, rate, args, seed=args.seed, users=users))
    start, before, second = time.monotonic(), (0, 0, 0, 0), 0
    timeout = aiohttp.ClientTimeout(total=1.0)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        while not cell.done():
            # on whole seconds from the start: the phases' lines are as many as their seconds
            await asyncio.wait({cell}, timeout=max(0.0, start + second + 1 - time.monotonic()))
            second += 1
            status = await _status(session, url) if arm.gateway_flags is not None else None
            if status is not None:
                last.update(status)
            now = _tally(users, args.objective)
            print(f"{arm.name:>8} {_phase(second, args.seconds):>13}  sent "
                  f"{now[0] - before[0]:3d}  first token <= {args.objective:g}s "
                  f"{now[1] - before[1]:3d}  rejected {now[2] - before[2]:3d}  "
                  f"waiting {now[3]:4d}{_gateway_part(status)}", flush=True)
            before = now
    return await cell


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _served(users: list[Record], objective: float, seconds: float) -> tuple[int, float]:
    """The measured users whose first token came within `objective` of sending, and their
    output tokens per second of the measured window (each user's whole answer)."""
    good = [r for r in users if r.measured and r.ttft is not None and r.ttft <= objective]
    return len(good), sum(r.tokens for r in good) / seconds


def _table(rows: dict[str, dict[str, Any]], served: dict[str, tuple[int, float]],
           last: dict[str, Any], args: Any, load: float) -> list[str]:
    d, k = rows["direct"], rows["kneegate"]
    up = last["upstreams"][0] if last.get("upstreams") else None
    knee = up["controller"].get("knee_estimate") if up else None

    def share(name: str) -> str:
        n, users = served[name][0], rows[name]["users"]
        return f"{n} ({n / users:.0%})" if users else "-"

    # at `load` x capacity the engine has time for about 1 / load of the users sent (a
    # short window may read a little more: the warm-up's backlog, the capacity's noise)
    ceiling = f"{min(1.0, 1 / load):.0%}"
    lines = [
        ("users (sent in the measured window)", f"{d['users']}", f"{k['users']}"),
        (f"  first token within {args.objective:g} s of sending", share("direct"),
         share("kneegate")),
        (f"  ceiling at {load:g}x load (capacity / load)", ceiling, ceiling),
        ("goodput: their output, tok/s", f"{served['direct'][1]:.0f}",
         f"{served['kneegate'][1]:.0f}"),
        ("TTFT from send, p50 / p99 ms",
         f"{_fmt(d['ttft_p50_ms'], '.0f')} / {_fmt(d['ttft_p99_ms'], '.0f')}",
         f"{_fmt(k['ttft_p50_ms'], '.0f')} / {_fmt(k['ttft_p99_ms'], '.0f')}"),
        ("rejected, told when to retry", f"{d['rejected']}", f"{k['rejected']}"),
        ("  answered within, p99 ms", _fmt(d["rejection_p99_ms"], ".0f"),
         _fmt(k["rejection_p99_ms"], ".0f")),
        (f"gave up (no first token in {args.give_up:g} s)", f"{d['gave_up']}",
         f"{k['gave_up']}"),
        ("kneegate's limit / knee estimate at the end", "-",
         "-" if up is None else
         f"{up['limit']} / {'-' if not isinstance(knee, (int, float)) else format(knee, '.0f')}"),
    ]
    w = max(len(a) for a, _, _ in lines)
    out = [f"{'':<{w}}  {'direct':>12}  {'kneegate':>12}"]
    out += [f"{a:<{w}}  {b:>12}  {c:>12}" for a, b, c in lines]
    return out


def _learned(last: dict[str, Any], plot: Path | None) -> list[str]:
    """What kneegate learned, as lines; the picture drawn into `plot` when it can be."""
    if not last.get("upstreams"):
        return []
    up = last["upstreams"][0]
    lines = ["", *curve_lines(up)]
    if plot is not None and up["controller"].get("curve"):
        lines.append(f"the same, drawn: {plot}" if picture(up, plot) else
                     f"(with matplotlib, pip install 'kneegate[plots]', it is drawn in {plot})")
    return lines


def run_demo(load: float = 3.0, seconds: float = 20.0, profile: str = "cpu-tiny",
             drain: float = 25.0, plot: Path | None = None) -> int:
    """Run the demo; returns an exit status. Takes about 2 x (seconds + 5) + drain + 15 s.
    Each arm prints a line a second, labelled with its phase: warm-up, measured, finishing;
    at the end the two side by side, then kneegate's learned curve (drawn into `plot` too)."""
    args = _settings(load, seconds, profile, drain)
    print(f"measuring the engine ({profile} emulator) alone: {args.capacity_streams} streams, "
          f"{args.capacity_seconds:g} s ...", flush=True)
    capacity_rps, _, _ = _measure_engine(args, sweep=False)
    if capacity_rps <= 0:
        print("the engine completed nothing in the capacity run")
        return 1
    rate = load * capacity_rps
    print(f"capacity {capacity_rps:.1f} requests/s ({capacity_rps * args.max_tokens:.0f} "
          f"output tok/s); now {load:g}x that, {rate:.1f} new users/s, to the engine "
          f"directly and then through kneegate: {WARMUP:g} s of warm-up, {seconds:g} s "
          f"measured, then up to {drain:g} s finishing (new users still arrive, unmeasured, "
          f"until each measured one has its answer or gives up after {args.give_up:g} s); "
          f"a line a second", flush=True)
    rows: dict[str, dict[str, Any]] = {}
    served: dict[str, tuple[int, float]] = {}
    last: dict[str, Any] = {}
    for arm in ARMS:
        with _serving(arm, profile) as url:
            users = asyncio.run(_arm(arm, url, rate, args, last))
        rows[arm.name] = summarize(users, args.seconds, capacity_rps * args.max_tokens,
                                   args.objective)
        served[arm.name] = _served(users, args.objective, args.seconds)
    print()
    for line in [*_table(rows, served, last, args, load), *_learned(last, plot)]:
        print(line)
    return 0
