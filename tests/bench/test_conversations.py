"""The multi-turn chat benchmark's parts: its arms, vLLM's router as one, and a cell on two
emulated replicas (real processes, real sockets)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kneegate_bench.conversations import (
    _cache_counts,
    _replicas,
    main,
    parser,
    router_command,
    run_cell,
    summarize,
)


def test_an_unknown_arm_is_refused_before_anything_starts(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--arms", "most-room,envoy"])
    assert "unknown arm(s) ['envoy']" in capsys.readouterr().err


def test_the_router_arm_missing_its_program_says_what_to_install(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="pip install vllm-router==") as stop:
        main(["--arms", "affinity,vllm-router", "--peer-bin", str(tmp_path)])
    assert f"no vllm-router in {tmp_path}" in str(stop.value)


def test_the_router_runs_its_cache_aware_policy_in_front_of_every_replica() -> None:
    cmd = router_command("/bin/vllm-router", ["http://127.0.0.1:1", "http://127.0.0.1:2"], 8001)
    at = cmd.index("--worker-urls")
    assert cmd[at + 1:at + 3] == ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    assert cmd[cmd.index("--policy") + 1] == "cache_aware"
    assert cmd[cmd.index("--port") + 1] == "8001" and cmd[0] == "/bin/vllm-router"


def test_sticky_conversations_hit_the_cache_their_earlier_turns_filled() -> None:
    """Each conversation always to one replica: from its second turn on, its history is
    cached there, and every turn is answered."""
    args = parser().parse_args(["--seconds", "3", "--warmup", "0", "--turns", "3",
                                "--think", "0.05", "--max-tokens", "8",
                                "--request-timeout", "20"])
    with _replicas(2, caching=True) as engines:
        cell = asyncio.run(run_cell(engines, "sticky", 2.0, args, seed=5))
        cell.hits, cell.queries = _cache_counts(engines)
    assert cell.turns and all(t.status == 200 and t.tokens == 8 for t in cell.turns)
    s = summarize(cell, 3.0, 2.0)
    assert s["hit_rate"] > 0.3 and s["refused"] == 0
