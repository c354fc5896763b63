"""The emulator's prefix cache: what vLLM's automatic prefix caching does, block by block."""

from __future__ import annotations

import httpx
import pytest
from helpers.uvicorn_thread import serve
from hypothesis import given, settings
from hypothesis import strategies as st

from kneegate.emulator.core import EngineCore, EngineRequest
from kneegate.emulator.profiles import load_profile
from kneegate.emulator.protocol import parse_request, prefix_block_keys
from kneegate.emulator.server import build_app

BLOCK = 16  # cpu-tiny's block size


def core(**overrides) -> EngineCore:
    return EngineCore(load_profile("cpu-tiny", enable_prefix_caching=True, **overrides))


def keys(*labels: int) -> tuple[int, ...]:
    """A hash chain over block labels: equal leading labels, equal leading keys."""
    out, key = [], 0
    for label in labels:
        key = hash((key, label))
        out.append(key)
    return tuple(out)


def prefill_of(c: EngineCore, req: EngineRequest) -> int:
    """Prompt tokens the engine computes for `req`, run alone to its end."""
    c.add_request(req)
    prefill = 0
    while c.has_unfinished():
        prefill += c.step().num_prefill_tokens
    return prefill


def test_a_repeated_prompt_skips_the_blocks_it_shares_but_its_last_token() -> None:
    c = core()
    first = prefill_of(c, EngineRequest("a", 4 * BLOCK, 2, block_keys=keys(1, 2, 3, 4)))
    # the whole prompt is cached, yet its last token is recomputed: 3 blocks hit, not 4
    again = prefill_of(c, EngineRequest("b", 4 * BLOCK, 2, block_keys=keys(1, 2, 3, 4)))
    assert (first, again) == (4 * BLOCK, BLOCK)
    s = c.stats()
    assert (s.prefix_cache_queries, s.prefix_cache_hits) == (8 * BLOCK, 3 * BLOCK)
    assert s.kv_cache_usage == 0.0  # cached blocks are free blocks


def test_prompts_share_only_their_common_leading_blocks() -> None:
    c = core()
    prefill_of(c, EngineRequest("a", 4 * BLOCK, 1, block_keys=keys(1, 2, 3, 4)))
    # same first two blocks, then another third: the third key differs, so does the fourth
    assert prefill_of(c, EngineRequest("b", 4 * BLOCK, 1, block_keys=keys(1, 2, 9, 4))) == (
        2 * BLOCK
    )
    assert prefill_of(c, EngineRequest("c", 4 * BLOCK, 1, block_keys=keys(7, 2, 3, 4))) == (
        4 * BLOCK
    )


def test_off_by_default_as_the_profiles_are_measured() -> None:
    c = EngineCore(load_profile("cpu-tiny"))
    for rid in ("a", "b"):
        assert prefill_of(c, EngineRequest(rid, 4 * BLOCK, 1, block_keys=keys(1, 2, 3, 4))) == (
            4 * BLOCK
        )
    assert c.stats().prefix_cache_hits == 0


def test_a_full_cache_evicts_the_least_recently_freed_blocks_first() -> None:
    c = core(kv_cache_tokens=6 * BLOCK)  # 5 usable blocks
    prefill_of(c, EngineRequest("a", 2 * BLOCK, 1, block_keys=keys(1, 2)))
    prefill_of(c, EngineRequest("b", 2 * BLOCK, 1, block_keys=keys(3, 4)))
    # 4 blocks cached, 1 uncached free: a 3-block request evicts a's two (freed first)
    prefill_of(c, EngineRequest("c", 3 * BLOCK, 1, block_keys=keys(5, 6, 7)))
    assert prefill_of(c, EngineRequest("a2", 2 * BLOCK, 1, block_keys=keys(1, 2))) == 2 * BLOCK
    assert prefill_of(c, EngineRequest("c2", 3 * BLOCK, 1, block_keys=keys(5, 6, 7))) == BLOCK


def test_requests_running_together_share_one_copy_of_their_prefix() -> None:
    c = core()
    c.add_request(EngineRequest("a", 8 * BLOCK, 50, block_keys=keys(*range(8))))
    c.step()  # a's prompt is computed and published
    c.add_request(EngineRequest("b", 8 * BLOCK, 50, block_keys=keys(*range(8))))
    c.step()
    # a holds 8 prompt blocks + its first output's block; b hits 7, recomputes the eighth
    # (its last prompt token) and, finding it published, drops its copy for a's
    assert c.stats().kv_cache_usage * c.profile.num_blocks == pytest.approx(8 + 1)
    assert c.stats().prefix_cache_hits == 7 * BLOCK


