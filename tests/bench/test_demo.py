"""`kneegate demo`: the same overload direct and through kneegate, side by side."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kneegate_bench.demo import run_demo


def test_the_demo_sends_one_overload_to_both_arms_and_prints_them_side_by_side(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    plot = tmp_path / "demo.png"
    assert run_demo(load=3.0, seconds=2.0, drain=6.0, plot=plot) == 0
    out = capsys.readouterr().out
    capacity = re.search(r"capacity ([\d.]+) requests/s", out)
    assert capacity and float(capacity.group(1)) > 0
    # the header names the phases the lines are labelled with
    assert "5 s of warm-up, 2 s measured, then up to 6 s finishing" in out
    # a line a second from each arm, by phase: as many warm-up and measured lines as the
    # header says seconds; kneegate's also show its limit and queue
    for arm in ("direct", "kneegate"):
        phases = re.findall(rf"^\s*{arm}\s+(warm-up|measured|finishing)\s+\d+s\s+sent", out,
                            re.M)
        assert phases.count("warm-up") == 5 and phases.count("measured") == 2, phases
        assert phases[:7] == ["warm-up"] * 5 + ["measured"] * 2  # in order
        assert phases.count("finishing") <= 6 + 2  # bounded as the header says (+ teardown)
    assert re.search(r"^\s*kneegate\s+measured\s+\d+s\s+sent.*limit\s+\d+\s+knee", out,
                     re.M)
    table = out[out.rindex("direct"):]
    rows = {line[:46].strip(): line[46:].split() for line in table.splitlines()[1:]}
    sent = [int(x) for x in rows["users (sent in the measured window)"]]
    assert min(sent) > 0
    within = rows["first token within 2 s of sending"]
    assert all(int(n) <= s for n, s in zip(within[::2], sent, strict=True))
    # under each share, its ceiling at that load
    assert rows["ceiling at 3x load (capacity / load)"] == ["33%", "33%"]
    assert all(g.isdigit() for g in rows["goodput: their output, tok/s"])
    limit, knee = rows["kneegate's limit / knee estimate at the end"][-3::2]
    assert int(limit) >= 1 and (knee == "-" or knee.isdigit())
    # then what kneegate learned: its curve, the knee (or why none yet) and the limit on it.
    # These few seconds may end before the first level is measured: the curve's lines,
    # knee and picture are checked from a status in test_learned.py
    learned = out[out.index("what kneegate learned (GET /kneegate/status)"):]
    if "no level measured yet" in learned:
        assert learned.split("its limit: ")[1].split()[0] == limit
    else:
        assert re.search(r"^\s+\d+\s+\d+\s+#+\s", learned, re.M)  # a level, its bar
        on_curve = re.search(r"^\s*limit\s+(\d+)\s+<- where kneegate holds the engine",
                             learned, re.M)
        assert on_curve and on_curve.group(1) == limit  # the table's limit, on the curve
        assert (re.search(r"^\s*knee\s+\d+\s+<- where the curve bends", learned, re.M)
                or "no knee yet: throughput still rises at the highest level" in learned)
        assert f"the same, drawn: {plot}" in learned
        assert plot.read_bytes().startswith(b"\x89PNG")


def test_the_demos_summary_ends_with_the_curve_its_knee_and_the_limit(tmp_path: Path) -> None:
    from kneegate_bench.demo import _learned

    curve = [{"concurrency": c, "throughput": t, "ttft_p90": 0.4, "tpot_p50": 0.03}
             for c, t in ((16, 700.0), (32, 1050.0), (64, 1150.0))]
    status = {"upstreams": [{"limit": 40, "in_flight": 38, "controller": {
        "name": "knee", "knee_estimate": 45.0, "curve": curve, "curve_of": "engine",
        "fit": {"curve_knee": 45.0}}}]}
    plot = tmp_path / "demo.png"
    lines = _learned(status, plot)
    marks = [line.split()[0] for line in lines if line.strip()][2:-1]
    assert marks == ["16", "32", "limit", "knee", "64"]  # the limit just under the knee
    assert lines[-1] == f"the same, drawn: {plot}" and plot.stat().st_size > 0
    assert _learned({}, plot) == []  # no status read: nothing to show
