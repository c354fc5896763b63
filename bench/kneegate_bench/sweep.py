"""The operator's method made a tool: step concurrency up, find the knee, back off.

    kneegate sweep --url http://127.0.0.1:8000 --levels 1,2,4,8,16,32,64 --step-seconds 30
    kneegate sweep --url ... --start 10 --step 10 --stop 200 --out sweep-out

Each level is a closed-loop run (kneegate_bench.loadgen) of `--warmup` + `--step-seconds`;
throughput is output tokens/s over the measured part. The knee is the last level whose next
step adds less than `--min-gain` (5%) throughput; the safe level is `--backoff` (80%) of it,
rounded down, at least 1 (the rule: kneegate.sim.knee_rule). Prints a table as it goes; writes
sweep.json and sweep.png (tokens/s and TTFT/TPOT against concurrency, regions shaded, knee and
safe level marked) to `--out`. Works against any OpenAI-compatible URL: the emulator, a real
vLLM, or kneegate itself.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kneegate.sim.knee_rule import Knee, find_knee

__all__ = ["SweepPoint", "main", "parse_levels", "regions", "run_sweep"]


@dataclass(frozen=True, slots=True)
class SweepPoint:
    level: int
    throughput: float  # output tokens / s
    ttft_p50: float | None
    tpot_p50: float | None
    ok: int
    errors: int  # requests that ended in anything but ok or cancelled


def parse_levels(
    text: str | None, start: int | None, step: int | None, stop: int | None
) -> list[int]:
    """`--levels 1,2,4` or `--start 10 --step 10 --stop 100`; ascending, positive."""
    if text:
        levels = sorted({int(x) for x in text.replace(" ", "").split(",") if x})
    elif start and step and stop:
        levels = list(range(start, stop + 1, step))
    else:
        raise ValueError("give --levels 1,2,4,... or --start N --step N --stop N")
    if not levels or levels[0] < 1:
        raise ValueError(f"levels must be positive integers, got {levels}")
    return levels


def regions(points: list[SweepPoint], knee: Knee) -> dict[str, tuple[int, int]]:
    """Level ranges of the linear, plateau and decline regions (the low region is level 1)."""
    levels = [p.level for p in points]
    out: dict[str, tuple[int, int]] = {}
    if knee.level is None:
        out["linear"] = (levels[0], levels[-1])
        return out
    out["linear"] = (levels[0], knee.level)
    declining = [
        p.level for p in points if p.level > knee.peak_level and p.throughput < 0.9 * knee.peak
    ]
    end = declining[0] if declining else levels[-1]
    out["plateau"] = (knee.level, end)
    if declining:
        out["decline"] = (declining[0], levels[-1])
    return out


async def run_sweep(
    url: str,
    levels: list[int],
    *,
    step_seconds: float,
    warmup: float,
    prompt_tokens: int = 128,
    max_tokens: int = 64,
    min_gain: float = 0.05,
    backoff: float = 0.8,
    stop_at_knee: bool = False,
    model: str | None = None,
    stream: bool = True,
    print_rows: bool = True,
) -> tuple[list[SweepPoint], Knee]:
    """Closed-loop steps over `levels`; returns the points and the knee."""
    from kneegate_bench.loadgen import LoadConfig, closed_loop

    points: list[SweepPoint] = []
    if print_rows:
        print(
            f"{'level':>6} {'tok/s':>9} {'gain':>7} {'TTFT p50':>9} {'TPOT p50':>9} "
            f"{'ok':>6} {'errors':>6}",
            flush=True,
        )
    for level in levels:
        cfg = LoadConfig(
            url=url,
            model=model,
            prompt_tokens=prompt_tokens,
            max_tokens=max_tokens,
            stream=stream,
            max_seconds=step_seconds + warmup,
            warmup=warmup,
            max_requests=10**9,
        )
        s = (await closed_loop(cfg, level)).summary()
        errors = sum(n for k, n in s["outcomes"].items() if k not in ("ok", "cancelled"))
        point = SweepPoint(
            level,
            s["throughput_tok_s"],
            s["ttft_p50"],
            s["tpot_p50"],
            s["outcomes"].get("ok", 0),
            errors,
        )
        gain = (
            point.throughput / points[-1].throughput - 1
            if points and points[-1].throughput
            else None
        )
        points.append(point)
        if print_rows:
            print(
                f"{level:>6} {point.throughput:>9.1f} {_fmt_pct(gain):>7} "
                f"{_fmt_ms(point.ttft_p50):>9} {_fmt_ms(point.tpot_p50):>9} "
                f"{point.ok:>6} {errors:>6}",
                flush=True,
            )
        knee = find_knee(
            [p.level for p in points],
            [p.throughput for p in points],
            min_gain=min_gain,
            backoff=backoff,
        )
        if stop_at_knee and knee.level is not None:
            break
    return points, find_knee(
        [p.level for p in points],
        [p.throughput for p in points],
        min_gain=min_gain,
        backoff=backoff,
    )


def _fmt_pct(x: float | None) -> str:
    return "" if x is None else f"{x:+.1%}"


def _fmt_ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}ms"


def write_outputs(out: Path, points: list[SweepPoint], knee: Knee, meta: dict[str, Any]) -> None:
    """sweep.json and sweep.png under `out`."""
    out.mkdir(parents=True, exist_ok=True)
    data = {
        **meta,
        "points": [asdict(p) for p in points],
        "knee": asdict(knee),
        "regions": regions(points, knee),
    }
    (out / "sweep.json").write_text(json.dumps(data, indent=2))
    plot(points, knee, out / "sweep.png", title=str(meta.get("url", "")))


def plot(points: list[SweepPoint], knee: Knee, path: Path, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = [p.level for p in points]
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(8, 7))
    top.plot(levels, [p.throughput for p in points], "o-", color="C0")
    top.set_ylabel("output tokens/s")
    top.set_title(f"concurrency sweep {title}".strip())
    bottom.plot(levels, [_ms(p.ttft_p50) for p in points], "o-", color="C1", label="TTFT p50")
    bottom.set_ylabel("TTFT p50 (ms)")
    right = bottom.twinx()
    right.plot(levels, [_ms(p.tpot_p50) for p in points], "s--", color="C2", label="TPOT p50")
    right.set_ylabel("TPOT p50 (ms)")
    bottom.set_xlabel("concurrency")
    if len(levels) > 1 and levels[-1] / levels[0] >= 8:
        bottom.set_xscale("log", base=2)
    colors = {"linear": "#d8f0d8", "plateau": "#fff2c0", "decline": "#f8d0d0"}
    for name, (lo, hi) in regions(points, knee).items():
        for ax in (top, bottom):
            ax.axvspan(lo, hi, color=colors[name], alpha=0.6, label=name if ax is top else None)
    for ax in (top, bottom):
        if knee.level is not None:
            ax.axvline(knee.level, color="red", label="knee" if ax is top else None)
        if knee.safe is not None:
            ax.axvline(knee.safe, color="green", ls=":", label="safe" if ax is top else None)
    top.legend(loc="lower right", fontsize=8)
    bottom.legend(loc="upper left", fontsize=8)
    right.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _ms(x: float | None) -> float:
    return float("nan") if x is None else x * 1e3


def main(argv: list[str] | None = None) -> None:
    """`kneegate sweep --url URL [--levels 1,2,4 | --start 10 --step 10 --stop 100] ...`"""
    ap = argparse.ArgumentParser(prog="kneegate sweep", description=__doc__)
    ap.add_argument("--url", required=True, help="OpenAI-compatible base URL")
    ap.add_argument("--levels", help="comma-separated concurrency levels")
    ap.add_argument("--start", type=int)
    ap.add_argument("--step", type=int)
    ap.add_argument("--stop", type=int)
    ap.add_argument("--step-seconds", type=float, default=30.0, help="measured time per level")
    ap.add_argument("--warmup", type=float, default=5.0, help="unmeasured time per level")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--min-gain", type=float, default=0.05, help="the knee rule: 0.05 = 5%%")
    ap.add_argument("--backoff", type=float, default=0.8, help="safe level = backoff x knee")
    ap.add_argument("--stop-at-knee", action="store_true")
    ap.add_argument("--no-stream", action="store_true")
    ap.add_argument("--model")
    ap.add_argument("--out", default="sweep-out", help="directory for sweep.json and sweep.png")
    args = ap.parse_args(argv)
    try:
        levels = parse_levels(args.levels, args.start, args.step, args.stop)
    except ValueError as exc:
        ap.error(str(exc))
    import matplotlib  # noqa: F401  (the picture at the end needs the plots extra: say so now)

    points, knee = asyncio.run(
        run_sweep(
            args.url,
            levels,
            step_seconds=args.step_seconds,
            warmup=args.warmup,
            prompt_tokens=args.prompt_tokens,
            max_tokens=args.max_tokens,
            min_gain=args.min_gain,
            backoff=args.backoff,
            stop_at_knee=args.stop_at_knee,
            model=args.model,
            stream=not args.no_stream,
        )
    )
    print(
        f"knee: {knee.level}  safe: {knee.safe}  peak: {knee.peak:.1f} tok/s at {knee.peak_level}"
    )
    write_outputs(
        Path(args.out),
        points,
        knee,
        {
            "url": args.url,
            "levels": levels,
            "step_seconds": args.step_seconds,
            "min_gain": args.min_gain,
            "backoff": args.backoff,
        },
    )
    print(f"wrote {Path(args.out) / 'sweep.json'} and {Path(args.out) / 'sweep.png'}")


if __name__ == "__main__":
    main()
