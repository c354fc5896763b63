"""What one closed window says beside its means, read for `Knee` (policy.py). Pure: no
clock, no I/O.

    over_objective  TTFT p90 or TPOT p50 over its objective (in a window held at the
                    limit with no answer in it: the engine's TPOT): the window is bad
    ramped          the engine's in-flight rose by more than a bin across it: a move
    climbed         the window after a rise, read at its last scrape, where the rise kept
                    pace: a level, as that scrape's point
    stalled         its last scrape reads a level measured before, at a throughput fallen
                    by more than `change`: no growth on its means
    unproven        no answer ended in it and the engine's TPOT is over its objective
    unconfirmed     the cut its target asks rests on one window's reading of the curve's top

Each reads the window (`Summary`), the config and, where it needs them, the curve, the limit
and the policy's marks of the windows before (a move, a rise, the last scrape left).
"""

from __future__ import annotations

import math
from dataclasses import replace

from kneegate.controllers.knee.config import KneeConfig
from kneegate.controllers.knee.curve import Curve
from kneegate.controllers.window import Summary

__all__ = ["climbed", "over_objective", "ramped", "stalled", "unconfirmed", "unproven"]


def over_objective(w: Summary, cfg: KneeConfig, ramped: bool, moved_up: bool) -> bool:
    """TTFT p90 or TPOT p50 over its objective. A window held at the limit with no
    answer in it, not after a rise nor through the engine's own (`ramped`), is judged by
    the engine's TPOT (`Summary.engine_tpot`): once each step is slower a request
    outlasts a window, and windows closed on the engine's scrapes alone would hold the
    limit the windows with answers cut. Not in the other windows, where requests still
    prefilling read it high. Measured: docs/design/knee.md, "Windows"
    (tests/sim/test_knee_slowdown_sim.py)."""
    c = cfg
    tpot = w.tpot_p50
    if tpot is None and w.saturated >= c.saturation and not (moved_up or ramped):
        tpot = w.engine_tpot
    return (w.ttft_p90 is not None and w.ttft_p90 > c.ttft_objective) or (
        tpot is not None and tpot > c.tpot_objective
    )


def ramped(w: Summary, cfg: KneeConfig) -> bool:
    """The engine's in-flight rose by more than a bin across the window: it measured a
    move, not a level. The KV edge lifts the limit between windows without moving the
    window's, and the mean of such a window reads its prefills as a plateau below it (a
    false knee). Measured: docs/design/knee.md, "Regions" (Linear)."""
    if w.engine_first is None or w.engine_last is None:
        return False
    return w.engine_last[0] > (1 + cfg.bin_ratio) * w.engine_first


def climbed(w: Summary, cfg: KneeConfig, curve: Curve, before: tuple[float, float] | None,
            moved_up: bool) -> Summary | None:
    """The window after a rise, read at its last scrape, when that shows the rise kept
    pace: the engine filled the level and throughput grew with elasticity of at least 1/2
    from the highest level measured, or, before any, from the last scrape of the window
    the rise left (the first window measures the start, no level). The window's means
    mix the scrapes from before the rise (they come 1.5 s late) and its burst of
    prefills; one that reads flat even at its last scrape may still be prefilling, and
    the next window decides, as for any move. None: not such a window."""
    top = curve.highest()
    ref = (top.concurrency, top.throughput) if top else before
    if not (moved_up and curve.engine_mode and w.engine_last and ref):
        return None
    level, tput = w.engine_last
    if level < 0.8 * w.max_inflight or w.saturated < cfg.saturation:
        return None
    if level < cfg.pair * ref[0] or tput <= 0 or ref[1] <= 0:
        return None  # a counter that stood still or was reset
    if math.log(tput / ref[1]) < 0.5 * math.log(level / ref[0]):
        return None
    return replace(w, engine_inflight=level, engine_throughput=tput)


def stalled(w: Summary, cfg: KneeConfig, curve: Curve, moved: bool) -> bool:
    """The window's last scrape reads a level measured before at a throughput fallen by
    more than `change`: the engine changed within the window, whose means still read it
    as it was. No growth on them: a limit doubled into a slowdown admits requests whose
    samples, admitted before the cuts that follow, measure nothing for a while
    (tests/sim/test_knee_slowdown_sim.py). Measured: docs/design/knee.md, "Regions"
    (Linear)."""
    if moved or w.engine_last is None:
        return False
    level, tput = w.engine_last
    near = curve.nearest(level)
    return near is not None and tput < (1 - cfg.change) * near.throughput


def unproven(w: Summary, cfg: KneeConfig) -> bool:
    """No answer ended in the window and the engine's own TPOT is over its objective:
    nothing shows the engine keeps up, so the limit holds (a cut still needs a window
    `over_objective` judges). Neither `over_objective` (the engine's in-flight rose
    through it) nor `stalled` (the window after a move) reads such a window, and one
    after a slowdown's cut doubled the limit (tests/sim/test_knee_slowdown_sim.py)."""
    return (w.samples == 0 and w.engine_tpot is not None
            and w.engine_tpot > cfg.tpot_objective)


def unconfirmed(w: Summary, target: float, limit: float, cfg: KneeConfig, curve: Curve
                ) -> bool:
    """The target would cut the limit by more than a bin, and the curve's verdict that
    puts it there rests on its top point, learnt in this window at the limit's level
    (within `pair`) from one window's reading (`Point.windows` 1). A verdict of the
    curve (a plateau, a decline, a fit) that no objective's breach backs holds the limit
    one window more, so that a second window at the level joins the first before the
    limit leaves it: nothing measures a level above the knee again for the point's
    `memory` (300 s). Measured: docs/design/knee.md, "Regions" (Confirm)."""
    top = curve.highest()
    return (target < limit / (1 + cfg.bin_ratio) and top is not None
            and top.at == w.end and top.windows == 1 and not top.scrape
            and top.concurrency * cfg.pair >= limit)
