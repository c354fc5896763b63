"""Two models behind one gateway: every request routed by its model, each pool at its knee.

    python -m kneegate_bench.two_models                     # 3 runs, 60 s each, 3x load
    python -m kneegate_bench.two_models --runs 1 --duration 10 --warmup 5 \\
        --capacity 300,600                                       # a smoke run, capacities given

Two emulated engines (`kneegate engine`) serve different models at different speeds:
`--engine MODEL:PROFILE:SPEED`, twice; by default chat:cpu-tiny:0.25 and small:cpu-tiny:0.5,
the small model's engine twice as fast (both slower than real time, so that the engines, the
users and the gateways under test leave CPU to spare on a small machine). Each is
first measured alone (closed loop, `--capacity-streams` streams for `--capacity-seconds` after
`--capacity-warmup`, both in the engine's own time, i.e. divided by its speed; capacity in
output tokens/s, as kneegate_bench.overload measures it); `--capacity TOK_S,TOK_S` takes them as
given. Then every run has two arms, fresh engines and gateways for each, meeting the same
arrivals (the order of the arms alternates between runs):

  pooled  one kneegate in front of both engines (`kneegate serve --upstream A --upstream B`:
          what each serves read from its /v1/models, no `models:` anywhere); each model's users
          arrive open loop (Poisson) at `--load` x its engine's capacity, and `--unknown-rate`
          users a second ask for `--unknown-model`, which neither engine serves
  alone   each engine behind a kneegate of its own, both at once, the same users of its model

Users are kneegate_bench.openloop's: streamed, `--prompt-tokens` token ids, `--max-tokens` output
tokens, judged by their own clock from send; a user with no first token after `--give-up` s
leaves. `--warmup` s of arrivals, then the `--duration` s whose users are measured, then
arrivals go on until every measured user has ended (at most `--request-timeout` s). Columns,
per model and arm:

  sent         every user of the cell, warm-up included
  right        answered by an engine serving its model: a 200 whose first chunk names it
  wrong        answered by one that does not: a 200 naming another model, or a 404 (the
               gateway lists both models, so a 404 is an engine refusing a model it lacks);
               must be 0
  goodput      output tokens/s received in the window by measured users whose first token came
               within `--objective` s of sending; /cap over the engine's capacity; /alone, the
               pooled arm's over the alone arm's in the same run
  TTFT         p50 / p99 from send, of the measured users that got a first token
  limit        the gateway's kneegate_limit for the engine at the end of the window (median
               over it): the pool's learned limit against what a gateway of its own learned
  ratio        kneegate_demand_ratio{model} at the end of the window (its median), and
               kneegate_suggested_replicas: each model's own scale-out figure

The unknown model: how many measured users got 404, the gateway's own count of
`model_not_found` (kneegate_client_rejections_total: every user, warm-up included), and the
404s' time from send to the status line, p50 / p99 (issue 46's goal: <= 5 ms). Then the
medians over `--runs`; `--json PATH` writes every figure. Loopback only. Bounded: every user
stream is openloop.run_cell's (a request cap and a time cap), the capacity loop has both, and
/metrics is read every 0.5 s of the measured window only.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shlex
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kneegate_bench.arms import Arm, _child, _serving
from kneegate_bench.loadgen import LoadConfig, closed_loop
from kneegate_bench.openloop import Record, fetch_metrics, metric_totals, run_cell
from kneegate_bench.overhead import _free_port
from kneegate_bench.two_models_figures import (
    COLS,
    gauges,
    median_lines,
    medians,
    model_row,
    row,
    unknown_line,
    unknown_row,
)

__all__ = ["Engine", "main", "parse_engine", "run"]

_ROUND_SEED = 7919
_WATCHED = {"kneegate_limit": "upstream", "kneegate_demand_ratio": "model",
            "kneegate_suggested_replicas": "model"}


@dataclass(frozen=True, slots=True)
class Engine:
    """One emulated engine: the model it serves, its profile and its speed."""

    model: str
    profile: str
    speed: float

    @property
    def flags(self) -> tuple[str, ...]:
        return ("--speed", f"{self.speed:g}", "--model-name", self.model)


def parse_engine(text: str) -> Engine:
    """`chat:cpu-tiny:0.25` -> Engine("chat", "cpu-tiny", 0.25); the speed defaults to 1."""
    model, _, rest = text.partition(":")
    profile, _, speed = rest.partition(":")
    try:
        engine = Engine(model, profile, float(speed or 1.0))
    except ValueError:
        engine = Engine("", "", 0.0)
    if not engine.model or not engine.profile or engine.speed <= 0:
        raise argparse.ArgumentTypeError(
            f"{text!r}: write MODEL:PROFILE:SPEED, e.g. chat:cpu-tiny:0.25")
    return engine


# --- the processes ------------------------------------------------------------------------


def _gateway_flags(args: argparse.Namespace) -> tuple[str, ...]:
    return ("--no-access-log", "--ttft-objective", f"{args.objective:g}")


def measure(engine: Engine, args: argparse.Namespace) -> float:
    """The engine's output tokens/s alone, in a closed loop of `--capacity-streams`, for
    `--capacity-seconds` after `--capacity-warmup` of the engine's own time (a quarter-speed
    engine is measured four times as long: its first answers take four times as long)."""
    seconds = (args.capacity_seconds + args.capacity_warmup) / engine.speed
    with _serving(Arm("direct", engine.flags), engine.profile) as url:
        cfg = LoadConfig(url=url, model=engine.model, prompt_tokens=args.prompt_tokens,
                         max_tokens=args.max_tokens, max_seconds=seconds,
                         warmup=args.capacity_warmup / engine.speed,
                         max_requests=int(args.capacity_streams * seconds * 50))
        return float(asyncio.run(closed_loop(cfg, args.capacity_streams))
                     .summary()["throughput_tok_s"])


@contextlib.contextmanager
def _pooled(engines: list[Engine], args: argparse.Namespace
            ) -> Iterator[tuple[str, dict[str, str]]]:
    """Both engines behind one gateway; yields its URL and each model's engine URL."""
    with contextlib.ExitStack() as stack:
        urls = {e.model: stack.enter_context(_serving(Arm("direct", e.flags), e.profile))
                for e in engines}
        port = _free_port()
        ups = [x for url in urls.values() for x in ("--upstream", url)]
        cmd = [sys.executable, "-m", "kneegate", "serve", *ups, "--port", str(port),
               *_gateway_flags(args)]
        stack.enter_context(_child(cmd, f"http://127.0.0.1:{port}/ready"))
        yield f"http://127.0.0.1:{port}", urls


