"""The seeded arrival process: (time, class, prompt, output tokens, tenant) for a run, drawn
from the scenario's phases and bursts, or replayed from its trace."""

from __future__ import annotations

import random

from kneegate.sim import trace
from kneegate.sim.scenarios import Scenario

__all__ = ["TRACE_STRIDE", "Arrival"]


Arrival = tuple[float, str, int, int, str]  # (time, class, prompt, output tokens, tenant)


def _arrivals(sc: Scenario, rate_unit: float, seed: int, context: int) -> list[Arrival]:
    """(time, class, prompt, output, tenant) for the whole run: Poisson arrivals with lengths
    uniform in [0.5, 1.5] x mean, or a trace's (`_trace_arrivals`). A scenario without
    tenants draws no tenant (its arrivals are as they were)."""
    if sc.trace is not None:
        return _trace_arrivals(sc, rate_unit, seed, context)
    rng = random.Random(seed)
    shares = [c.share for c in sc.classes]
    tenant_shares = [t.share for t in sc.tenants]
    out: list[Arrival] = []
    t, state = 0.0, {"load": 0.0, "prompt_scale": 1.0}
    bounds = [p.at for p in sc.phases[1:]] + [sc.duration]
    for phase, end in zip(sc.phases, bounds, strict=True):
        state["load"] = phase.load if phase.load is not None else state["load"]
        state["prompt_scale"] = phase.prompt_scale or state["prompt_scale"]
        rate = state["load"] * rate_unit
        t = max(t, phase.at)
        while rate > 0:
            t += rng.expovariate(rate)
            if t >= end:
                t = end
                break
            if (
                phase.burst
                and (t - phase.at) % (phase.burst.on_s + phase.burst.off_s) > phase.burst.on_s
            ):
                continue  # the off part of an on/off cycle
            cls = rng.choices(sc.classes, weights=shares)[0].name
            prompt = max(1, round(sc.prompt_tokens * state["prompt_scale"] * rng.uniform(0.5, 1.5)))
            outn = max(2, round(sc.output_tokens * rng.uniform(0.5, 1.5)))
            tenant = rng.choices(sc.tenants, weights=tenant_shares)[0].name if sc.tenants else ""
            out.append((t, cls, prompt, outn, tenant))
    return out


TRACE_STRIDE = 7919  # rows between two seeds' starting points: each seed replays its own slice


def _trace_arrivals(sc: Scenario, rate_unit: float, seed: int, context: int) -> list[Arrival]:
    """The trace's requests from row `trace_start + seed * TRACE_STRIDE` on, each phase
    replaying the next rows at its load (`trace.schedule`: the recorded spacing scaled to
    the rate), with the recorded lengths fitted to `context` (x the phase's prompt_scale);
    classes and tenants drawn by the seed as for Poisson arrivals."""
    rows = trace.cap(trace.load(sc.trace or ""), context)
    rng = random.Random(seed)
    shares = [c.share for c in sc.classes]
    tenant_shares = [t.share for t in sc.tenants]
    start = (sc.trace_start + seed * TRACE_STRIDE) % len(rows)
    out: list[Arrival] = []
    load, scale = 0.0, 1.0
    bounds = [p.at for p in sc.phases[1:]] + [sc.duration]
    for phase, end in zip(sc.phases, bounds, strict=True):
        load = phase.load if phase.load is not None else load
        scale = phase.prompt_scale or scale
        if load <= 0 or end <= phase.at:
            continue
        picked = trace.schedule(rows, load * rate_unit, end - phase.at, start)
        start = (start + len(picked)) % len(rows)
        for r in picked:
            cls = rng.choices(sc.classes, weights=shares)[0].name
            tenant = rng.choices(sc.tenants, weights=tenant_shares)[0].name if sc.tenants else ""
            prompt = max(1, min(round(r.prompt * scale), context - r.output))
            out.append((phase.at + r.at, cls, prompt, r.output, tenant))
    return out

