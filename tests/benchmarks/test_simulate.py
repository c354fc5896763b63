"""Seeded simulator runs (about a second each): the knee controller against the engine core."""

from __future__ import annotations

import pytest

from benchmarks.engine.core import EngineCore
from benchmarks.engine.profiles import Profile, load_profile
from benchmarks.engine.virtual import closed_loop
from benchmarks.simulate import goodput, load_scenario, main, run, scenario_names, true_knee
from benchmarks.sweep import find_knee


def test_every_scenario_file_loads() -> None:
    names = scenario_names()
    assert len(names) >= 8
    for name in names:
        assert load_scenario(name).name == name


def test_same_seed_same_run() -> None:
    sc = load_scenario("steady-3x").model_copy(update={"duration": 60.0})
    a, b = run(sc, "knee", seed=3), run(sc, "knee", seed=3)
    assert a.limits == b.limits
    assert [r.fate for r in a.requests] == [r.fate for r in b.requests]


def test_knee_at_3x_overload_ends_near_the_true_knee() -> None:
    sc = load_scenario("steady-3x")
    knee, _ = true_knee(load_profile(sc.profile), sc.prompt_tokens, sc.output_tokens)
    res = run(sc, "knee", seed=7)
    last = res.knee[-len(res.knee) // 4 :]  # the last quarter of the run
    estimate = sum(last) / len(last)
    assert 0.75 * knee <= estimate <= 1.25 * knee, (estimate, knee)


def _doubling_knee(profile: Profile, prompt: int, out: int) -> int:
    """The operators' 5% rule over a closed-loop sweep in doublings, as one runs on an engine."""
    levels = [4, 8, 16, 32, 64, 128]
    tput = [
        closed_loop(
            lambda: EngineCore(profile, seed=0), c, 30.0, prompt, out, warmup=5.0
        ).throughput
        for c in levels
    ]
    knee = find_knee(levels, tput).level
    assert knee is not None
    return knee


def test_knee_on_a_flat_plateau_settles_in_the_knee_region() -> None:
    # cpu-tiny: room for ~1400 sequences in its KV cache, and throughput flat from ~32 on
    sc = load_scenario("cpu-tiny-3x").model_copy(update={"duration": 90.0})
    knee = _doubling_knee(load_profile(sc.profile), sc.prompt_tokens, sc.output_tokens)
    assert knee == 32
    res = run(sc, "knee", seed=7)
    late = [lim for t, lim in zip(res.times, res.limits, strict=True) if t >= 60.0]
    assert 0.6 * knee <= min(late) and max(late) <= 1.3 * knee, late


def test_knee_recovers_after_the_capacity_drop() -> None:
    sc = load_scenario("capacity-drop")
    knee, _ = true_knee(load_profile(sc.profile), sc.prompt_tokens, sc.output_tokens)
    mine, fixed = run(sc, "knee", seed=7), run(sc, "fixed", seed=7, limit=knee)
    # slow phase (60-180 s) and after the return (180-240 s): close to a hand-set knee limit
    for start, end in ((100.0, 180.0), (195.0, 240.0)):
        ratio = goodput(mine, sc, start, end) / goodput(fixed, sc, start, end)
        assert ratio >= 0.75, (start, end, ratio)
    assert max(mine.limits[-40:]) >= 0.6 * knee  # the limit came back up after t=180


def test_cli_prints_a_row_per_controller(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--scenario", "small-kv-decline", "--controllers", "knee"]) == 0
    out = capsys.readouterr().out
    assert "small-kv-decline" in out and "knee" in out and "fixed@" in out
