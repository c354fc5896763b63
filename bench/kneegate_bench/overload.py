"""Wall-clock overload: open-loop Poisson arrivals past capacity, judged by the user's clock.

    python -m kneegate_bench.overload                                  # every arm, 1.5x/3x/10x
    python -m kneegate_bench.overload --loads 3 --seconds 10 --arms direct,kneegate  # smoke

One run, so the ratios are measured side by side. First the engine (`python -m
kneegate.emulator --profile cpu-tiny`, its own process) is measured alone: closed loop,
`--capacity-streams` (64) streams for `--capacity-seconds` after `--capacity-warmup` (2 s;
a fresh vLLM needs more: its first requests are slow); capacity in requests/s =
output tokens/s / `--max-tokens` (tokens, not loadgen's requests_per_s, which leaves out the
requests started in the warm-up); `--capacity TOK_S` takes it as given instead (two builds
run one after the other then offer the same rate). Then, for every arm and load, a fresh
engine (and gateway) receives Poisson arrivals at load x capacity (with `--upstream`, that
engine, once it runs and queues nothing: `_wait_idle`): streamed, `--prompt-tokens` (128)
token ids, `--max-tokens` (64) output tokens (`--spread 0.5`: each user's drawn within +-50%,
the mean unchanged), ignore_eos. A user with no first token `--give-up` (20) s after
sending closes the stream (gave up); a rejection is not retried.

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
                  the 20% back-off of kneegate_bench.sweep; keep each step longer than one answer
                  at the top level, or that level reads low)
  litellm, litellm-N, vllm-router, vllm-router-N
                  the gateways a vLLM user would pick instead (kneegate_bench.peers; installed
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
import json
import shlex
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kneegate_bench.arms import (
    ARMS,
    Arm,
    _arm_names,
    _serving,
    parse_arms,
    valve_sizes,
    vllm_if_asked,
)
from kneegate_bench.figures import (
    _COLS,
    _MEDIAN_COLS,
    _key_row,
    _median_row,
    _row,
    gateway_medians,
    per_key,
    round_medians,
    summarize,
)
from kneegate_bench.loadgen import LoadConfig, closed_loop
from kneegate_bench.openloop import Record, late_ticks, metric_totals, run_cell
from kneegate_bench.peers import find
from kneegate_bench.sweep import run_sweep

__all__ = ["Arm", "Record", "gateway_medians", "late_ticks", "main", "metric_totals", "parse_arms",
           "round_medians", "run", "summarize", "valve_sizes"]

_ROUND_SEED = 7919  # a round's arrivals: seed + this x the round (round 0: the seed's own)
_STARTUP_S = 10.0  # what the table's time bound allows per cell to start and stop processes


# -- the client ----------------------------------------------------------------------------


# -- figures -------------------------------------------------------------------------------


# -- arms and processes --------------------------------------------------------------------


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
    with vllm_if_asked(args):  # one vLLM for the plain arms; each valve arm starts its own
        return _run(args)


def _run(args: argparse.Namespace) -> Report:
    loads = [float(x) for x in args.loads.split(",") if x.strip()]
    names = _arm_names(args.arms)
    rep = Report(command=shlex.join(["python", "-m", "kneegate_bench.overload", *args.argv]))
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


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m kneegate_bench.overload", description=__doc__,
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
    ap.add_argument("--spread", type=float, default=0.0,
                    help="answers of varied length: each user's max_tokens drawn uniformly "
                    "within +-SPREAD of --max-tokens (0.5: 32-96 at 64), the mean unchanged")
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