@contextlib.contextmanager
def _alone(engines: list[Engine], args: argparse.Namespace) -> Iterator[dict[str, str]]:
    """Each engine behind a gateway of its own; yields each model's gateway URL."""
    with contextlib.ExitStack() as stack:
        yield {e.model: stack.enter_context(
            _serving(Arm("alone", e.flags, _gateway_flags(args)), e.profile)) for e in engines}


# --- one cell -----------------------------------------------------------------------------


async def _watch(url: str, window: tuple[float, float],
                 into: dict[tuple[str, str], list[float]], owners: dict[str, str]) -> None:
    """Read the gateway's /metrics every 0.5 s of the window: each watched series' readings
    by (name, upstream or model), and which model each upstream serves into `owners`."""
    start, end = window
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
        while (now := time.monotonic()) < end:
            if now < start:
                await asyncio.sleep(min(0.5, start - now))
                continue
            with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
                async with session.get(url + "/metrics") as resp:
                    text = await resp.text()
                for fam in text_string_to_metric_families(text):
                    for s in fam.samples:
                        if s.name in _WATCHED:
                            key = (s.name, s.labels.get(_WATCHED[s.name], ""))
                            into.setdefault(key, []).append(s.value)
                        elif s.name == "kneegate_upstream_model" and s.value == 1:
                            owners[s.labels["upstream"]] = s.labels["model"]
            await asyncio.sleep(0.5)


def _stream(args: argparse.Namespace, model: str) -> argparse.Namespace:
    """openloop.run_cell's settings for the users of one model."""
    return argparse.Namespace(**{**vars(args), "model": model, "profile": model,
                                 "keys": None, "seconds": args.duration})


async def _cell(gateways: dict[str, str], rates: dict[str, float], args: argparse.Namespace,
                seed: int, unknown: bool) -> tuple[dict[str, list[Record]], dict[str, Any]]:
    """Every model's users at its rate to its gateway (and the unknown model's to the first),
    all at once; the users by model, and what was read from each gateway's /metrics."""
    t0 = time.monotonic()
    window = (t0 + args.warmup, t0 + args.warmup + args.duration)
    models = list(rates)
    if unknown:
        models.append(args.unknown_model)
    cells = [run_cell(gateways.get(m, gateways[models[0]]),
                      rates.get(m, args.unknown_rate), _stream(args, m), seed + 101 * i)
             for i, m in enumerate(models)]
    watched: dict[str, Any] = {url: ({}, {}) for url in set(gateways.values())}
    watchers = [_watch(url, window, into, owners) for url, (into, owners) in watched.items()]
    watching = asyncio.gather(*watchers)  # scheduled now: they read while the users run
    users = await asyncio.gather(*cells)
    await watching
    return dict(zip(models, users, strict=True)), watched


