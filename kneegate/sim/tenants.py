"""Tenants: fair shares against one FIFO (max-min water filling, Jain's index).
"""

from __future__ import annotations

from dataclasses import dataclass

from kneegate.admission.fairness import jain_index
from kneegate.sim.goodput import goodput
from kneegate.sim.loop import run
from kneegate.sim.scenarios import Scenario

__all__ = ["TenantRow", "tenant_rows", "tenant_table", "water_fill"]


def water_fill(total: float, demands: dict[str, float],
               weights: dict[str, float]) -> dict[str, float]:
    """Max-min fair split of `total` by weight: none gets more than its demand, and what one
    leaves is shared among the rest by their weights."""
    share, left, open_ = dict.fromkeys(demands, 0.0), total, set(demands)
    while open_ and left > 1e-9:
        per = left / sum(weights[t] for t in open_)
        capped = {t for t in open_ if demands[t] - share[t] <= per * weights[t]}
        if not capped:
            for t in open_:
                share[t] += per * weights[t]
            break
        for t in capped:
            left -= demands[t] - share[t]
            share[t] = demands[t]
        open_ -= capped
    return share


@dataclass
class TenantRow:
    tenant: str
    weight: float
    demand: float  # output tokens/s its arrivals asked for
    fair_share: float  # the max-min fair split of the fair run's goodput
    goodput: float  # with fair shares
    fifo: float  # the same arrivals served as one tenant, FIFO


def tenant_rows(sc: Scenario, controller: str, seed: int) -> tuple[list[TenantRow], float, float]:
    """Per tenant, goodput with fair shares and without (one FIFO); and the two totals."""
    fair, fifo = run(sc, controller, seed), run(sc, controller, seed, fair=False)
    a, b = sc.warmup, sc.duration
    weights = {t.name: t.weight for t in sc.tenants}
    demands = dict.fromkeys(weights, 0.0)
    for r in fair.requests:
        if a <= r.arrived < b:
            demands[r.tenant] += r.out / (b - a)
    total, total_fifo = goodput(fair, sc, a, b), goodput(fifo, sc, a, b)
    shares = water_fill(total, demands, weights)
    rows = [TenantRow(t, weights[t], demands[t], shares[t], goodput(fair, sc, a, b, t),
                      goodput(fifo, sc, a, b, t)) for t in weights]
    return rows, total, total_fifo


def tenant_table(sc: Scenario, controller: str, seed: int) -> str:
    rows, total, total_fifo = tenant_rows(sc, controller, seed)
    # backlogged: asked for more than its fair share (the others got all they asked)
    backlogged = [r.goodput / r.weight for r in rows if r.demand > r.fair_share * 1.001]
    lines = [
        f"# {sc.name}, {controller}: fair shares vs one FIFO, goodput {total:.0f} vs "
        f"{total_fifo:.0f} tok/s ({total / max(total_fifo, 1e-9):.3f}x); Jain's index over "
        f"the {len(backlogged)} backlogged tenants {jain_index(backlogged):.3f}",
        f"# {'tenant':<10} {'weight':>6} {'demand':>8} {'share':>8} {'fair':>8} "
        f"{'fair/min':>8} {'fifo':>8} {'fifo/min':>8}",
    ]
    for r in rows:
        due = max(min(r.fair_share, r.demand), 1e-9)  # what it should get: share or demand
        lines.append(
            f"# {r.tenant:<10} {r.weight:>6g} {r.demand:>8.0f} {r.fair_share:>8.0f} "
            f"{r.goodput:>8.0f} {r.goodput / due:>8.3f} {r.fifo:>8.0f} {r.fifo / due:>8.3f}")
    return "\n".join(lines)

