"""cpu-tiny-avx2 reproduces the recorded live vLLM runs within ±20%.

A deterministic check of the profile's data (virtual time, no vLLM, about a second of CPU)
against the real curves in bench/kneegate_bench/data/: the run the profile was fitted to and a
second run made after the fit; the load and timing are those of
`python -m kneegate_bench.calibrate_vllm`.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest

import kneegate_bench
from kneegate.emulator.cost import StepCost
from kneegate.emulator.profiles import load_profile
from kneegate.emulator.virtual import LoopResult
from kneegate.sim.knee_rule import find_knee
from kneegate_bench.calibrate_vllm import (
    LEVELS,
    TOLERANCE,
    RealPoint,
    compare,
    curve_knee,
    emulate,
    knee_of,
    load_real,
)

Curves = tuple[list[RealPoint], list[LoopResult]]
DATA = Path(kneegate_bench.__file__).with_name("data")
FITTED = DATA / "vllm-cpu-avx2-2026-11-30.json"
CHECK = DATA / "vllm-cpu-avx2-2026-11-30-check.json"


@pytest.fixture(scope="module", params=[FITTED, CHECK], ids=["fitted", "check"])
def curves(request: pytest.FixtureRequest) -> Curves:
    real = load_real(request.param)
    assert [p.level for p in real] == [1, 2, 4, 8, 16, 32, 64, 128]
    assert all(p.errors == 0 and p.ok > 0 for p in real)
    return real, emulate("cpu-tiny-avx2", [p.level for p in real])


def test_tok_s_curve_within_tolerance(curves: Curves) -> None:
    real, emulated = curves
    for r, e in zip(real, emulated, strict=True):
        assert e.throughput == pytest.approx(r.throughput, rel=TOLERANCE), r.level


def test_plateau_within_tolerance(curves: Curves) -> None:
    real, emulated = curves
    assert max(e.throughput for e in emulated) == pytest.approx(knee_of(real).peak, rel=TOLERANCE)


def test_knee_within_one_level_of_the_real_runs() -> None:
    # the real 32 -> 64 step added 8.2% in the fitted run and 1.8% in the check: the 5% rule
    # reads 64 and 32, a 2x disagreement of the engine with itself; the emulator (+6%) reads 64
    knees = [knee_of(load_real(path)).level for path in (FITTED, CHECK)]
    assert knees == [64, 32]
    emulated = emulate("cpu-tiny-avx2", [1, 2, 4, 8, 16, 32, 64, 128])
    assert (
        find_knee([e.concurrency for e in emulated], [e.throughput for e in emulated]).level == 64
    )


def test_fitted_knee_within_tolerance_on_both_runs(curves: Curves) -> None:
    # the measure the verdict uses: fitted to every level, it reads ~27 clients on both runs
    # (27.2 and 27.5) where the 5% rule read 64 and 32
    real, emulated = curves
    levels = [p.level for p in real]
    rk = curve_knee(levels, [p.throughput for p in real])
    ek = curve_knee(levels, [e.throughput for e in emulated])
    assert rk.level is not None and ek.level is not None
    assert 16 < rk.level < 64
    assert ek.level == pytest.approx(rk.level, rel=TOLERANCE)
    figures = compare(real, emulated)
    assert figures["knee_ratio"] == pytest.approx(ek.level / rk.level)
    assert figures["within_tolerance"]  # on the check run the 5% rule's ratio alone reads 2.00
    assert figures["knee_ratio_5pct_rule"] in (1.0, 2.0)


def _saturating(a: float, k: float, levels: list[int]) -> list[float]:
    return [a * c / (1 + c / k) for c in levels]


def test_curve_knee_recovers_the_curve_it_is_given() -> None:
    knee = curve_knee(LEVELS, _saturating(100.0, 3.0, LEVELS))
    assert knee.half == pytest.approx(3.0, rel=1e-4)
    assert knee.plateau == pytest.approx(300.0, rel=1e-4)
    assert knee.rms_log_error == pytest.approx(0.0, abs=1e-5)
    # a doubling from c adds 2 (1 + c/k) / (1 + 2c/k) - 1 = 5% at c = k (1 - 0.05) / 0.1
    assert knee.level == pytest.approx(28.5, rel=1e-4)
    assert curve_knee(LEVELS, _saturating(100.0, 3.0, LEVELS), min_gain=0.10).level == (
        pytest.approx(13.5, rel=1e-4)
    )


def test_a_noisy_step_flips_the_5pct_rule_but_not_the_fitted_knee() -> None:
    clean = _saturating(100.0, 3.0, LEVELS)
    noisy = list(clean)
    noisy[6] *= 1.04  # 64 clients read 4% high: the 32 -> 64 step adds 8.7%, not 4.5%
    assert find_knee(LEVELS, clean).level == 32
    assert find_knee(LEVELS, noisy).level == 64
    fitted, got = curve_knee(LEVELS, clean).level, curve_knee(LEVELS, noisy).level
    assert fitted is not None and got is not None
    assert got == pytest.approx(fitted, rel=0.05)
    # and any one level 5% off, either way, moves it by under 6%
    for i in range(len(LEVELS)):
        for scale in (0.95, 1.05):
            moved = [t * scale if j == i else t for j, t in enumerate(clean)]
            assert curve_knee(LEVELS, moved).level == pytest.approx(fitted, rel=0.06), i


def test_curve_knee_without_a_bend_or_past_a_decline() -> None:
    assert curve_knee([1, 2, 4, 8, 16], [10, 20, 40, 80, 160]).level is None
    assert curve_knee([1, 2], [10, 15]).level is None  # two levels are no curve
    # rising to 1143 at 16, then 900 (-21%): the fit reads 1..16 only (alone they say
    # k = 40, a knee at 380), and the knee is not past 16
    rising = _saturating(100.0, 40.0, LEVELS[:5])
    assert curve_knee(LEVELS[:5], rising).level == pytest.approx(380.0, rel=1e-3)
    declined = curve_knee(LEVELS, [*rising, 900, 950, 900])
    assert declined.level == 16
    with pytest.raises(ValueError):
        curve_knee([1, 2, 4], [10, 0, 20])


def test_tpot_at_one_client_and_on_the_plateau(curves: Curves) -> None:
    # the two ends of the step-time line: the weight read (1 client) and the per-sequence
    # cost (64 clients, no prefill in the TPOT window to speak of)
    real, emulated = curves
    for i in (0, 6):
        assert emulated[i].tpot_p50 == pytest.approx(real[i].tpot_p50, rel=TOLERANCE)


def test_cpu_step_adds_compute_and_memory() -> None:
    cpu = StepCost.from_profile(load_profile("cpu-tiny-avx2"))
    gpu = StepCost.from_profile(load_profile("cpu-tiny-avx2", overlap=True))
    args = (8, 8, 8, 8 * 160.0, 8 * 160)
    roof = cpu.seconds(*args) - cpu.fixed_s - 8 * cpu.seq_s
    assert cpu.seconds(*args) > gpu.seconds(*args)
    assert roof == pytest.approx(
        (8 * cpu.token_flops + 8 * cpu.sample_flops + 8 * 160.0 * cpu.attn_flops) * cpu.flop_s
        + (cpu.weight_bytes + 8 * 160 * cpu.kv_bytes) * cpu.byte_s
    )


def test_float32_model_doubles_the_bytes() -> None:
    model = load_profile("cpu-tiny-avx2").model
    assert model.dtype_bytes == 4
    assert model.weight_bytes == pytest.approx(4 * model.params)
    assert model.kv_bytes_per_token == 2 * 8 * 8 * 64 * 4  # 32 KiB: 2 GiB holds 65536 tokens
    assert load_profile("cpu-tiny").model.dtype_bytes == 2


def test_the_gentle_profile_bends_as_the_faster_engine_did() -> None:
    # cpu-tiny-gentle: session 21's vLLM (1,019 / 1,168 / 1,263 tokens/s at 30 / 60 / 120
    # clients, elasticity 0.20 then 0.11): each level within 5%, and each doubling's gain
    # within 0.07 of the engine's, so the curve still rises as gently past 60
    real = load_real(DATA / "vllm-cpu-2026-12-03-sweep.json")
    emulated = emulate("cpu-tiny-gentle", [p.level for p in real])
    for r, e in zip(real, emulated, strict=True):
        assert e.throughput == pytest.approx(r.throughput, rel=0.05), r.level
    gains = [
        [math.log(b.throughput / a.throughput) / math.log(2) for a, b in itertools.pairwise(xs)]
        for xs in (real, emulated)
    ]
    for want, got in zip(*gains, strict=True):
        assert got == pytest.approx(want, abs=0.07)
