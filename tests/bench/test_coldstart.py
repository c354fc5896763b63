"""The cold-start benchmark in front of a running engine (`--upstream`, what `--start-vllm`
sets up for the real-vLLM tier): every cell talks to that engine, a fresh gateway before it."""

from __future__ import annotations

import pytest

from kneegate_bench.coldstart import main
from kneegate_bench.openloop import fetch_metrics, metric_totals


def _served(url: str) -> float:
    return metric_totals(fetch_metrics(url)).get("vllm:request_success_total", 0.0)


def test_with_an_upstream_every_arm_is_served_by_that_engine(emulator, capsys) -> None:
    url, _ = emulator
    before = _served(url)
    assert main(["--upstream", url, "--model", "cpu-tiny", "--clients", "2", "--requests", "2",
                 "--rounds", "1", "--prompt-tokens", "8", "--max-tokens", "2"]) == 0
    assert _served(url) - before == 2 * 2 * 2  # direct's 4, then kneegate's 4, all there
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.split()[:2] == ["2", "1"]]
    assert [(r[2], r[3], r[4]) for r in rows] == [("direct", "4", "4"), ("kneegate", "4", "4")]
    assert "kneegate / direct, median over 1 rounds: 1.000" in out


def test_an_upstream_and_a_started_vllm_together_are_refused() -> None:
    with pytest.raises(SystemExit, match="not both"):
        main(["--upstream", "http://127.0.0.1:9", "--start-vllm"])