def run_arm(arm: str, engines: list[Engine], capacity: dict[str, float],
            args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """One arm's cell: fresh engines and gateways, the users, the figures."""
    rates = {e.model: args.load * capacity[e.model] / args.max_tokens for e in engines}
    out: dict[str, Any] = {"arm": arm, "models": {}}
    with contextlib.ExitStack() as stack:
        if arm == "pooled":
            gw, engine_urls = stack.enter_context(_pooled(engines, args))
            gateways = {e.model: gw for e in engines}
        else:
            gateways, engine_urls = stack.enter_context(_alone(engines, args)), {}
        users, watched = asyncio.run(_cell(gateways, rates, args, seed, arm == "pooled"))
        refused = (_sample(fetch_metrics(gateways[engines[0].model]),
                           "kneegate_client_rejections_total", reason="model_not_found")
                   if arm == "pooled" else 0.0)
        served = {m: metric_totals(fetch_metrics(u)).get("vllm:request_success_total")
                  for m, u in engine_urls.items()}
    for e in engines:
        into, owners = watched[gateways[e.model]]
        row = model_row(users[e.model], e.model, capacity[e.model], args,
                        gauges(into, owners, e.model))
        row["engine_served"] = served.get(e.model)
        out["models"][e.model] = row
    if arm == "pooled":
        out["unknown"] = unknown_row(users[args.unknown_model], refused)
    return out


def _sample(text: str, name: str, **labels: str) -> float:
    """The sum of the samples `name` whose labels include `labels`."""
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == name and labels.items() <= s.labels.items())


# --- the whole benchmark ------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Capacities, then `--runs` runs of both arms, then the medians; prints as it goes."""
    engines: list[Engine] = args.engine
    report: dict[str, Any] = {
        "command": shlex.join(["python", "-m", "kneegate_bench.two_models", *args.argv]),
        "load": args.load, "objective_s": args.objective, "engines": [], "runs": []}
    print(report["command"], flush=True)
    given = args.capacity or [measure(e, args) for e in engines]
    capacity = {e.model: float(c) for e, c in zip(engines, given, strict=True)}
    for e in engines:
        cap = capacity[e.model]
        report["engines"].append({"model": e.model, "profile": e.profile, "speed": e.speed,
                                  "capacity_tok_s": cap,
                                  "offered_rps": args.load * cap / args.max_tokens})
        print(f"engine {e.model}: {e.profile} at speed {e.speed:g}, capacity {cap:.0f} tok/s "
              f"({'given' if args.capacity else 'measured alone'}); offered {args.load:g}x = "
              f"{args.load * cap / args.max_tokens:.2f} req/s", flush=True)
    for r in range(args.runs):
        print(f"run {r + 1} of {args.runs}\n{COLS}", flush=True)
        arms = ("pooled", "alone") if r % 2 == 0 else ("alone", "pooled")
        cells = {arm: run_arm(arm, engines, capacity, args, args.seed + _ROUND_SEED * r)
                 for arm in arms}
        for e in engines:
            alone = cells["alone"]["models"][e.model]["goodput_tok_s"]
            pooled = cells["pooled"]["models"][e.model]
            pooled["over_alone"] = pooled["goodput_tok_s"] / alone if alone else None
            for arm in ("pooled", "alone"):
                print(row(e.model, arm, cells[arm]["models"][e.model]), flush=True)
        print(unknown_line(args.unknown_model, cells["pooled"]["unknown"]), flush=True)
        report["runs"].append({"run": r, **cells})
    report["medians"] = medians(report["runs"], [e.model for e in engines])
    print(f"medians over {args.runs} run{'s' * (args.runs != 1)}")
    for line in median_lines(report["medians"]):
        print(line, flush=True)
    return report


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m kneegate_bench.two_models",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", type=parse_engine, action="append", default=None,
                    help="MODEL:PROFILE:SPEED, twice (default chat:cpu-tiny:0.25 and "
                         "small:cpu-tiny:0.5)")
    ap.add_argument("--load", type=float, default=3.0, help="x each engine's capacity")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--duration", type=float, default=60.0, help="measured seconds")
    ap.add_argument("--warmup", type=float, default=15.0)
    ap.add_argument("--unknown-model", default="no-such-model")
    ap.add_argument("--unknown-rate", type=float, default=2.0, help="its users a second")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--objective", type=float, default=2.0, help="TTFT from send, seconds")
    ap.add_argument("--give-up", type=float, default=20.0)
    ap.add_argument("--request-timeout", type=float, default=30.0)
    ap.add_argument("--capacity", type=lambda s: [float(x) for x in s.split(",")],
                    default=None, help="each engine's output tok/s, given (skips measuring)")
    ap.add_argument("--capacity-streams", type=int, default=64)
    ap.add_argument("--capacity-seconds", type=float, default=8.0)
    ap.add_argument("--capacity-warmup", type=float, default=2.0)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--json", type=Path, default=None, help="write every figure here")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.engine = args.engine or [parse_engine("chat:cpu-tiny:0.25"),
                                  parse_engine("small:cpu-tiny:0.5")]
    if len(args.engine) != 2 or len({e.model for e in args.engine}) != 2:
        ap.error("--engine: name two engines serving different models")
    if args.unknown_model in {e.model for e in args.engine}:
        ap.error(f"--unknown-model {args.unknown_model!r} is one the engines serve")
    if args.capacity is not None and (len(args.capacity) != 2 or min(args.capacity) <= 0):
        ap.error("--capacity: two output tok/s, one per engine, e.g. 300,600")
    if args.runs < 1 or args.duration <= 0:
        ap.error("--runs must be >= 1 and --duration > 0")
    report = run(args)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
