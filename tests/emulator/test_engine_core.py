"""The core's scheduler mechanics, step by step, with literal numbers."""

from __future__ import annotations

import math

import pytest

from kneegate.emulator.core import (
    QUEUED_REQS,
    QUEUED_TOKENS,
    EngineCore,
    EngineRequest,
    QueueFull,
)
from kneegate.emulator.profiles import list_profiles, load_profile


def core(**overrides) -> EngineCore:
    return EngineCore(load_profile("cpu-tiny", **overrides))


def run_to_end(c: EngineCore, limit: int = 100_000) -> list:
    events = []
    for _ in range(limit):
        if not c.has_unfinished():
            return events
        events.extend(c.step().events)
    raise AssertionError("engine did not finish")


def test_profiles_load_and_have_the_required_names() -> None:
    names = list_profiles()
    for required in (
        "cpu-tiny",
        "small-kv",
        "l4-llama8b",
        "a100-llama8b",
        "h100-llama8b",
        "h100-llama70b-tp4",
    ):
        assert required in names
    for name in names:
        p = load_profile(name)
        assert p.num_blocks > 0 and p.max_model_len > 0
    assert load_profile("small-kv").kv_cache_tokens == 3072
    assert load_profile("cpu-tiny", max_num_seqs=8).engine.max_num_seqs == 8


def test_unknown_profile_and_override_say_what_exists() -> None:
    with pytest.raises(ValueError, match=r"known: .*cpu-tiny"):
        load_profile("nope")
    with pytest.raises(ValueError, match="engine keys"):
        load_profile("cpu-tiny", max_seqs=3)


def test_idle_step_is_free() -> None:
    r = core().step()
    assert r.duration == 0.0 and r.events == []


def test_one_request_emits_exactly_max_tokens_then_length() -> None:
    c = core()
    c.add_request(EngineRequest("a", prompt_tokens=100, max_tokens=5))
    events = run_to_end(c)
    assert [e.new_tokens for e in events] == [1] * 5
    assert [e.first for e in events] == [True, False, False, False, False]
    assert [e.finished for e in events] == [None] * 4 + ["length"]
    s = c.stats()
    assert (s.prompt_tokens_total, s.generation_tokens_total, s.kv_cache_usage) == (100, 5, 0.0)


def test_long_prompt_is_chunked_by_the_token_budget() -> None:
    c = core(max_num_batched_tokens=64)
    c.add_request(EngineRequest("a", prompt_tokens=150, max_tokens=2))
    chunks = [c.step() for _ in range(3)]
    assert [r.num_prefill_tokens for r in chunks] == [64, 64, 22]
    assert [len(r.events) for r in chunks] == [0, 0, 1]  # a partial chunk emits nothing


def test_decodes_go_first_and_prefills_take_the_rest_of_the_budget() -> None:
    c = core(max_num_batched_tokens=100)
    c.add_request(EngineRequest("a", prompt_tokens=50, max_tokens=10))
    c.step()
    c.add_request(EngineRequest("b", prompt_tokens=500, max_tokens=10))
    r = c.step()
    assert (r.num_decode_tokens, r.num_prefill_tokens) == (1, 99)


def test_max_num_seqs_caps_the_running_set() -> None:
    c = core(max_num_seqs=2)
    for i in range(5):
        c.add_request(EngineRequest(f"r{i}", prompt_tokens=10, max_tokens=3))
    c.step()
    assert (c.stats().running, c.stats().waiting) == (2, 3)


def test_kv_exhaustion_preempts_the_newest_and_it_recomputes() -> None:
    # 5 usable blocks of 16 tokens; each request peaks at ceil((32+31)/16) = 4 blocks
    c = core(kv_cache_tokens=96)
    c.add_request(EngineRequest("old", prompt_tokens=32, max_tokens=32))
    c.add_request(EngineRequest("new", prompt_tokens=32, max_tokens=32))
    preempted = 0
    for _ in range(20):
        preempted += c.step().num_preempted
        if preempted:
            break
    assert preempted == 1
    assert (c.stats().running, c.stats().waiting) == (1, 1)
    events = run_to_end(c)
    assert sum(e.new_tokens for e in events if e.request_id == "old") > 0
    finished = {e.request_id: e.finished for e in events if e.finished}
    assert finished == {"old": "length", "new": "length"}
    assert c.stats().kv_cache_usage == 0.0


def test_abort_frees_blocks_at_once() -> None:
    c = core()
    c.add_request(EngineRequest("a", prompt_tokens=200, max_tokens=50))
    c.step()
    assert c.stats().kv_cache_usage > 0
    assert c.abort_request("a") is True
    assert c.stats().kv_cache_usage == 0.0 and not c.has_unfinished()
    assert c.abort_request("a") is False


def test_request_larger_than_the_cache_is_refused() -> None:
    with pytest.raises(ValueError, match="KV cache"):
        core(kv_cache_tokens=256).add_request(EngineRequest("a", prompt_tokens=300, max_tokens=1))


def test_slowdown_multiplies_step_time() -> None:
    durations = []
    for slowdown in (1.0, 2.0):
        c = core()
        c.slowdown = slowdown
        c.add_request(EngineRequest("a", prompt_tokens=128, max_tokens=4))
        durations.append(c.step().duration)
    assert durations[1] == pytest.approx(2 * durations[0])


