"""A request's size is read from what the engine reads: padding, unknown fields and
nested keys count nothing; only generation is evidence; a prompt surely over the context
is named as vLLM would name it."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kneegate.gateway.request_size import (
    MAX_BYTES_PER_TOKEN,
    BadBody,
    RequestSize,
    over_context,
    read_request,
)

COMPLETIONS, CHAT = b"/v1/completions", b"/v1/chat/completions"


def size(body: dict[str, Any], path: bytes = COMPLETIONS, method: str = "POST") -> RequestSize:
    return read_request(method, path, json.dumps(body).encode())


@given(prompt=st.text(max_size=300), pad=st.integers(0, 5000),
       junk=st.dictionaries(st.sampled_from(["user", "x", "metadata"]), st.text(max_size=2000)))
def test_whitespace_and_unknown_fields_count_nothing(prompt: str, pad: int,
                                                     junk: dict[str, str]) -> None:
    plain = size({"prompt": prompt, "max_tokens": 7})
    body = json.dumps({**junk, "prompt": prompt, "max_tokens": 7}, indent=pad % 64)
    padded = read_request("POST", COMPLETIONS, (" " * pad + body + "\n" * pad).encode())
    assert padded == plain
    assert plain.prompt == -(-len(prompt.encode()) // 4) and plain.max_tokens == 7


def test_token_ids_count_one_each_and_a_batch_sums() -> None:
    ids = size({"prompt": list(range(300))})
    assert (ids.prompt, ids.floor) == (300, 300)
    batch = size({"prompt": ["a" * 400, list(range(50))]})
    assert (batch.prompt, batch.floor) == (150, 50)  # each prompt must fit on its own
    embed = size({"input": "b" * 80}, b"/v1/embeddings")
    assert embed.generation and embed.prompt == 20


def test_chat_counts_each_message_text_and_its_template() -> None:
    one = size({"messages": [{"role": "user", "content": "a" * 40}]}, CHAT)
    parts = size({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "a" * 40}, {"type": "image_url", "image_url": {"url": "x"}}]}]},
        CHAT)
    two = size({"messages": [{"role": "system", "content": "s" * 8},
                             {"role": "user", "content": "a" * 40}]}, CHAT)
    assert one.prompt == parts.prompt == 10 + 4 + 3
    assert two.prompt == one.prompt + 2 + 4
    capped = size({"messages": [], "max_completion_tokens": 9, "max_tokens": 5}, CHAT)
    assert capped.max_tokens == 9  # the field the engine reads first


@pytest.mark.parametrize(("value", "streams"), [
    (True, True), (1, True), ("true", True), ("yes", True), ("on", True),
    (False, False), (0, False), ("no", False), (2, False), ([], False), (None, False),
])
def test_stream_is_read_as_vllm_reads_it(value: object, streams: bool) -> None:
    assert size({"prompt": "p", "stream": value}).stream is streams


def test_only_the_top_level_stream_key_streams() -> None:
    body = {"prompt": 'say "stream": true', "stream_options": {"include_usage": True},
            "extra": {"stream": True}}
    assert size(body).stream is False


@pytest.mark.parametrize(("method", "path"), [
    ("GET", b"/v1/models"), ("POST", b"/tokenize"), ("POST", b"/detokenize"),
    ("GET", b"/v1/completions"), ("DELETE", b"/v1/files/f1"),
])
def test_what_asks_for_no_generation_is_no_evidence(method: str, path: bytes) -> None:
    got = read_request(method, path, b"not json at all")
    assert not got.generation and got.prompt == 0


def test_any_other_post_is_admitted_as_work_sized_by_its_json_text_or_bytes() -> None:
    doc = {"model": "m", "text_1": "q" * 400, "text_2": ["d" * 400]}
    scored = read_request("POST", b"/v1/score", json.dumps(doc, indent=40).encode())
    assert scored.generation and scored.floor == 0
    assert scored.prompt == -(-len(json.dumps(doc, separators=(",", ":"))) // 4)
    audio = read_request("POST", b"/v1/audio/transcriptions", b"\x00" * 4000)  # multipart
    assert audio.generation and audio.prompt == 1000


@pytest.mark.parametrize("body", [b"", b"{", b"[1, 2]", b"\xff\xfe", b'"prompt"'])
def test_a_generation_body_that_is_not_a_json_object_is_bad(body: bytes) -> None:
    with pytest.raises(BadBody):
        read_request("POST", COMPLETIONS, body)


def test_over_context_counts_only_the_floor_and_the_cap() -> None:
    ids = size({"prompt": list(range(2000)), "max_tokens": 48})
    assert over_context(ids, 2048) is None
    assert "2048 tokens" in (over_context(size({"prompt": list(range(2000)), "max_tokens": 49}),
                                          2048) or "")
    # text: refused only past MAX_BYTES_PER_TOKEN bytes a token (ordinary text is 3-5)
    ordinary = size({"prompt": "w" * 4 * 4000})  # ~4000 tokens
    assert ordinary.prompt == 4000 and over_context(ordinary, 2048) is None
    sure = size({"prompt": "w" * MAX_BYTES_PER_TOKEN * 2100})
    assert over_context(sure, 2048) is not None
    assert over_context(read_request("GET", b"/v1/models", b""), 1) is None
