"""The saturating curve fitted to the kept levels, and its knee. Pure: no clock, no I/O.

    tput = a c / (1 + c/k), least squares on the line c / tput = 1/a + c/(a k)

A slope within 3 standard errors of 0 is no bend (`line`), nor are fewer than three levels,
nor levels within `SPAN` of each other. The knee is where the elasticity 1 / (1 + c/k)
falls to e_min, no lower than the lowest level; the highest level where the fitted knee
lies within `FIT_Z` standard errors under it (`fit_knee`).
"""

from __future__ import annotations

import math

from kneegate.controllers.knee.point import Point

__all__ = ["FIT_Z", "SPAN", "fit", "fit_knee", "line"]

SPAN = 1.5  # levels closer than this ratio cannot tell a bend or a plateau from noise
FIT_Z = 2.0  # standard errors of the fitted knee that cannot tell it from the top (`fit_knee`)


def line(xs: list[float], ys: list[float]) -> tuple[float, float, float]:
    """Least-squares (intercept, slope) of ys on xs, and the variance of their ratio
    (`_fit_knee`); (1, 0, 0) unless the slope is clear."""
    n = len(xs)
    if n < 2:
        return 1.0, 0.0, 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if max(xs) < SPAN * min(xs):
        return 1.0, 0.0, 0.0  # too narrow a range to tell a bend from noise
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    a = my - b * mx
    res = sum((y - a - b * x) ** 2 for x, y in zip(xs, ys, strict=True))
    # a slope within 3 standard errors of zero is noise: the curve is still linear
    if b * b * sxx * (n - 2) <= 9 * res:
        return 1.0, 0.0, 0.0
    # a / b's variance, to first order: with s2 = res / (n - 2), var a = s2 (1/n + mx^2 /
    # sxx), var b = s2 / sxx, cov(a, b) = -mx s2 / sxx, it is s2 (sxx/n + (mx + a/b)^2) /
    # (sxx b^2); b is not 0 here, and a may be (a flat curve's exactly)
    return a, b, res / (n - 2) * (sxx / n + (mx + a / b) ** 2) / (sxx * b * b)


def fit(pts: list[Point]) -> tuple[float, float, float]:
    if len(pts) < 3:
        return 1.0, 0.0, 0.0  # two points are one noisy step: no curve yet
    return line([p.concurrency for p in pts], [p.concurrency / p.throughput for p in pts])


def fit_knee(pts: list[Point], a: float, b: float, var: float, e_min: float) -> float:
    """The knee of the line c / tput = a + b c fitted to `pts` (ascending; a, b > 0; `var`
    the variance of a / b, `_line`): where the elasticity 1 / (1 + b c / a) falls
    to e_min, (a / b)(1 / e_min - 1). Where that lies under the highest level but within
    `FIT_Z` standard errors of it, the highest level: so noisy a fit cannot tell the knee
    from it; else the knee raised by those errors, no lower than the lowest level.

    Why: the knee is a ratio of the two fitted coefficients, and where one window's
    throughput wanders it is uncertain by tens of percent; as the lowest of three
    readings its low end held the limit far under the knee. The error is added, and it
    is a / b's own, not its relative one: on a flat curve a ~ 0 and the relative error
    overflows. Measured: docs/design/knee.md, "The curve" (A fitted knee within its
    noise of the top)."""
    knee, top = a / b * (1 / e_min - 1), pts[-1].concurrency
    if knee < top:
        knee = min(top, knee + FIT_Z * (1 / e_min - 1) * math.sqrt(var))
    return max(knee, pts[0].concurrency)
