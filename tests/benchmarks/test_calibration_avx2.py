"""cpu-tiny-avx2 reproduces the recorded live vLLM runs within ±20%.

A deterministic check of the profile's data (virtual time, no vLLM, about a second of CPU)
against the real curves in benchmarks/data/: the run the profile was fitted to and a second
run made after the fit; the load and timing are those of `python -m benchmarks.calibrate_vllm`.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.calibrate_vllm import TOLERANCE, RealPoint, emulate, knee_of, load_real
from benchmarks.engine.cost import StepCost
from benchmarks.engine.profiles import load_profile
from benchmarks.engine.virtual import LoopResult
from benchmarks.sweep import find_knee

Curves = tuple[list[RealPoint], list[LoopResult]]
DATA = Path(__file__).parents[2] / "benchmarks" / "data"
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
