"""`kneegate demo`: the same overload direct and through kneegate, side by side."""

from __future__ import annotations

import re

import pytest

from kneegate.benchmarks.demo import run_demo


def test_the_demo_sends_one_overload_to_both_arms_and_prints_them_side_by_side(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert run_demo(load=3.0, seconds=2.0, drain=6.0) == 0
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
