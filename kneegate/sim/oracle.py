"""The oracle: the best fixed (limit, wait cap) pair for a scenario, found by sweeping both
in the simulator, and after a change the switching pair (see `oracle`).
"""

from __future__ import annotations

from dataclasses import dataclass

from kneegate.emulator.profiles import load_profile
from kneegate.sim.goodput import _segments, goodput
from kneegate.sim.loop import Move, Result, run
from kneegate.sim.scenarios import Scenario
from kneegate.sim.true_knee import scenario_knee

__all__ = ["FIRST_CAP", "WAIT_CAPS", "Oracle", "Pair", "oracle"]


# The oracle's wait caps, as fractions of each class's TTFT objective; None is the scenario's
# own `max_wait`. Caps at or past the objective are left out (a request that waited that long
# misses however fast the engine is); a quarter to three quarters of it leaves the engine
# TTFT the rest. With the scenario's own caps the oracle can also keep the controllers' own
# queue where that is best (at low load, where caps seldom bite). Four caps, not a finer
# grid: each is run at three limits, and the suite has to stay within a few minutes.
WAIT_CAPS: tuple[float | None, ...] = (0.25, 0.5, 0.75, None)


FIRST_CAP = 0.5  # the cap the full limit sweep runs at, before the caps are swept


Pair = tuple[int, float | None]  # (total limit, wait cap as a fraction of the objective)


@dataclass
class Oracle:
    limit: int
    wait: float | None  # its wait cap, a fraction of each class's TTFT objective (`WAIT_CAPS`)
    goodput: float
    runs: dict[Pair, Result]
    segment_best: list[int]  # the switching oracle's limit in each segment between changes
    segment_wait: list[float | None]  # and its wait cap there
    segment_runs: list[Result]  # its run for each segment: fixed, switching at the changes

    @property
    def best(self) -> Result:
        return self.runs[(self.limit, self.wait)]


def oracle(sc: Scenario, seed: int) -> Oracle:
    """The best (fixed limit, wait cap) pair, by goodput from arrival over the whole run.

    A coordinate search, not the full grid (which would cost 4x the sweep): every limit at
    `FIRST_CAP`, stepping up while the best is the top one; then every cap in `WAIT_CAPS`
    at the best limit and its two grid neighbours (the best cap depends on the engine TTFT
    at the limit, which moves little between neighbours); then the midpoints around the
    best limit at the best cap, so a coarse grid does not flatter a controller.
    """
    profile = load_profile(sc.profile, **sc.profile_overrides)
    knee, _, _ = scenario_knee(sc, profile)
    limits = sorted(
        sc.oracle_limits
        or {
            max(1, round(knee * f))
            for f in (0.25, 0.4, 0.55, 0.7, 0.8, 0.9, 1.0, 1.15, 1.3, 1.6, 2.0)
        }
    )
    runs: dict[Pair, Result] = {}
    score: dict[Pair, float] = {}

    def attempt(lim: int, wait: float | None) -> None:
        if (lim, wait) not in runs:
            runs[lim, wait] = run(sc, "fixed", seed, lim, wait=wait)
            score[lim, wait] = goodput(runs[lim, wait], sc, sc.warmup, sc.duration)

    def best() -> Pair:
        return max(score, key=lambda k: score[k])

    for lim in limits:
        attempt(lim, FIRST_CAP)
    # a best at either end of the grid is no maximum yet: keep stepping out until one is
    # found (a mix of long prompts at a tight objective puts it far under the knee)
    while best()[0] == max(limits) and not sc.oracle_limits and best()[0] < 4096:
        top = max(best()[0] + 1, round(best()[0] * 1.25))
        limits.append(top)
        attempt(top, FIRST_CAP)
    while best()[0] == min(limits) and not sc.oracle_limits and best()[0] > 1:
        low = min(best()[0] - 1, round(best()[0] * 0.75))
        limits.insert(0, low)
        attempt(low, FIRST_CAP)
    i = limits.index(best()[0])
    for lim in limits[max(0, i - 1) : i + 2]:
        for wait in WAIT_CAPS:
            attempt(lim, wait)
    lim, wait = best()
    for mid in _midpoints(limits, lim):
        attempt(mid, wait)
    lim, wait = best()
    seg_best, seg_runs = _switching(sc, seed, runs, limits)
    return Oracle(
        lim,
        wait,
        score[lim, wait],
        runs,
        [p[0] for p in seg_best],
        [p[1] for p in seg_best],
        seg_runs,
    )


def _midpoints(grid: list[int], top: int) -> set[int]:
    """The limits halfway between `top` and its neighbours on the sorted `grid`."""
    i = grid.index(top)
    return {(grid[j] + top) // 2 for j in (i - 1, i + 1) if 0 <= j < len(grid)} - {top}


def _switching(
    sc: Scenario, seed: int, runs: dict[Pair, Result], grid: list[int]
) -> tuple[list[Pair], list[Result]]:
    """Per segment, the best (limit, cap) pair entered from the previous segments' bests.

    The first segment's is the plain search's best over that segment. For each later one,
    by coordinates as in `oracle`: every limit of the sweep `grid` (and the midpoints around
    the winner) at the previous segment's cap, then every cap at the winning limit; each run
    is fixed at the earlier segments' bests and moves to the pair tried at the change.
    """
    segs, changes = _segments(sc), sc.changes
    a, b = segs[0]
    first = max(runs, key=lambda k: goodput(runs[k], sc, a, b))
    bests, seg_runs = [first], [runs[first]]
    for n, seg in enumerate(segs[1:]):
        moves: list[Move] = [(changes[j], *bests[j + 1]) for j in range(n)]
        pair, res = _segment_best(sc, seed, first, moves, changes[n], sorted(grid), seg)
        bests.append(pair)
        seg_runs.append(res)
    return bests, seg_runs


def _segment_best(
    sc: Scenario,
    seed: int,
    first: Pair,
    moves: list[Move],
    at: float,
    grid: list[int],
    seg: tuple[float, float],
) -> tuple[Pair, Result]:
    """The best pair to move to at `at`, by goodput over `seg`, entered through `moves`."""
    tried: dict[Pair, Result] = {}

    def attempt(lim: int, wait: float | None) -> None:
        if (lim, wait) not in tried:
            then = [*moves, (at, lim, wait)]
            tried[lim, wait] = run(sc, "fixed", seed, first[0], then, wait=first[1])

    def top() -> Pair:
        return max(tried, key=lambda k: goodput(tried[k], sc, *seg))

    cap = moves[-1][2] if moves else first[1]  # the cap the previous segment ran at
    for lim in grid:
        attempt(lim, cap)
    for mid in _midpoints(grid, top()[0]):
        attempt(mid, cap)
    lim = top()[0]
    for wait in WAIT_CAPS:
        attempt(lim, wait)
    return top(), tried[top()]

