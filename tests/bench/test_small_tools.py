"""The small benchmarks run end to end and print figures: the emulator's relay speed (a real
emulator process and sockets) and the admission queue's own CPU per request. Only that they
run and measure something is checked here; their figures belong to docs/benchmarks.md."""

from __future__ import annotations

import re

import pytest

from kneegate_bench import admission_cost, emulator_relay


def test_the_relay_benchmark_counts_the_events_it_was_streamed(
        capsys: pytest.CaptureFixture[str]) -> None:
    emulator_relay.main(["--streams", "4", "--tokens", "200", "--seconds", "1"])
    out = capsys.readouterr().out
    m = re.search(r"events: ([\d,]+), ([\d,]+) events/s wall, server CPU ([\d.]+) s", out)
    assert m is not None, out
    events, per_s = (int(m[i].replace(",", "")) for i in (1, 2))
    assert events > 0 and per_s > 0


def test_the_admission_cost_benchmark_prints_a_row_per_tenant_count(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert admission_cost.main(["--tenants", "1,10", "--requests", "200", "--repeat", "1"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:] if line.strip()]
    assert [r[0] for r in rows] == ["1", "10"]
    for r in rows:  # through, queued and the gate's path: microseconds a request, each > 0
        assert len(r) == 4 and all(float(x) > 0 for x in r[1:]), r
