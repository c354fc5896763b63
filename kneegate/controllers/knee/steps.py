"""How far one saturated window may move `Knee`'s limit (policy.py). Pure: no clock, no I/O.

    grow        one climb step, weighed by the fitted curve's elasticity at the level;
                within two steps of the engine's room, or one step past the highest level
    probe_step  a probe to its target at once, but no more than one climb step
    in_step     no further than where TTFT p90, grown with the limit, meets
                `ttft_objective`, nor where TPOT p50, grown with the level, meets its aim
    to_aim      after a saturated window that read a level, the limit back to where TPOT
                meets its aim (no lower than a `backoff` cut)
    aim_level   the level where TPOT meets `tpot_aim` x `tpot_objective`, lowered by one
                standard deviation of the curve's noise
    latency     the window's (TTFT p90, TPOT p50); in a window no answer ended in, those
                of the curve's point at its level

Each takes the limit and the window's reading as data, and reads the curve and the room.
"""

from __future__ import annotations

import math

from kneegate.controllers.knee.config import KneeConfig
from kneegate.controllers.knee.curve import Curve
from kneegate.controllers.knee.room import Room
from kneegate.controllers.window import Summary

__all__ = ["aim_level", "grow", "in_step", "latency", "probe_step", "to_aim"]


def grow(limit: float, level: float, cfg: KneeConfig, curve: Curve, room: Room) -> float:
    """How far a saturated window may raise the limit: one climb step, weighed by the
    fitted curve's elasticity at `level` (a step that adds little throughput is a small
    one), within two steps of the engine's room or one step past the highest level
    measured.

    A full step where the engine's measured room (`Room.grounded`) is near and the
    fitted curve still rises through it (its knee is at or past the room): the room,
    not the curve, stops the climb (the target caps it), and the elasticity at levels
    under the room only slowed the approach. Measured: docs/design/knee.md, "Regions"
    (Linear)."""
    step = 1 + cfg.climb
    grow = limit * (1 + cfg.climb * curve.elasticity(level))
    if room.value <= step * step * limit:
        fit, _ = curve.knee()
        if room.grounded and (fit is None or fit >= room.value):
            return step * limit  # the curve rises through the room: the target stops it
        return grow  # the engine's room is within two steps: it stops the climb
    # else at most one step past the highest level measured (the initial limit before
    # any): doublings never measured overshoot a flat plateau
    return max(limit, min(grow, step * curve.top()))


def probe_step(limit: float, target: float, cfg: KneeConfig) -> float:
    """A probe's move: to its target at once, but no more than one climb step above the
    limit. The target is read from the knee of this window's curve, and on a host whose
    speed wanders one window can move that far: a probe straight there put a queue of
    prefills in the engine. Measured: docs/design/knee.md, "Regions" (Plateau and
    probes)."""
    return min(target, (1 + cfg.climb) * limit)


def in_step(limit: float, w: Summary, level: float, cfg: KneeConfig, curve: Curve) -> float:
    """How far a saturated window's limit may grow for latency: to where its TTFT p90,
    grown in proportion to the limit, would meet `ttft_objective`, and its TPOT p50,
    grown in proportion to the level, would reach its aim (`aim_level`). Never a cut
    (a breach cuts).

    TTFT: where every prefill queues behind the others (vLLM's CPU build) TTFT grows in
    step with the limit, and a doubling past the objective took the users' tail past it
    for the time the cuts took; where TTFT is far under its objective it never binds.
    TPOT: on the plateau a step's time grows with the batch it decodes, so TPOT grows
    with the level; under the knee it grows slower, and the bound is loose. Aimed under
    the objective, not at it: every request's TPOT is judged, and at a p50 on the
    objective half of them miss it.

    `level` is where the window's latencies were read: its mean level, also for the
    window after a rise that `signals.climbed` reads at its last scrape (its answers ended
    while it held less). Measured: docs/design/knee.md, "Regions" (TPOT stops the
    climb); on real vLLM, docs/history/benchmarks.md, "kneegate's limit at 3x on real
    vLLM"."""
    c = cfg
    bound = math.inf
    ttft, tpot = latency(w, level, curve)
    if ttft:
        bound = limit * c.ttft_objective / ttft
    if tpot:
        bound = min(bound, aim_level(level, tpot, cfg, curve))
    return max(limit, bound)


def to_aim(limit: float, w: Summary, level: float, cfg: KneeConfig, curve: Curve) -> float:
    """Where TPOT's aim puts the limit after a saturated window that read a level: the
    level at which its TPOT p50, in step with the level, meets its aim (`aim_level`),
    no lower than a `backoff` cut (one window's p50 is noisy); no bound where it is
    under the aim. `in_step` stops the climb there; this brings the
    limit back when the engine slows under it (a breach of the objective itself cuts).
    Only saturated windows: in a draining one the level is under the limit and scales
    nothing. Measured: docs/design/knee.md, "Regions" (TPOT's aim holds both ways)."""
    if not w.tpot_p50:
        return math.inf
    return max(cfg.backoff * limit, aim_level(level, w.tpot_p50, cfg, curve))


def aim_level(level: float, tpot: float, cfg: KneeConfig, curve: Curve) -> float:
    """The level at which TPOT, read at `level` and grown in step with it, meets
    `tpot_aim` x `tpot_objective`, lowered by one standard deviation of the host's
    measured noise (`Curve.noise`, one window's variance of ln throughput): where
    `in_step` stops the climb and `to_aim` brings the limit back.

    Why lowered: one window's TPOT is read in one spell of the host's speed, and every
    answer is judged: a limit set to the aim in a fast spell breaks the objective in the
    next slow one. Measured: docs/design/knee.md, "Regions" (The aim sits under the
    noise)."""
    aim = cfg.tpot_aim * math.exp(-math.sqrt(curve.noise()))
    return level * aim * cfg.tpot_objective / tpot


def latency(w: Summary, level: float, curve: Curve) -> tuple[float | None, float | None]:
    """The window's (TTFT p90, TPOT p50); in a window no answer ended in (closed on the
    engine's counters), those of the curve's point at its level, if any: unbounded, a
    probe from such a window leapt past the level where TPOT meets its aim.
    Measured: docs/design/knee.md, "Regions"."""
    if w.ttft_p90 is not None or w.tpot_p50 is not None:
        return w.ttft_p90, w.tpot_p50
    near = curve.nearest(level)
    return (near.ttft_p90, near.tpot_p50) if near is not None else (None, None)