@settings(max_examples=60, deadline=None)
@given(
    prompts=st.lists(
        st.tuples(st.lists(st.integers(0, 3), min_size=1, max_size=6), st.integers(1, 40)),
        min_size=1,
        max_size=12,
    ),
    cache_blocks=st.integers(8, 40),
    arrive_every=st.integers(1, 5),
)
def test_blocks_are_conserved_whatever_the_sharing_and_preemption(
    prompts: list[tuple[list[int], int]], cache_blocks: int, arrive_every: int
) -> None:
    """Every request ends; no step holds more blocks than the cache has; at the end every
    block is free again (cached ones included) and hits never exceed queries."""
    c = core(kv_cache_tokens=(cache_blocks + 1) * BLOCK, max_num_batched_tokens=64)
    pending = [
        EngineRequest(f"r{i}", len(labels) * BLOCK, out, block_keys=keys(*labels))
        for i, (labels, out) in enumerate(prompts)
        if (len(labels) * BLOCK + out - 1 + BLOCK - 1) // BLOCK <= cache_blocks
    ]
    finished: set[str] = set()
    for step in range(20_000):
        if step % arrive_every == 0 and pending:
            c.add_request(pending.pop(0))
        if not pending and not c.has_unfinished():
            break
        for e in c.step().events:
            if e.finished:
                finished.add(e.request_id)
        assert 0.0 <= c.stats().kv_cache_usage <= 1.0
    else:
        raise AssertionError("the engine did not finish")
    s = c.stats()
    assert s.kv_cache_usage == 0.0 and not c.has_unfinished()
    assert s.prefix_cache_hits <= s.prefix_cache_queries
    assert c._pool.free == c.profile.num_blocks and not c._pool.shared  # the invariant


def test_a_conversations_next_turn_keys_begin_with_the_last_turns() -> None:
    turn1 = [{"role": "system", "content": "s" * 300}, {"role": "user", "content": "u" * 200}]
    turn2 = [*turn1, {"role": "assistant", "content": "a" * 120}, {"role": "user", "content": "v"}]
    k1 = prefix_block_keys({"messages": turn1}, True, BLOCK)
    k2 = prefix_block_keys({"messages": turn2}, True, BLOCK)
    # turn 1's messages fill 16+300+16+200 = 532 bytes = 133 tokens: 8 full blocks shared (the
    # ninth holds turn 1's assistant opening, which turn 2 replaces by the assistant message)
    assert len(k1) == 8 and k2[:8] == k1 and len(k2) > len(k1)
    other = prefix_block_keys({"messages": [{"role": "system", "content": "t" * 300}]}, True,
                              BLOCK)
    assert other[0] != k1[0]


def test_token_id_and_text_prompts_are_cut_into_full_blocks_only() -> None:
    ids = list(range(3 * BLOCK + 5))
    assert len(prefix_block_keys({"prompt": ids}, False, BLOCK)) == 3
    assert len(prefix_block_keys({"prompt": "x" * (4 * 2 * BLOCK + 3)}, False, BLOCK)) == 2
    parsed = parse_request(b'{"prompt": "hello", "max_tokens": 1}', chat=False,
                           served_model="m", max_model_len=100)
    assert parsed.block_keys == ()  # no block size: caching off, nothing computed


def test_the_server_reports_vllms_prefix_cache_counters() -> None:
    app = build_app("cpu-tiny", speed=1.0, enable_prefix_caching=True)
    body = {"model": "cpu-tiny", "prompt": list(range(10 * BLOCK)), "max_tokens": 1}
    with serve(app) as url:
        for _ in range(2):
            assert httpx.post(f"{url}/v1/completions", json=body, timeout=30).status_code == 200
        text = httpx.get(f"{url}/metrics", timeout=10).text
    values = {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"))
    }
    assert values == {
        "vllm:prefix_cache_queries_total": 20 * BLOCK,
        "vllm:prefix_cache_hits_total": 9 * BLOCK,
    }
    assert 'enable_prefix_caching="True"' in text
