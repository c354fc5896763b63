"""Calibration against a live vLLM: the real engine and the emulator's cpu-tiny, same load.

    python -m benchmarks.calibrate_vllm --start        # start vLLM's CPU build (source checkout)
    python -m benchmarks.calibrate_vllm --url http://127.0.0.1:8000   # a vLLM already running
    python -m benchmarks.calibrate_vllm --fit run.json   # fit a profile's cost constants to
                                                         # the real curve of an earlier --out

Load (both sides): prompts of 128 tokens sent as token ids, 64 output tokens, ignore_eos,
streaming, a closed loop at 1, 2, 4, ..., 128 clients. Each real level runs a warm-up and
then a measured part, both growing with the level: one request at c clients on the plateau
lasts about c x 64 / plateau seconds, so that the measured part spans about three of them
(at ~250 tok/s, 64 clients: 15 s warm-up, 48 s measured). `--time-scale` stretches or shrinks
both. The emulator runs the same load in virtual time (`benchmarks.calibrate.sweep`), in a
second or two.

Prints per level tok/s, TTFT p50 and TPOT p50 of both and the emulator's error; then the
plateau ratio (emulated peak / real peak) and the knee ratio (5% rule, emulated / real).
`--fit` searches the profile's cost constants (benchmarks.calibrate.FIT_KEYS) for the least
squared log error against the real curve (tok/s weighs triple), in virtual time, and prints
the constants and the curves side by side again. `--start` runs the vLLM the integration
tier runs (tests/real_vllm/vllm_server.py): the
37.8M tiny Llama, engine defaults, float32 unless the CPU has native bf16. It needs about
4.5 GB of memory and takes about 5 minutes on 2 cores; do not run it next to the tier.
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

from benchmarks.loadgen import LoadConfig, LoadResult, closed_loop
from benchmarks.sweep import Knee, find_knee

__all__ = [
    "LEVELS", "RealPoint", "compare", "fit", "fit_error", "knee_of", "level_timing", "main",
    "sweep_engine",
]

LEVELS = [1, 2, 4, 8, 16, 32, 64, 128]
TOLERANCE = 0.20  # the bound on emulated vs real, per figure


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


def _ms(x: float | None) -> str:
    return "     -" if x is None else f"{x * 1e3:6.0f}"


def _err(emu: float, real: float | None) -> float | None:
    return None if not real else emu / real - 1


def _pct(x: float | None) -> str:
    return "    -" if x is None else f"{x:+5.0%}"


def compare(real: Sequence[RealPoint], emulated: Sequence[Any]) -> dict[str, Any]:
    """Print both curves side by side; return the figures (errors, plateau and knee ratios).

    `emulated` holds benchmarks.engine.virtual.LoopResult, one per level of `real`.
    """
    print(f"{'clients':>7} | {'tok/s real':>10} {'emu':>6} {'err':>5} | {'TTFT real':>9} "
          f"{'emu':>6} {'err':>5} | {'TPOT real':>9} {'emu':>6} {'err':>5}")
    errs: dict[str, list[float]] = {"throughput": [], "ttft_p50": [], "tpot_p50": []}
    for r, e in zip(real, emulated, strict=True):
        row = {k: _err(getattr(e, k), getattr(r, k)) for k in errs}
        for k, v in row.items():
            if v is not None:
                errs[k].append(v)
        print(f"{r.level:>7} | {r.throughput:>10.1f} {e.throughput:>6.1f} "
              f"{_pct(row['throughput'])} | {_ms(r.ttft_p50):>9} {e.ttft_p50 * 1e3:>6.0f} "
              f"{_pct(row['ttft_p50'])} | {_ms(r.tpot_p50):>9} {e.tpot_p50 * 1e3:>6.1f} "
              f"{_pct(row['tpot_p50'])}")
    rk = knee_of(real)
    ek = find_knee([r.level for r in real], [e.throughput for e in emulated])
    plateau = ek.peak / rk.peak if rk.peak else None
    knee = ek.level / rk.level if ek.level and rk.level else None
    worst = {k: max(v, key=abs) if v else None for k, v in errs.items()}
    print(f"plateau (peak tok/s): real {rk.peak:.1f} at {rk.peak_level}, emulated "
          f"{ek.peak:.1f} at {ek.peak_level}: ratio {plateau or float('nan'):.2f}")
    print(f"knee (5% rule): real {rk.level}, emulated {ek.level}: ratio "
          f"{knee or float('nan'):.2f}")
    print("worst per-level error: " + ", ".join(f"{k} {_pct(v)}" for k, v in worst.items()))
    inside = all(v is None or abs(v) <= TOLERANCE for v in worst.values()) and (
        plateau is not None and abs(plateau - 1) <= TOLERANCE)
    print(f"within ±{TOLERANCE:.0%}: {'yes' if inside else 'no'}")
    return {"plateau_ratio": plateau, "knee_ratio": knee, "real_knee": asdict(rk),
            "emulated_knee": asdict(ek), "worst_error": worst, "within_tolerance": inside}


def fit_error(real: Sequence[RealPoint], profile: str, overrides: dict[str, float]) -> float:
    """Squared log error of the emulated curve against the real one; throughput weighs triple."""
    from benchmarks.calibrate import sweep as emulate

    err = 0.0
    for r, e in zip(real, emulate(profile, [p.level for p in real], seconds=20.0,
                                  overrides=overrides), strict=True):
        err += 3 * math.log(max(e.throughput, 1e-9) / r.throughput) ** 2
        for got, want in ((e.ttft_p50, r.ttft_p50), (e.tpot_p50, r.tpot_p50)):
            if want:
                err += math.log(got / want) ** 2
    # no request finished inside the window (NaN latencies): worse than any real fit
    return err if math.isfinite(err) else math.inf


def fit(real: Sequence[RealPoint], profile: str, rounds: int = 4) -> dict[str, float]:
    """Coordinate search: each key moves by a factor while that helps; the factor halves."""
    from benchmarks.calibrate import FIT_KEYS
    from benchmarks.engine.profiles import load_profile

    cost = load_profile(profile).cost
    best = {k: float(getattr(cost, k)) for k in FIT_KEYS}
    best_err = fit_error(real, profile, best)
    factor = 2.0
    for _ in range(rounds):
        for key in FIT_KEYS:
            for scale in (factor, 1 / factor):
                for _step in range(6):  # bounded walk in one direction
                    trial = {**best, key: best[key] * scale}
                    if key.endswith("efficiency") and trial[key] > 1:
                        break
                    err = fit_error(real, profile, trial)
                    if err >= best_err:
                        break
                    best, best_err = trial, err
        factor = 1 + (factor - 1) / 2
        print(f"fit: error {best_err:.4f} at {best}", flush=True)
    return best


def _load_real(path: str) -> list[RealPoint]:
    return [RealPoint(**p) for p in json.loads(Path(path).read_text())["real"]]


@contextlib.contextmanager
def _started_vllm() -> Iterator[str]:
    # the tier's launcher lives beside the tests; it needs a source checkout
    tier = Path(__file__).resolve().parents[1] / "tests" / "real_vllm"
    if not (tier / "vllm_server.py").exists():
        raise SystemExit(f"--start needs a source checkout with {tier}/vllm_server.py")
    sys.path.insert(0, str(tier))
    launcher = importlib.import_module("vllm_server")
    with launcher.running_vllm() as server:
        print(f"vLLM {launcher.VLLM_VERSION} at {server.url} (log {server.log})", flush=True)
        yield str(server.url)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running vLLM serving the tiny model")
    where.add_argument("--start", action="store_true", help="start the tier's vLLM for the run")
    where.add_argument("--fit", metavar="JSON", help="fit the profile to an earlier --out file")
    ap.add_argument("--levels", default=",".join(map(str, LEVELS)))
    ap.add_argument("--time-scale", type=float, default=1.0, help="x warm-up and measured time")
    ap.add_argument("--profile", default="cpu-tiny", help="emulator profile to compare")
    ap.add_argument("--model", help="served model name (default: the first of /v1/models)")
    ap.add_argument("--out", help="write both curves and the ratios as JSON here")
    args = ap.parse_args(argv)
    levels = sorted({int(x) for x in args.levels.split(",") if x})
    from benchmarks.calibrate import sweep as emulate

    overrides: dict[str, Any] = {}
    if args.fit:
        real = _load_real(args.fit)
        overrides = dict(fit(real, args.profile))
    else:
        with contextlib.ExitStack() as stack:
            url = args.url or stack.enter_context(_started_vllm())
            real = asyncio.run(sweep_engine(url, levels, model=args.model,
                                            scale=args.time_scale))
    emulated = emulate(args.profile, [p.level for p in real], seconds=30.0, overrides=overrides)
    print(f"\nvLLM vs emulator '{args.profile}' (prompt 128, output 64, closed loop; "
          "TTFT and TPOT p50 in ms)")
    figures = compare(real, emulated)
    if overrides:
        figures["fitted"] = overrides
    if args.out:
        Path(args.out).write_text(json.dumps({
            "real": [asdict(p) for p in real],
            "emulated": [asdict(e) for e in emulated],
            **figures,
        }, indent=2))


if __name__ == "__main__":
    main()
