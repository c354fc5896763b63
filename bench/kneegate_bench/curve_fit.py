"""The knee of a sweep read from a saturating curve fitted to all of it (`curve_knee`).

Calibration against a live vLLM (kneegate_bench/calibrate_vllm.py) compares the real engine's
knee with the emulator's by it, beside the 5% rule's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["CurveKnee", "curve_knee"]


@dataclass(frozen=True, slots=True)
class CurveKnee:
    """The knee of the saturating curve tput = a c / (1 + c/k) fitted to a sweep."""

    level: float | None  # where a doubling of the fitted curve adds min_gain; None: no bend
    half: float  # k: the level at which the fitted curve gives half its plateau
    plateau: float  # a k: the fitted curve's asymptote, tok/s
    rms_log_error: float  # root mean square of ln(measured / fitted): 0.05 is about 5%


def curve_knee(
    levels: Sequence[float], throughputs: Sequence[float], *, min_gain: float = 0.05
) -> CurveKnee:
    """The knee of a sweep read from a curve fitted to all of it, not from one step.

    The 5% rule reads one step: on a gentle bend a step that adds 8% in one run adds 2% in the
    next, and the knee jumps by a whole level (2x with doubling levels). Fitted to every
    level, tput = a c / (1 + c/k) moves little with any one of them. Measured on the two
    recorded vLLM runs and the emulated curve: one level off by ±5% moves this knee by at
    most 5% (the plateau's 90% crossing, interpolated on log2 c: -21%..+53%; the
    controller's linearised fit of c / tput: -28%..+28%; a third parameter for the bend's
    sharpness: -19%..+24%). The fit is least squares on ln(tput), each level's relative
    error counting alike, over the levels up to the first that falls 10% under the best
    before it (a decline is no part of a saturating curve). The knee is the level from
    which a doubling of the fitted curve adds under `min_gain`, c = k (1 - g) / (2 g): the
    5% rule read on the fitted curve, between the levels; never above the last level kept
    when a decline ends the curve. The model bends gently: on a sharp bend (emulated
    cpu-tiny, flat from 32 clients) it reads 69, later than the 5% rule's 32; compare
    curves of like shape with it, and keep the 5% rule beside it.
    """
    if len(levels) != len(throughputs) or any(t <= 0 for t in throughputs):
        raise ValueError("need one positive throughput per level")
    cs, logs = _until_decline(levels, throughputs)
    if len(cs) < 3:
        return CurveKnee(None, math.inf, max(throughputs, default=0.0), math.nan)
    lo, hi = math.log(cs[0] / 64), math.log(cs[-1] * 64)
    grid = [lo + (hi - lo) * i / 480 for i in range(481)]
    best = min(range(len(grid)), key=lambda i: _log_fit(cs, logs, grid[i])[0])
    if best == len(grid) - 1:  # the best curve is a line: no bend inside the levels
        err = _log_fit(cs, logs, math.inf)[0]
        return CurveKnee(None, math.inf, math.inf, math.sqrt(err / len(cs)))
    u = _golden(lambda x: _log_fit(cs, logs, x)[0], grid[max(best - 1, 0)], grid[best + 1])
    err, log_a = _log_fit(cs, logs, u)
    k = math.exp(u)
    knee = k * (1 - min_gain) / (2 * min_gain)
    if len(cs) < len(levels):  # a decline ended the curve: the knee is not past its top
        knee = min(knee, cs[-1])
    return CurveKnee(knee, k, math.exp(log_a) * k, math.sqrt(err / len(cs)))


def _until_decline(
    levels: Sequence[float], throughputs: Sequence[float]
) -> tuple[list[float], list[float]]:
    cs: list[float] = []
    logs: list[float] = []
    best = 0.0
    for c, t in zip(levels, throughputs, strict=True):
        if t < 0.9 * best:
            break
        cs.append(float(c))
        logs.append(math.log(t))
        best = max(best, t)
    return cs, logs


def _log_fit(cs: Sequence[float], logs: Sequence[float], log_k: float) -> tuple[float, float]:
    """(squared log error, ln a) of the best a for k = e^log_k; ln a is the mean residual."""
    shape = [math.log(c) if log_k == math.inf else math.log(c / (1 + c / math.exp(log_k)))
             for c in cs]
    log_a = sum(y - g for y, g in zip(logs, shape, strict=True)) / len(cs)
    return sum((y - g - log_a) ** 2 for y, g in zip(logs, shape, strict=True)), log_a


def _golden(f: Callable[[float], float], lo: float, hi: float, tol: float = 1e-7) -> float:
    """The minimum of f on [lo, hi], f unimodal there (golden-section search)."""
    r = (math.sqrt(5) - 1) / 2
    a, b = lo, hi
    while b - a > tol:
        x1, x2 = b - r * (b - a), a + r * (b - a)
        if f(x1) < f(x2):
            b = x2
        else:
            a = x1
    return (a + b) / 2
