from __future__ import annotations

import math

from kneegate.controllers.base import EngineStats
from kneegate.gateway.upstream.telemetry import Progress, parse_engine_metrics

CURRENT = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="m"} 7.0
vllm:num_preemptions_created{engine="0",model_name="m"} 1.7e9
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="m"} 1234.0
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",engine="0",cache_dtype="auto",num_gpu_blocks="1000"} 1.0
vllm:cache_config_info{block_size="16",engine="1",cache_dtype="auto",num_gpu_blocks="500"} 1.0
"""

OLD = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 4.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m"} 0.0
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="m"} 0.75
"""


def stats(at: float, running: float, tokens: float) -> EngineStats:
    return EngineStats(at=at, running=running, waiting=0, kv_cache_usage=0.1,
                       preemptions_total=0, generation_tokens_total=tokens)


def test_current_names_sum_over_engines_and_take_the_fullest_cache() -> None:
    s = parse_engine_metrics(CURRENT, at=5.0)
    assert s == EngineStats(at=5.0, running=5.0, waiting=1.0, kv_cache_usage=0.5,
                            preemptions_total=7.0, generation_tokens_total=1234.0,
                            kv_capacity_tokens=24_000.0)  # (1000 + 500) blocks x 16 tokens


def test_older_names_fall_back_and_missing_counters_are_nan() -> None:
    s = parse_engine_metrics(OLD, at=1.0)
    assert s is not None
    assert (s.running, s.waiting, s.kv_cache_usage) == (4.0, 0.0, 0.75)
    assert math.isnan(s.preemptions_total) and math.isnan(s.generation_tokens_total)
    assert math.isnan(s.kv_capacity_tokens)


def test_a_cache_not_yet_sized_has_no_capacity() -> None:
    text = OLD + ('# TYPE vllm:cache_config_info gauge\n'
                  'vllm:cache_config_info{block_size="16",num_gpu_blocks="None"} 1.0\n')
    s = parse_engine_metrics(text, at=1.0)
    assert s is not None and math.isnan(s.kv_capacity_tokens)


def test_text_without_scheduler_gauges_is_not_an_engine() -> None:
    assert parse_engine_metrics("# TYPE up gauge\nup 1\n", at=0.0) is None


def test_running_without_new_tokens_is_stuck_after_the_stall_bound() -> None:
    p = Progress(stall_after=10.0)
    p.note(stats(0.0, running=2, tokens=100))
    p.note(stats(5.0, running=2, tokens=100))
    assert not p.stuck(9.9)
    assert p.stuck(10.0)
    p.note(stats(11.0, running=2, tokens=101))
    assert not p.stuck(20.9)


def test_an_idle_engine_is_never_stuck() -> None:
    p = Progress(stall_after=1.0)
    p.note(stats(0.0, running=0, tokens=5))
    p.note(stats(30.0, running=0, tokens=5))
    assert not p.stuck(60.0)


def test_stale_scrapes_are_not_evidence() -> None:
    p = Progress(stale_after=5.0)
    assert p.view(0.0, False).stale  # nothing scraped yet
    p.note(stats(10.0, running=1, tokens=1))
    assert not p.view(14.0, False).stale
    assert p.view(15.1, False).stale


def test_untyped_counters_are_read_and_empty_counters_are_unknown() -> None:
    text = (
        "vllm:num_requests_running 2\n"
        "vllm:num_requests_waiting 0\n"
        "vllm:generation_tokens_total 77\n"  # no TYPE line: the family keeps `_total`
        "# TYPE vllm:num_preemptions_total counter\n"  # declared, no sample yet
    )
    s = parse_engine_metrics(text, at=0.0)
    assert s is not None and s.generation_tokens_total == 77.0
    assert math.isnan(s.preemptions_total)  # not 0: an empty counter is unknown


def test_empty_scheduler_gauges_read_as_nothing_running() -> None:
    text = "# TYPE vllm:num_requests_running gauge\n# TYPE vllm:num_requests_waiting gauge\n"
    s = parse_engine_metrics(text, at=0.0)
    assert s is not None and (s.running, s.waiting) == (0.0, 0.0)


GAUGES = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0"} 2.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0"} 0.0
"""


def histogram(name: str, total: float, count: float) -> str:
    return (f"# TYPE {name} histogram\n"
            f'{name}_bucket{{engine="0",le="+Inf"}} {count}\n'
            f'{name}_count{{engine="0"}} {count}\n'
            f'{name}_sum{{engine="0"}} {total}\n')


def test_histograms_are_read_by_their_sum_and_count_summed_over_engines() -> None:
    text = GAUGES + histogram("vllm:request_queue_time_seconds", 3.0, 10) + """\
# TYPE vllm:inter_token_latency_seconds histogram
vllm:inter_token_latency_seconds_bucket{engine="0",le="+Inf"} 100.0
vllm:inter_token_latency_seconds_bucket{engine="1",le="+Inf"} 20.0
vllm:inter_token_latency_seconds_count{engine="0"} 100.0
vllm:inter_token_latency_seconds_count{engine="1"} 20.0
vllm:inter_token_latency_seconds_sum{engine="0"} 1.5
vllm:inter_token_latency_seconds_sum{engine="1"} 0.5
"""
    s = parse_engine_metrics(text, at=1.0)
    assert s is not None
    assert (s.queue_time_sum, s.queue_time_count) == (3.0, 10)
    assert (s.itl_sum, s.itl_count) == (2.0, 120)


def test_the_token_gaps_come_from_the_current_name_before_the_older_whatever_the_order() -> None:
    older = histogram("vllm:time_per_output_token_seconds", 9.0, 90)
    current = histogram("vllm:inter_token_latency_seconds", 1.0, 50)
    for text in (GAUGES + older + current, GAUGES + current + older):
        s = parse_engine_metrics(text, at=1.0)
        assert s is not None and (s.itl_sum, s.itl_count) == (1.0, 50)
    s = parse_engine_metrics(GAUGES + older, at=1.0)  # vLLM before 0.11
    assert s is not None and (s.itl_sum, s.itl_count) == (9.0, 90)
    s = parse_engine_metrics(GAUGES, at=1.0)
    assert s is not None and math.isnan(s.itl_sum) and math.isnan(s.itl_count)
