"""The trace replay benchmark's parts: its arms, its refusals by prompt size
(kneegate_bench.refusals), and a replay onto several replicas (real processes, real sockets)."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from pathlib import Path

import pytest

from kneegate.admission.affinity import prompt_keys
from kneegate.sim import trace
from kneegate_bench.arms import TINY_VOCAB, Arm
from kneegate_bench.openloop import Record, fetch_metrics, metric_totals
from kneegate_bench.refusals import by_bucket, lost
from kneegate_bench.replay import (
    arms,
    main,
    parser,
    prompt_ids,
    replay,
    serving,
)


def _args(*extra: str):  # type: ignore[no-untyped-def]
    return parser().parse_args(["--warmup", "0", "--seconds", "5", "--request-timeout", "20",
                                *extra])


def test_arms_name_the_gateway_its_fixed_limits_and_the_valve() -> None:
    a = {x.name: x for x in arms("direct,kneegate,fixed-32,valve-512")}
    assert a["direct"].gateway_flags is None and a["direct"].engine_flags == ()
    assert a["kneegate"].gateway_flags == ()
    assert a["fixed-32"].gateway_flags == ("--controller", "fixed", "--limit", "32")
    assert a["valve-512"].engine_flags == ("--max-num-queued-tokens", "512")
    assert a["valve-512"].gateway_flags is None
    for bad in ("fixed-0", "fixed-x", "oracle"):
        with pytest.raises(ValueError, match="unknown arm"):
            arms(bad)


def test_refusals_are_counted_by_prompt_size_among_the_measured_users() -> None:
    users = [Record(measured=True, prompt=100, status=429),
             Record(measured=True, prompt=100, status=200),
             Record(measured=True, prompt=3000, status=503),
             Record(measured=False, prompt=100, status=429),  # warm-up: not counted
             Record(measured=True, prompt=500, gave_up=True)]  # left: not a refusal
    assert by_bucket(users) == {"0-256": (1, 2), ">=2048": (1, 1), "256-1024": (0, 1)}


def test_a_refusal_is_lost_where_the_engine_alone_served_that_request_in_time() -> None:
    arm = [Record(measured=True, status=429),  # direct: good -> lost
           Record(measured=True, status=429),  # direct: late -> not lost
           Record(measured=True, status=503),  # direct: refused too -> not lost
           Record(measured=True, status=200, ttft=0.5),  # served -> not lost
           Record(measured=False, status=429),  # warm-up -> not counted
           Record(measured=True, gave_up=True)]  # left -> not a refusal
    direct = [Record(measured=True, status=200, ttft=1.9),
              Record(measured=True, status=200, ttft=2.1),
              Record(measured=True, status=503),
              Record(measured=True, status=200, ttft=0.4),
              Record(measured=False, status=200, ttft=0.1),
              Record(measured=True, status=200, ttft=0.1)]
    assert lost(arm, direct, objective=2.0) == 1
    assert lost(arm, direct, objective=3.0) == 2
    with pytest.raises(ValueError):  # the same schedule, or nothing to compare
        lost(arm, direct[:-1], objective=2.0)


def test_no_two_replayed_prompts_share_a_prefix() -> None:
    keys = [prompt_keys({"prompt": prompt_ids(n, 300)}) for n in range(2000)]
    assert all(len(k) == 2 for k in keys)  # two full runs of 128 ids each
    assert len({k[0] for k in keys}) == 2000  # every first run its own
    assert prompt_ids(5, 300) == prompt_ids(5, 300)  # the same request, the same prompt
    assert max(max(prompt_ids(n, 2048)) for n in range(50)) < 100 + 30_000


def test_prompts_for_the_tiny_model_stay_inside_its_vocabulary_and_apart() -> None:
    prompts = [prompt_ids(n, 1000, TINY_VOCAB) for n in range(3000)]
    assert min(min(p) for p in prompts) >= 100
    assert max(max(p) for p in prompts) < TINY_VOCAB  # vLLM refuses an id past its vocab
    assert len({tuple(p[:16]) for p in prompts}) == 3000  # no two share a first block


@pytest.mark.parametrize("argv, says", [
    (["--replicas", "2", "--start-vllm"], "--replicas starts emulators"),
    (["--upstream", "http://127.0.0.1:9", "--start-vllm"], "not both"),
    (["--upstream", "http://127.0.0.1:9", "--arms", "kneegate,valve-512"], "valve-N arms"),
])
def test_flags_that_cannot_go_together_are_refused_before_anything_starts(
        argv: list[str], says: str) -> None:
    with pytest.raises(SystemExit, match=says):
        main(argv)


def _served(url: str) -> float:
    return metric_totals(fetch_metrics(url)).get("vllm:request_success_total", 0.0)


def test_without_a_gateway_the_replicas_take_the_requests_in_turn() -> None:
    args = _args("--replicas", "2")
    reqs = [trace.Request(at=0.05 * i, prompt=16, output=4) for i in range(6)]
    with serving(Arm("direct"), args) as urls:
        assert len(urls) == 2 and urls[0] != urls[1]
        users = asyncio.run(replay(urls, reqs, args))
        served = [_served(u) for u in urls]
    assert len(users) == 6 and all(u.status == 200 and u.done and u.tokens == 4 for u in users)
    assert served == [3.0, 3.0]


def test_a_gateway_arm_puts_one_gateway_in_front_of_every_replica() -> None:
    args = _args("--replicas", "2")
    reqs = [trace.Request(at=0.0, prompt=16, output=4)]
    with serving(Arm("fixed-3", gateway_flags=("--controller", "fixed", "--limit", "3")),
                 args) as urls:
        assert len(urls) == 1
        users = asyncio.run(replay(urls, reqs, args))
        with urllib.request.urlopen(urls[0] + "/kneegate/status", timeout=10) as r:
            upstreams = json.load(r)["upstreams"]
    assert users[0].status == 200 and users[0].done
    assert len(upstreams) == 2 and len({u["url"] for u in upstreams}) == 2
    assert [u["limit"] for u in upstreams] == [3, 3]  # fixed-N: N per engine


def test_replicas_take_no_running_upstream() -> None:
    from kneegate_bench.replay import main

    with pytest.raises(SystemExit, match="no --upstream"):
        main(["--replicas", "2", "--upstream", "http://127.0.0.1:9"])


def test_a_whole_round_prints_and_writes_every_arms_refusals(tmp_path: Path) -> None:
    """One round of the code trace at 3x, direct beside a gateway held to one request (real
    engines, gateways and sockets): every column is computed and the refusals add up, each
    reason and each prompt-size bucket counting the same users."""
    out = tmp_path / "replay.json"
    main(["--trace", "code", "--arms", "direct,fixed-1", "--loads", "3", "--rounds", "1",
          "--seconds", "5", "--warmup", "0", "--capacity", "39", "--request-timeout", "20",
          "--json", str(out)])
    rows = {r["arm"]: r for r in json.loads(out.read_text())["rows"]}
    direct, held = rows["direct"], rows["fixed-1"]
    assert direct["users"] == held["users"] > 10  # the same arrivals
    assert direct["refused_by_reason"] == {} and direct["lost"] == 0
    assert direct["over_direct"] == 1.0
    refused = sum(held["refused_by_reason"].values())
    assert refused == held["rejected"] > 0  # one slot cannot take 3x
    assert sum(n for n, _ in held["by_size"].values()) == refused
    assert sum(sent for _, sent in held["by_size"].values()) == held["users"]
    assert 0 <= held["lost"] <= refused
