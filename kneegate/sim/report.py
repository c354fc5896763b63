"""The simulator's output: the table's header and rows, and the plots.
"""

from __future__ import annotations

import math
from pathlib import Path

from kneegate.sim.goodput import goodput_series, user_ttft
from kneegate.sim.judge import Row, _q, _smooth
from kneegate.sim.loop import Result
from kneegate.sim.oracle import Oracle
from kneegate.sim.scenarios import Scenario

__all__ = ["HEADER", "fmt", "plot"]


HEADER = (
    f"{'scenario':<22} {'controller':<32} {'goodput/oracle':>14} {'ttft p50':>8} {'ttft p99':>8} "
    f"{'eng p99':>7} {'shed':>6} {'t/out':>6} {'settle s':>8} {'osc':>5} {'inflight':>8}"
)


def fmt(row: Row) -> str:
    settle = (
        "-" if row.settle is None else ("never" if math.isinf(row.settle) else f"{row.settle:.0f}")
    )
    return (
        f"{row.scenario:<22} {row.controller:<32} {row.ratio:>14.3f} {row.ttft_p50:>8.2f} "
        f"{row.ttft_p99:>8.2f} {row.engine_ttft_p99:>7.2f} {row.shed:>6.1%} "
        f"{row.timeout:>6.1%} {settle:>8} {row.oscillation:>5.2f} {row.mean_inflight:>8.1f}"
    )


def plot(sc: Scenario, results: list[Result], orc: Oracle, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(4, 1, figsize=(10, 11), sharex=True)
    best = orc.best
    for res, style in [(best, "k--"), *((r, "-") for r in results)]:
        label = res.controller
        axes[0].plot(res.times, res.limits, style, label=label, lw=1)
        axes[1].plot(res.times, res.inflight, style, label=label, lw=1)
        g = _smooth(goodput_series(res, sc), 5)
        axes[2].plot(range(len(g)), g, style, label=label, lw=1)
        t, p90 = _ttft_series(res, sc)
        axes[3].plot(t, p90, style, label=label, lw=1)
    for ax, title in zip(
        axes,
        [
            "limit (sum over gateways)",
            "in-flight",
            "goodput, tok/s (5 s avg)",
            "TTFT p90 of admitted from arrival, s (5 s bins)",
        ],
        strict=True,
    ):
        ax.set_title(title, fontsize=9)
        for c in sc.changes:
            ax.axvline(c, color="grey", lw=0.5)
    axes[3].axhline(min(c.ttft or sc.ttft for c in sc.classes), color="red", lw=0.5)
    axes[0].legend(fontsize=8, loc="upper right")
    axes[3].set_xlabel("virtual seconds")
    fig.suptitle(f"{sc.name}: {sc.description}", fontsize=10)
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{sc.name}.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _ttft_series(res: Result, sc: Scenario, step: float = 5.0) -> tuple[list[float], list[float]]:
    bins: dict[int, list[float]] = {}
    for r in res.requests:
        if r.fate == "done":
            bins.setdefault(int(r.first // step), []).append(user_ttft(r))
    keys = sorted(bins)
    return [k * step for k in keys], [_q(sorted(bins[k]), 0.9) for k in keys]

