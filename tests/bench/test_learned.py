"""What kneegate learned, as the demo prints it: the curve, the knee and the limit on it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kneegate_bench.learned import curve_lines, knee_of, picture


def upstream(knee: float | None = None, bend: float | None = None, limit: int = 40,
             **controller: Any) -> dict[str, Any]:
    points = [(10, 500.0, 0.2, 0.02), (20, 900.0, 0.3, 0.03), (40, 1000.0, 0.6, 0.05)]
    return {"limit": limit, "in_flight": limit - 2, "controller": {
        "name": "knee", "knee_estimate": knee, "curve_of": "engine",
        "fit": {"curve_knee": bend},
        "curve": [{"concurrency": c, "throughput": t, "ttft_p90": f, "tpot_p50": p}
                  for c, t, f, p in points], **controller}}


def test_the_knee_and_the_limit_stand_at_their_levels_on_the_curve() -> None:
    lines = curve_lines(upstream(knee=25.0, limit=22))
    assert lines[0] == ("what kneegate learned (GET /kneegate/status): requests in the engine "
                        "-> output tok/s")
    levels = [line.split()[0] for line in lines[2:]]
    assert levels == ["10", "20", "limit", "knee", "40"]
    assert lines[5] == "  knee    25  <- where the curve bends (kneegate's estimate)"
    assert lines[4] == (" limit    22  <- where kneegate holds the engine at the end "
                        "(20 in flight)")
    assert lines[6].count("#") == 40 and lines[2].count("#") == 20  # bars by throughput
    assert "300 ms" in lines[3] and "30 ms" in lines[3]  # TTFT p90, TPOT p50


def test_without_an_estimate_the_fitted_bend_is_the_knee_and_said_so() -> None:
    assert knee_of(upstream(bend=30.0)["controller"]) == (
        30.0, "the fitted curve's bend, not yet confirmed")
    assert knee_of(upstream(knee=25.0, bend=30.0)["controller"])[0] == 25.0


def test_no_knee_yet_is_said_with_the_highest_level_measured() -> None:
    lines = curve_lines(upstream(limit=60))
    assert not any(line.split()[0] == "knee" for line in lines[2:])
    assert lines[-2].split()[:2] == ["limit", "60"]
    assert lines[-1].startswith("no knee yet: throughput still rises at the highest level "
                                "measured (40)")


def test_a_controller_without_a_curve_says_so() -> None:
    up = {"limit": 25, "in_flight": 3, "controller": {"name": "fixed"}}
    assert curve_lines(up) == ["kneegate's fixed controller learns no curve; its limit: 25"]


def test_a_curve_with_no_level_yet_says_so_and_draws_nothing(tmp_path: Path) -> None:
    up = upstream(curve=[])
    assert curve_lines(up) == [
        "what kneegate learned (GET /kneegate/status): no level measured yet (each takes a few "
        "windows of steady load); its limit: 40"]
    assert not picture(up, tmp_path / "x.png") and not (tmp_path / "x.png").exists()


def test_the_picture_is_a_png(tmp_path: Path) -> None:
    path = tmp_path / "learned.png"
    assert picture(upstream(knee=25.0), path)
    assert path.read_bytes().startswith(b"\x89PNG")
