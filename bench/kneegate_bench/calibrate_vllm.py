"""Calibration against a live vLLM: the real engine and an emulator profile, same load.

    python -m kneegate_bench.calibrate_vllm --start   # start vLLM's CPU build (a checkout)
    python -m kneegate_bench.calibrate_vllm --url http://127.0.0.1:8000   # a running vLLM
    python -m kneegate_bench.calibrate_vllm --replay \
        bench/kneegate_bench/data/vllm-cpu-avx2-2026-11-30.json
                                                       # a recorded run against the profile
    python -m kneegate_bench.calibrate_vllm --fit run.json   # fit a profile's costs to
                                                         # the real curve of an earlier --out

Load (both sides): prompts of 128 tokens sent as token ids, 64 output tokens, ignore_eos,
streaming, a closed loop at 1, 2, 4, ..., 128 clients. Each real level runs a warm-up and
then a measured part, both growing with the level: one request at c clients on the plateau
lasts about c x 64 / plateau seconds, so that the measured part spans about three of them
(at ~250 tok/s, 64 clients: 15 s warm-up, 48 s measured). `--time-scale` stretches or shrinks
both. The emulator runs the same load in virtual time (`emulate`): the same warm-up and
measured seconds per level, and a client turnaround of CLIENT_GAP_S between a response's end
and the next request reaching the engine, in well under a second.

Prints per level tok/s, TTFT p50 and p99 and TPOT p50 of both and the emulator's error; then
the plateau ratio (emulated peak / real peak), the knee ratio (emulated / real, by
`curve_knee`; the 5% rule's beside it) and whether the tok/s curve, plateau and knee agree
within ±20% (the issue's bound), then the same for the latencies. `--fit` searches the
profile's cost constants (kneegate_bench.calibrate.FIT_KEYS) for the least squared log error
against the real curve (tok/s weighs triple, a different 5%-rule knee costs KNEE_PENALTY), in
virtual time, and prints the constants and the curves side by side again. `--start` runs the
vLLM the integration tier runs (tests/real_vllm/vllm_server.py): the 37.8M tiny Llama, engine
defaults, float32 unless the CPU has native bf16. It needs about 4.5 GB of memory and takes
about 5 minutes on 2 cores; do not run it next to the tier.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import json
import math
import sys
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kneegate.emulator.core import EngineCore
from kneegate.emulator.profiles import load_profile
from kneegate.emulator.virtual import LoopResult
from kneegate.emulator.virtual import closed_loop as virtual_loop
from kneegate.sim.knee_rule import Knee, find_knee
from kneegate_bench.curve_fit import CurveKnee, curve_knee
from kneegate_bench.loadgen import LoadConfig, LoadResult, closed_loop

__all__ = [
    "CLIENT_GAP_S", "DEFAULT_PROFILE", "LEVELS", "CurveKnee", "RealPoint", "compare",
    "curve_knee", "emulate", "fit", "fit_error", "knee_of", "level_timing", "load_real", "main",
    "sweep_engine",
]

LEVELS = [1, 2, 4, 8, 16, 32, 64, 128]
TOLERANCE = 0.20  # the bound on emulated vs real, per figure
# The profile fitted to this tier's vLLM: the tiny model in float32 on a 2-vCPU AVX2 EPYC.
# cpu-tiny is fitted to the issue-2 table, measured on a ~4x faster machine (see profiles.yaml).
DEFAULT_PROFILE = "cpu-tiny-avx2"
# A response's end to the next request in the engine: the client's and vLLM's API server's
# turnaround. From the recorded 1-client level: 64 tokens / 75.13 tok/s = 0.852 s a request,
# TTFT 0.132 s + 63 x TPOT 11.3 ms = 0.844 s of it in the engine, 8 ms between. It matters in a
# busy engine: the next step starts at once, without the request that just came back.
CLIENT_GAP_S = 0.008
KNEE_PENALTY = 2.0  # --fit: added to the squared log error when the 5%-rule knees differ


@dataclass(frozen=True, slots=True)
class RealPoint:
    """One closed-loop level measured on a live engine."""

    level: int
    throughput: float  # output tokens / s over the measured part
    ttft_p50: float | None
    ttft_p99: float | None
    tpot_p50: float | None
    ok: int  # requests started and finished inside the measured part
    errors: int  # anything but ok or cancelled (in flight when time ran out)


def level_timing(level: int, scale: float = 1.0) -> tuple[float, float]:
    """(warm-up, measured) seconds for one level: about three request lifetimes measured.

    Identical requests in a closed loop fall into step (they start, prefill and finish
    together), so tokens arrive in waves of one request lifetime: a window of two of them
    read 204.8 tok/s at both 8 and 16 clients, 2048 tokens in 10 s either way.
    """
    return scale * (2.0 + 0.2 * level), scale * max(15.0, 0.75 * level)


def _point(level: int, result: LoadResult) -> RealPoint:
    s = result.summary()
    errors = sum(n for k, n in s["outcomes"].items() if k not in ("ok", "cancelled"))
    return RealPoint(level, s["throughput_tok_s"], s["ttft_p50"], s["ttft_p99"],
                     s["tpot_p50"], s["outcomes"].get("ok", 0), errors)


async def sweep_engine(
    url: str,
    levels: Sequence[int],
    *,
    model: str | None = None,
    scale: float = 1.0,
    print_rows: bool = True,
) -> list[RealPoint]:
    """Closed-loop levels against `url` with the calibration load; one RealPoint each."""
    points = []
    for level in levels:
        warmup, measured = level_timing(level, scale)
        cfg = LoadConfig(url=url, model=model, prompt_tokens=128, max_tokens=64, stream=True,
                         ignore_eos=True, max_seconds=warmup + measured, warmup=warmup,
                         max_requests=100 * level + 1000)
        point = _point(level, await closed_loop(cfg, level))
        points.append(point)
        if print_rows:
            print(f"  real {level:>4} clients: {point.throughput:7.1f} tok/s  TTFT p50 "
                  f"{_ms(point.ttft_p50)}  TPOT p50 {_ms(point.tpot_p50)}  ok {point.ok}  "
                  f"errors {point.errors}", flush=True)
    return points


def knee_of(points: Sequence[RealPoint]) -> Knee:
    """The 5% rule over a real sweep."""
    return find_knee([p.level for p in points], [p.throughput for p in points])


def emulate(
    profile: str,
    levels: Sequence[int],
    *,
    scale: float = 1.0,
    client_gap: float = CLIENT_GAP_S,
    overrides: dict[str, Any] | None = None,
) -> list[LoopResult]:
    """The calibration load on `profile` in virtual time: each level timed as the real one."""
    prof = load_profile(profile, **(overrides or {}))
    points = []
    for level in levels:
        warmup, measured = level_timing(level, scale)
        points.append(virtual_loop(lambda: EngineCore(prof), level, warmup + measured, 128, 64,
                                  warmup=warmup, client_gap=client_gap,
                                  started_after_warmup=True))
    return points


def _ms(x: float | None) -> str:
    return "     -" if x is None else f"{x * 1e3:6.0f}"


def _err(emu: float, real: float | None) -> float | None:
    return None if not real or not math.isfinite(emu) else emu / real - 1


def _pct(x: float | None) -> str:
    return "    -" if x is None else f"{x:+5.0%}"


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _inside(x: float | None) -> bool:
    return x is not None and abs(x) <= TOLERANCE


FIGURES = ("throughput", "ttft_p50", "ttft_p99", "tpot_p50")


def compare(real: Sequence[RealPoint], emulated: Sequence[LoopResult]) -> dict[str, Any]:
    """Print both curves side by side; return the figures (errors, plateau and knee ratios).

    within_tolerance: every level's tok/s, the plateau and the knee (`curve_knee`) within ±20%;
    the 5%-rule knees and their ratio are printed and returned beside it.
    latency_within_tolerance: the same for every level's TTFT p50 and p99 and TPOT p50.
    """
    print(f"{'clients':>7} | {'tok/s real':>10} {'emu':>6} {'err':>5} | {'TTFT p50':>8} "
          f"{'emu':>6} {'err':>5} | {'TTFT p99':>8} {'emu':>6} {'err':>5} | {'TPOT p50':>8} "
          f"{'emu':>6} {'err':>5}")
    errs: dict[str, list[float]] = {k: [] for k in FIGURES}
    for r, e in zip(real, emulated, strict=True):
        row = {k: _err(getattr(e, k), getattr(r, k)) for k in FIGURES}
        for k, v in row.items():
            if v is not None:
                errs[k].append(v)
        print(f"{r.level:>7} | {r.throughput:>10.1f} {e.throughput:>6.1f} "
              f"{_pct(row['throughput'])} | {_ms(r.ttft_p50):>8} {e.ttft_p50 * 1e3:>6.0f} "
              f"{_pct(row['ttft_p50'])} | {_ms(r.ttft_p99):>8} {e.ttft_p99 * 1e3:>6.0f} "
              f"{_pct(row['ttft_p99'])} | {_ms(r.tpot_p50):>8} {e.tpot_p50 * 1e3:>6.1f} "
              f"{_pct(row['tpot_p50'])}")
    levels = [r.level for r in real]
    rk, ek = knee_of(real), find_knee(levels, [e.throughput for e in emulated])
    rc = curve_knee(levels, [r.throughput for r in real])
    ec = curve_knee(levels, [e.throughput for e in emulated])
    plateau = ek.peak / rk.peak if rk.peak else None
    knee = ec.level / rc.level if ec.level and rc.level else None
    rule = ek.level / rk.level if ek.level and rk.level else None
    worst = {k: max(v, key=abs) if v else None for k, v in errs.items()}
    print(f"plateau (peak tok/s): real {rk.peak:.1f} at {rk.peak_level}, emulated "
          f"{ek.peak:.1f} at {ek.peak_level}: ratio {_ratio(plateau)}")
    print(f"knee (fitted a c / (1 + c/k), a doubling adds 5%): real {_level(rc.level)}, "
          f"emulated {_level(ec.level)}: ratio {_ratio(knee)} (fit rms error real "
          f"{rc.rms_log_error:.1%}, emulated {ec.rms_log_error:.1%})")
    print(f"knee (5% rule, one step): real {rk.level}, emulated {ek.level}: ratio {_ratio(rule)}")
    print("worst per-level error: " + ", ".join(f"{k} {_pct(v)}" for k, v in worst.items()))
    inside = all(_inside(x) for x in (worst["throughput"], _less_one(plateau), _less_one(knee)))
    latency = all(_inside(worst[k]) for k in FIGURES[1:])
    print(f"tok/s curve, plateau and knee within ±{TOLERANCE:.0%}: {'yes' if inside else 'no'}")
    print(f"TTFT p50/p99 and TPOT p50 within ±{TOLERANCE:.0%}: {'yes' if latency else 'no'}")
    return {"plateau_ratio": plateau, "knee_ratio": knee, "real_curve_knee": asdict(rc),
            "emulated_curve_knee": asdict(ec), "knee_ratio_5pct_rule": rule,
            "real_knee": asdict(rk), "emulated_knee": asdict(ek), "worst_error": worst,
            "within_tolerance": inside, "latency_within_tolerance": latency}


def _level(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def _less_one(ratio: float | None) -> float | None:
    return None if ratio is None else ratio - 1


def fit_error(real: Sequence[RealPoint], profile: str, overrides: dict[str, float]) -> float:
    """Squared log error of the emulated curve against the real one; throughput weighs triple,
    a different 5%-rule knee adds KNEE_PENALTY (the plateau's onset is what the gate steers by).
    """
    emulated = emulate(profile, [p.level for p in real], overrides=overrides)
    err = 0.0
    for r, e in zip(real, emulated, strict=True):
        err += 3 * math.log(max(e.throughput, 1e-9) / r.throughput) ** 2
        for got, want in ((e.ttft_p50, r.ttft_p50), (e.tpot_p50, r.tpot_p50)):
            if want:
                err += math.log(got / want) ** 2
    if knee_of(real).level != find_knee([r.level for r in real],
                                        [e.throughput for e in emulated]).level:
        err += KNEE_PENALTY
    # no request finished inside the window (NaN latencies): worse than any real fit
    return err if math.isfinite(err) else math.inf


def fit(real: Sequence[RealPoint], profile: str, rounds: int = 6) -> dict[str, float]:
    """Coordinate search: each key moves by a factor while that helps; the factor halves."""
    from kneegate_bench.calibrate import FIT_KEYS

    cost = load_profile(profile).cost
    best = {k: float(getattr(cost, k)) or 1e-4 for k in FIT_KEYS}  # 0 would never move
    best_err = fit_error(real, profile, best)
    factor = 2.0
    for _ in range(rounds):
        for key in FIT_KEYS:
            for scale in (factor, 1 / factor):
                for _step in range(8):  # bounded walk in one direction
                    trial = {**best, key: best[key] * scale}
                    if key in ("mfu", "bandwidth_efficiency") and trial[key] > 1:
                        break
                    err = fit_error(real, profile, trial)
                    if err >= best_err:
                        break
                    best, best_err = trial, err
        factor = 1 + (factor - 1) / 2
        print(f"fit: error {best_err:.4f} at {best}", flush=True)
    return best


def load_real(path: str | Path) -> list[RealPoint]:
    """The real curve of a recorded run (an --out file or bench/kneegate_bench/data/*.json)."""
    return [RealPoint(**p) for p in json.loads(Path(path).read_text())["real"]]


@contextlib.contextmanager
def _started_vllm(*extra: str) -> Iterator[str]:
    """The tier's vLLM (tests/real_vllm/vllm_server.py), with `extra` flags, for the block."""
    # the tier's launcher lives beside the tests; it needs a source checkout
    tier = Path(__file__).resolve().parents[2] / "tests" / "real_vllm"
    if not (tier / "vllm_server.py").exists():
        raise SystemExit(f"--start needs a source checkout with {tier}/vllm_server.py")
    sys.path.insert(0, str(tier))
    launcher = importlib.import_module("vllm_server")
    with launcher.running_vllm(*extra) as server:
        print(f"vLLM {launcher.VLLM_VERSION} at {server.url} (log {server.log})", flush=True)
        yield str(server.url)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running vLLM serving the tiny model")
    where.add_argument("--start", action="store_true", help="start the tier's vLLM for the run")
    where.add_argument("--replay", metavar="JSON",
                       help="compare the profile with the real curve of a recorded run")
    where.add_argument("--fit", metavar="JSON", help="fit the profile to a recorded run")
    ap.add_argument("--levels", default=",".join(map(str, LEVELS)))
    ap.add_argument("--time-scale", type=float, default=1.0,
                    help="x warm-up and measured time (both sides)")
    ap.add_argument("--profile", default=DEFAULT_PROFILE, help=(
        f"emulator profile to compare (default {DEFAULT_PROFILE}: fitted to the live vLLM of "
        "tests/real_vllm on a 2-vCPU AVX2 EPYC, float32, the machine this tier runs on; "
        "cpu-tiny matches the issue-2 table from a ~4x faster machine)"))
    ap.add_argument("--client-gap", type=float, default=CLIENT_GAP_S,
                    help="emulated client turnaround, seconds (default %(default)s)")
    ap.add_argument("--model", help="served model name (default: the first of /v1/models)")
    ap.add_argument("--out", help="write both curves and the ratios as JSON here")
    args = ap.parse_args(argv)
    levels = sorted({int(x) for x in args.levels.split(",") if x})

    overrides: dict[str, Any] = {}
    if args.fit or args.replay:
        real = load_real(args.fit or args.replay)
        if args.fit:
            overrides = dict(fit(real, args.profile))
    else:
        with contextlib.ExitStack() as stack:
            url = args.url or stack.enter_context(_started_vllm())
            real = asyncio.run(sweep_engine(url, levels, model=args.model,
                                            scale=args.time_scale))
    emulated = emulate(args.profile, [p.level for p in real], scale=args.time_scale,
                       client_gap=args.client_gap, overrides=overrides)
    print(f"\nvLLM vs emulator '{args.profile}' (prompt 128, output 64, closed loop; "
          "TTFT and TPOT in ms)")
    figures = compare(real, emulated)
    if overrides:
        figures["fitted"] = overrides
    if args.out:
        Path(args.out).write_text(json.dumps({
            "profile": args.profile,
            "real": [asdict(p) for p in real],
            "emulated": [asdict(e) for e in emulated],
            **figures,
        }, indent=2))


if __name__ == "__main__":
    main()
