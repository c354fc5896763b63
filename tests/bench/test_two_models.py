"""kneegate_bench.two_models: its figures from literal users, and the whole benchmark in
miniature over real sockets (two emulators, three gateways), judged by its report's
structure, never by its timings."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kneegate_bench.openloop import Record
from kneegate_bench.two_models import Engine, main, parse_engine
from kneegate_bench.two_models_figures import gauges, medians, wrong_and_right


def test_an_engine_is_model_profile_and_speed() -> None:
    assert parse_engine("chat:cpu-tiny:0.25") == Engine("chat", "cpu-tiny", 0.25)
    assert parse_engine("small:cpu-tiny") == Engine("small", "cpu-tiny", 1.0)
    assert parse_engine("chat:cpu-tiny:0.5").flags == ("--speed", "0.5", "--model-name", "chat")
    for bad in ("chat", "chat:cpu-tiny:fast", "chat:cpu-tiny:0", ":cpu-tiny:1"):
        with pytest.raises(argparse.ArgumentTypeError, match="MODEL:PROFILE:SPEED"):
            parse_engine(bad)


def test_a_wrong_answer_names_another_model_or_is_an_engines_404() -> None:
    users = [Record(status=200, model="chat"), Record(status=200, model="chat"),
             Record(status=200, model="small"),  # answered by the other engine
             Record(status=404),  # refused by an engine that lacks the model
             Record(status=200),  # no first token: nobody named yet
             Record(status=429), Record(status=None)]
    assert wrong_and_right(users, "chat") == (2, 2)


def test_a_models_gauges_are_its_upstreams_at_the_end_of_the_window() -> None:
    into = {("kneegate_limit", "up-0"): [4.0, 8.0, 10.0],
            ("kneegate_limit", "up-1"): [3.0, 3.0, 5.0],
            ("kneegate_limit", "up-2"): [1.0, 1.0, 1.0],
            ("kneegate_demand_ratio", "chat"): [2.0, 3.0, 2.5],
            ("kneegate_suggested_replicas", "chat"): [3.0, 4.0, 3.0]}
    owners = {"up-0": "chat", "up-1": "chat,chat-lora", "up-2": "small"}
    assert gauges(into, owners, "chat") == {
        "limit_end": 15.0, "limit_p50": 11.0, "ratio_end": 2.5, "ratio_p50": 2.5,
        "replicas_end": 3.0}
    assert gauges(into, owners, "nobody") == dict.fromkeys(
        ("limit_end", "limit_p50", "ratio_end", "ratio_p50", "replicas_end"))


def test_medians_sum_the_wrong_answers_over_the_runs() -> None:
    def cell(goodput: float, wrong: int) -> dict[str, object]:
        return {"models": {"chat": {"goodput_tok_s": goodput, "wrong": wrong,
                                    "limit_end": goodput / 10}}}

    runs = [{"pooled": {**cell(100, 0), "unknown": {"p50_ms": 1.0, "p99_ms": 3.0, "other": 0}},
             "alone": cell(120, 0)},
            {"pooled": {**cell(300, 1), "unknown": {"p50_ms": 2.0, "p99_ms": 4.0, "other": 1}},
             "alone": cell(90, 0)},
            {"pooled": {**cell(200, 0), "unknown": {"p50_ms": 3.0, "p99_ms": 9.0, "other": 0}},
             "alone": cell(100, 0)}]
    med = medians(runs, ["chat"])
    assert med["chat"]["wrong"] == 1
    assert med["chat"]["pooled"]["goodput_tok_s"] == 200
    assert med["chat"]["alone"]["limit_end"] == 10
    assert med["chat"]["pooled"]["ratio_end"] is None  # never read
    assert med["unknown"] == {"p50_ms": 2.0, "p99_ms": 4.0, "other": 1}


def test_the_benchmark_in_miniature(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Two emulators (one twice as fast) behind one gateway, then each behind its own: every
    answer from an engine serving its model, the unknown model answered 404 by the gateway."""
    out = tmp_path / "two.json"
    rc = main(["--engine", "chat:cpu-tiny:1", "--engine", "small:cpu-tiny:2",
               "--capacity", "160,320", "--load", "0.5", "--max-tokens", "16",
               "--prompt-tokens", "32", "--runs", "1", "--duration", "2", "--warmup", "1",
               "--unknown-rate", "10", "--request-timeout", "10", "--give-up", "5",
               "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "engine chat: cpu-tiny at speed 1, capacity 160 tok/s (given)" in text
    assert "medians over 1 run" in text and "unknown model 404 from send" in text
    report = json.loads(out.read_text())
    assert [e["model"] for e in report["engines"]] == ["chat", "small"]
    assert report["engines"][1]["offered_rps"] == pytest.approx(10.0)  # 0.5 x 320 / 16
    (run,) = report["runs"]
    for arm in ("pooled", "alone"):
        for model in ("chat", "small"):
            row = run[arm]["models"][model]
            assert row["wrong"] == 0, (arm, model)
            assert row["right"] > 0 and row["sent"] >= row["right"]
            assert {"goodput_tok_s", "ttft_p99_ms", "limit_end", "ratio_end",
                    "replicas_end"} <= set(row)
            assert row["limit_end"] is not None  # the gateway's limit was read
    assert run["pooled"]["models"]["small"]["engine_served"] > 0
    unknown = run["pooled"]["unknown"]
    assert unknown["measured"] > 0 and unknown["answered_404"] == unknown["measured"]
    assert unknown["other"] == 0 and unknown["by_gateway"] >= unknown["measured"]
    assert unknown["p50_ms"] is not None and unknown["p99_ms"] is not None
    assert report["medians"]["chat"]["wrong"] == report["medians"]["small"]["wrong"] == 0


def test_it_refuses_two_engines_of_one_model() -> None:
    with pytest.raises(SystemExit):
        main(["--engine", "chat:cpu-tiny:1", "--engine", "chat:cpu-tiny:2"])
    with pytest.raises(SystemExit):
        main(["--unknown-model", "chat"])
