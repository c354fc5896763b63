"""What kneegate learned about an engine, from its `/kneegate/status`: the curve, the knee, the
limit on it, as lines of text and as a picture.

The `knee` controller's curve is one point per level it measured: requests in the engine (or
in flight through this gateway, `curve_of`) -> output tokens/s, with TTFT p90 and TPOT p50 at
that level. The knee is the controller's published estimate (`knee_estimate`), else the bend
of the fitted curve (`fit.curve_knee`); neither, while throughput still rises at the highest
level measured. The limit is where admission holds the engine now. `kneegate demo` prints
these at its end; `picture` draws them when matplotlib (the `plots` extra) is installed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["curve_lines", "knee_of", "picture"]

BAR = 40  # characters for the highest throughput


def knee_of(controller: dict[str, Any]) -> tuple[float | None, str]:
    """(the knee, where it comes from): the published estimate, else the fitted bend."""
    if isinstance(controller.get("knee_estimate"), (int, float)):
        return float(controller["knee_estimate"]), "kneegate's estimate"
    bend = (controller.get("fit") or {}).get("curve_knee")
    if isinstance(bend, (int, float)):
        return float(bend), "the fitted curve's bend, not yet confirmed"
    return None, ""


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.0f} ms"


def curve_lines(upstream: dict[str, Any]) -> list[str]:
    """One upstream's learned curve as text: a line per level measured (its throughput as a
    bar), the knee and the limit as lines of their own at their levels."""
    ctl = upstream["controller"]
    points = ctl.get("curve") or []
    limit = upstream["limit"]
    if "curve" not in ctl:
        return [f"kneegate's {ctl.get('name', '?')} controller learns no curve; its limit: "
                f"{limit}"]
    if not points:
        return [f"what kneegate learned (GET /kneegate/status): no level measured yet (each "
                f"takes a few windows of steady load); its limit: {limit}"]
    knee, source = knee_of(ctl)
    top = max(p["throughput"] for p in points) or 1.0
    of = "requests in the engine" if ctl.get("curve_of") == "engine" else "requests in flight"
    rows: list[tuple[float, int, str]] = []  # (level, order at a tie, line)
    for p in points:
        bar = "#" * max(1, round(BAR * p["throughput"] / top))
        rows.append((p["concurrency"], 1, f"{'':>6}{p['concurrency']:>6.0f}  "
                     f"{p['throughput']:>7.0f}  {bar:<{BAR}}  {_ms(p['ttft_p90']):>8}  "
                     f"{_ms(p['tpot_p50']):>7}"))
    if knee is not None:
        rows.append((knee, 0, f"{'knee':>6}{knee:>6.0f}  <- where the curve bends ({source})"))
    rows.append((limit, 2, f"{'limit':>6}{limit:>6.0f}  <- where kneegate holds the engine "
                 f"at the end ({upstream['in_flight']} in flight)"))
    lines = [f"what kneegate learned (GET /kneegate/status): {of} -> output tok/s",
             f"{'':>6}{'level':>6}  {'tok/s':>7}  {'':<{BAR}}  {'TTFT p90':>8}  {'TPOT p50':>7}"]
    lines += [line for _, _, line in sorted(rows, key=lambda r: (r[0], r[1]))]
    if knee is None:
        highest = max(p["concurrency"] for p in points)
        lines.append(f"no knee yet: throughput still rises at the highest level measured "
                     f"({highest:.0f}); the limit climbs a step at a time until it stops "
                     "rising or an objective breaks")
    return lines


def picture(upstream: dict[str, Any], path: Path) -> bool:
    """Draw the learned curve, the knee and the limit into `path` (PNG); False, and nothing
    written, when matplotlib is not installed (the `plots` extra) or no level was measured."""
    if not upstream["controller"].get("curve"):
        return False
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ctl = upstream["controller"]
    points = ctl.get("curve") or []
    knee, source = knee_of(ctl)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([p["concurrency"] for p in points], [p["throughput"] for p in points], "o-",
            color="C0", label="learned curve")
    if knee is not None:
        ax.axvline(knee, color="red", label=f"knee {knee:.0f} ({source})")
    ax.axvline(upstream["limit"], color="green", ls=":", label=f"limit {upstream['limit']}")
    ax.set_xlabel("requests in the engine" if ctl.get("curve_of") == "engine"
                  else "requests in flight")
    ax.set_ylabel("output tokens/s")
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.set_title("what kneegate learned")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
