"""The true knee of a scenario's engine: a closed-loop sweep in virtual time, judged by
the operator's 5% rule (kneegate.sim.knee_rule.find_knee); its rate is the unit of load.
"""

from __future__ import annotations

import functools
import statistics

from kneegate.emulator.core import EngineCore
from kneegate.emulator.profiles import Profile
from kneegate.emulator.virtual import closed_loop
from kneegate.sim import trace
from kneegate.sim.knee_rule import find_knee
from kneegate.sim.scenarios import Scenario

__all__ = ["scenario_knee", "trace_mix", "true_knee"]


@functools.lru_cache(maxsize=8)
def trace_mix(name: str, context: int) -> tuple[tuple[int, int], ...]:
    """A trace's (prompt, output) tokens in arrival order, each fitted to `context`."""
    return tuple((r.prompt, r.output) for r in trace.cap(trace.load(name), context))


@functools.lru_cache(maxsize=64)
def _sweep(profile: Profile, prompt: int, out: int,
           trace_name: str | None = None) -> tuple[tuple[int, float], ...]:
    mix = trace_mix(trace_name, profile.max_model_len) if trace_name else ()
    levels, c = [], 4
    while c <= min(profile.engine.max_num_seqs * 2, 2048):
        levels.append(c)
        c = max(c + 1, round(c * 1.2))
    rows: list[tuple[int, float]] = []
    for c in levels:
        r = closed_loop(lambda: EngineCore(profile, seed=0), c, 60.0, prompt, out, warmup=20.0,
                        lengths=mix)
        rows.append((c, r.throughput))
        k = find_knee([c for c, _ in rows], [x for _, x in rows])
        if k.index is not None and len(rows) >= k.index + 4:
            break  # three levels past the knee: enough to be sure of it
    return tuple(rows)


def true_knee(profile: Profile, prompt: int, out: int,
              trace_name: str | None = None) -> tuple[int, float]:
    """(knee concurrency, its tokens/s) by the 5% rule over 20%-steps of a closed loop of
    requests of `prompt` and `out` tokens, or of a trace's mix in turn (`trace_name`)."""
    rows = _sweep(profile, prompt, out, trace_name)
    k = find_knee([c for c, _ in rows], [x for _, x in rows])
    level = k.level if k.level is not None else k.peak_level
    return level, dict(rows)[level]


def scenario_knee(sc: Scenario, profile: Profile) -> tuple[int, float, float]:
    """(knee concurrency, its output tokens/s, a request's mean output tokens) for the
    scenario's mix: its uniform lengths, or its trace's recorded ones. The knee's rate of
    requests (tokens/s over the mean output) is the unit of a phase's `load`."""
    if sc.trace is None:
        knee, tput = true_knee(profile, sc.prompt_tokens, sc.output_tokens)
        return knee, tput, float(sc.output_tokens)
    knee, tput = true_knee(profile, 0, 0, sc.trace)
    mix = trace_mix(sc.trace, profile.max_model_len)
    return knee, tput, statistics.fmean(o for _, o in mix)