def test_eos_distribution_stops_early_unless_ignore_eos() -> None:
    c = core(eos_mean_tokens=5.0)
    for i in range(20):
        c.add_request(EngineRequest(f"r{i}", prompt_tokens=16, max_tokens=200))
    c.add_request(EngineRequest("keep", prompt_tokens=16, max_tokens=200, ignore_eos=True))
    events = run_to_end(c)
    reasons = {e.request_id: e.finished for e in events if e.finished}
    assert reasons["keep"] == "length"
    assert sum(r == "stop" for r in reasons.values()) >= 18


# -- admission: vLLM >= 0.32's --max-num-queued-reqs / --max-num-queued-tokens -------------


def test_queued_reqs_cap_refuses_the_next_request_and_it_never_enters() -> None:
    c = core(max_num_queued_reqs=3)
    for i in range(3):
        c.add_request(EngineRequest(f"r{i}", 8, 4))
    with pytest.raises(QueueFull) as refused:
        c.add_request(EngineRequest("r3", 8, 4))
    assert refused.value.reason == QUEUED_REQS == "max_num_queued_reqs"
    s = c.stats()
    assert (s.waiting, s.running) == (3, 0) and not c.abort_request("r3")
    assert s.admission_rejections == {QUEUED_REQS: 1, QUEUED_TOKENS: 0}
    c.step()  # all three run now: running requests count too (vLLM: waiting + running)
    assert c.stats().running == 3 and c.admission() == QUEUED_REQS
    run_to_end(c)
    c.add_request(EngineRequest("r4", 8, 4))  # room again once they finished


def test_queued_tokens_cap_counts_prompts_until_their_first_token() -> None:
    # a 64-token budget chunks a 100-token prompt over two steps
    c = core(max_num_queued_tokens=150, max_num_batched_tokens=64)
    c.add_request(EngineRequest("a", 100, 4))
    assert c.stats().prefill_tokens == 100
    c.add_request(EngineRequest("b", 100, 4))  # 100 < 150: admitted, its own prompt not added
    with pytest.raises(QueueFull) as refused:
        c.add_request(EngineRequest("c", 1, 4))  # 200 >= 150
    assert refused.value.reason == QUEUED_TOKENS == "max_num_queued_tokens"
    c.step()  # "a" ran 64 of its 100 prompt tokens: still all 100 count (no output yet)
    assert c.stats().running == 1 and c.stats().prefill_tokens == 200
    assert c.abort_request("b")  # a waiting request's prompt leaves the count with it
    assert c.stats().prefill_tokens == 100
    c.step()  # "a" finishes its prefill and emits its first token: out of the count
    assert c.stats().prefill_tokens == 0 and c.admission() is None
    assert c.stats().admission_rejections == {QUEUED_REQS: 0, QUEUED_TOKENS: 1}


def test_request_cap_is_checked_first_and_zero_refuses_everything() -> None:
    c = core(max_num_queued_reqs=0, max_num_queued_tokens=0)
    with pytest.raises(QueueFull, match="max_num_queued_reqs"):
        c.add_request(EngineRequest("a", 8, 4))
    c = core(max_num_queued_tokens=0)
    with pytest.raises(QueueFull, match="max_num_queued_tokens"):
        c.add_request(EngineRequest("a", 8, 4))


def test_no_caps_by_default() -> None:
    c = core()
    assert (c.profile.engine.max_num_queued_reqs, c.profile.engine.max_num_queued_tokens) == (
        None,
        None,
    )
    for i in range(300):
        c.add_request(EngineRequest(f"r{i}", 1000, 4))
    assert c.stats().waiting == 300 and c.admission() is None


def _step_times(c: EngineCore, steps: int) -> list[float]:
    c.add_request(EngineRequest("r", prompt_tokens=16, max_tokens=steps + 1))
    return [c.step().duration for _ in range(steps)]


def test_a_host_without_jitter_prices_every_decode_step_alike() -> None:
    times = _step_times(core(), 50)[1:]  # after the prefill, one decode a step
    assert max(times) / min(times) < 1.01  # only the context grows


def test_a_wandering_host_scales_step_time_by_a_correlated_factor() -> None:
    steady = _step_times(core(), 4001)[1:]
    wander = _step_times(core(jitter=0.1, jitter_s=0.5), 4001)[1:]
    logs = [math.log(w / s) for w, s in zip(wander, steady, strict=True)]
    mean = sum(logs) / len(logs)
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / len(logs))
    assert 0.06 < sd < 0.14  # the profile's 0.1, from ~4000 correlated steps
    lag = round(0.5 / (sum(steady) / len(steady)))  # steps in one correlation time
    pairs = list(zip(logs[:-lag], logs[lag:], strict=True))
    corr = sum((a - mean) * (b - mean) for a, b in pairs) / len(pairs) / sd**2
    assert 0.2 < corr < 0.55  # e^-1 = 0.37 one correlation time apart
    assert _step_times(core(jitter=0.1, jitter_s=0.5), 200)[1:] == wander[:199]  # seeded


def test_a_negative_jitter_is_refused() -> None:
    with pytest.raises(ValueError, match="jitter must be >= 0"):
        core(jitter=-0.1)
