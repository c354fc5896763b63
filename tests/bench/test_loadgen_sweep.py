"""Load generator bounds and outcomes, the knee rule, and a real sweep against the emulator."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from helpers.uvicorn_thread import serve

from kneegate.emulator.core import EngineCore
from kneegate.emulator.profiles import load_profile
from kneegate.emulator.server import build_app
from kneegate.emulator.virtual import closed_loop as virtual_closed_loop
from kneegate.sim.knee_rule import find_knee
from kneegate_bench.loadgen import LoadConfig, closed_loop, open_loop, run_trace
from kneegate_bench.sweep import SweepPoint, main, parse_levels, regions


def test_knee_rule_on_the_reference_table() -> None:
    levels = [1, 2, 4, 8, 16, 32, 64, 128]
    knee = find_knee(levels, [156, 281, 475, 675, 890, 1067, 1149, 1188])
    assert (knee.level, knee.safe, knee.peak_level) == (64, 51, 128)
    assert find_knee([1, 2], [10, 20]).level is None
    assert find_knee([10, 20, 30], [100, 104, 90], min_gain=0.05, backoff=0.5).safe == 5


def test_levels_as_list_or_range() -> None:
    assert parse_levels("4,1,2", None, None, None) == [1, 2, 4]
    assert parse_levels(None, 10, 10, 40) == [10, 20, 30, 40]
    with pytest.raises(ValueError, match="--levels"):
        parse_levels(None, None, None, None)


def test_regions_split_linear_plateau_decline() -> None:
    pts = [
        SweepPoint(c, t, None, None, 1, 0)
        for c, t in [(1, 100), (2, 190), (4, 300), (8, 310), (16, 320), (32, 200)]
    ]
    knee = find_knee([p.level for p in pts], [p.throughput for p in pts])
    assert regions(pts, knee) == {"linear": (1, 4), "plateau": (4, 32), "decline": (32, 32)}


def test_closed_loop_is_bounded_by_requests_and_by_seconds(emulator) -> None:
    url, _ = emulator
    cfg = LoadConfig(url=url, prompt_tokens=16, max_tokens=4, max_requests=10, max_seconds=10)
    result = asyncio.run(closed_loop(cfg, 3))
    s = result.summary()
    assert s["requests"] == 10 and s["outcomes"] == {"ok": 10}
    assert s["ttft_p50"] > 0 and s["tpot_p50"] > 0 and s["output_tokens"] == 40
    t0 = time.monotonic()
    slow = LoadConfig(url=url, prompt_tokens=16, max_tokens=1000, max_seconds=1.0)
    s = asyncio.run(closed_loop(slow, 2)).summary()
    assert time.monotonic() - t0 < 3.0
    assert s["outcomes"] == {"cancelled": 2} and s["output_tokens"] > 0


def test_open_loop_trace_and_outcomes(emulator) -> None:
    url, _ = emulator
    cfg = LoadConfig(
        url=url,
        prompt_tokens=16,
        max_tokens=3,
        stream=False,
        chat=True,
        max_requests=5,
        max_seconds=10,
    )
    s = asyncio.run(open_loop(cfg, rate=50.0)).summary()
    assert s["outcomes"] == {"ok": 5} and s["ttft_p50"] is None and s["output_tokens"] == 15
    trace = [{"t": 0.0, "max_tokens": 2}, {"t": 0.05, "max_tokens": 5000}]
    s = asyncio.run(run_trace(LoadConfig(url=url, max_seconds=10), trace)).summary()
    assert s["outcomes"] == {"ok": 1, "http_400": 1}
    s = asyncio.run(closed_loop(LoadConfig(url=url, model="nope", max_requests=2), 1)).summary()
    assert s["outcomes"] == {"http_404": 2}


def test_sweep_finds_the_knee_the_profile_predicts(tmp_path) -> None:
    """cpu-tiny capped at 16 sequences, 4x real time: throughput flattens at 16 clients."""
    profile = load_profile("cpu-tiny", max_num_seqs=16)
    levels = [4, 16, 32, 64]
    predicted = find_knee(
        levels,
        [
            virtual_closed_loop(lambda: EngineCore(profile), c, 20.0, 128, 64, warmup=2).throughput
            for c in levels
        ],
    ).level
    assert predicted == 16
    with serve(build_app(profile, speed=4.0)) as url:
        main(
            [
                "--url",
                url,
                "--levels",
                ",".join(map(str, levels)),
                "--step-seconds",
                "2",
                "--warmup",
                "1",
                "--out",
                str(tmp_path),
            ]
        )
    data = json.loads((tmp_path / "sweep.json").read_text())
    assert predicted / 2 <= data["knee"]["level"] <= predicted * 2
    assert data["knee"]["safe"] == int(0.8 * data["knee"]["level"])
    assert (tmp_path / "sweep.png").stat().st_size > 10_000
