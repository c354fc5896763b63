"""The tap: first-event time, token counts from usage or events, non-streamed usage."""

from __future__ import annotations

import json

from kneegate.gateway.tap import Tap


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _event(obj: object) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def test_first_data_event_time_and_usage_chunk() -> None:
    clock = Clock()
    tap = Tap(clock, streaming=True)
    clock.now = 1.0
    tap.feed(b": keep-alive comment\n\n")  # not a data event
    assert tap.first_at is None
    clock.now = 2.5
    tap.feed(_event({"choices": [{"text": "a"}], "usage": None}))
    clock.now = 3.0
    tap.feed(_event({"choices": [{"text": "b"}]}))
    tap.feed(_event({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 42}})
             + b"data: [DONE]\n\n")
    assert tap.first_at == 2.5
    assert tap.usage() == (7, 42)


def test_counts_events_without_usage() -> None:
    tap = Tap(Clock(), streaming=True)
    for i in range(5):
        tap.feed(_event({"choices": [{"text": str(i)}]}))
    tap.feed(b"data: [DONE]\n\n")
    assert tap.usage() == (0, 5)


def test_coalesced_chunks_count_every_event() -> None:
    tap = Tap(Clock(), streaming=True)
    tap.feed(b"".join(_event({"choices": [{"text": "x"}]}) for _ in range(3)))
    tap.feed(b"data: [DONE]\n\n")
    assert tap.usage() == (0, 3)


def test_non_streamed_json_usage() -> None:
    tap = Tap(Clock(), streaming=False)
    body = json.dumps({"choices": [{"text": "hi"}],
                       "usage": {"prompt_tokens": 3, "completion_tokens": 9}}).encode()
    tap.feed(body[:20])
    tap.feed(body[20:])
    assert tap.first_at is None
    assert tap.usage() == (3, 9)


def test_the_last_usage_wins_and_a_null_count_falls_back_to_the_one_before() -> None:
    tap = Tap(Clock(), streaming=True)
    # per-chunk usage (vLLM's continuous_usage_stats), then a final usage-only chunk
    tap.feed(_event({"choices": [{"text": "a"}],
                     "usage": {"prompt_tokens": 7, "completion_tokens": 1}}))
    tap.feed(_event({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 2}}))
    assert tap.usage() == (7, 2)
    tap.feed(_event({"choices": [], "usage": {"prompt_tokens": 8, "completion_tokens": None}}))
    assert tap.usage() == (8, 2)  # no number in the last: the count before it


def test_a_streams_usage_is_read_from_its_last_events_only() -> None:
    # a count early in a stream is the count at that time, not the answer's: with no usage
    # in its last events, the events are counted
    # in one chunk, as a short answer comes whole
    tap = Tap(Clock(), streaming=True)
    tap.feed(_event({"choices": [{"text": "a"}],
                     "usage": {"prompt_tokens": 7, "completion_tokens": 1}})
             + b"".join(_event({"choices": [{"text": str(i)}]}) for i in range(4))
             + b"data: [DONE]\n\n")
    assert tap.usage() == (0, 5)


def _chat(delta: dict[str, object], finish: str | None = None) -> bytes:
    return _event({"id": "chatcmpl-1", "object": "chat.completion.chunk",
                   "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})


def test_a_chat_streams_opening_role_event_is_no_token() -> None:
    # vLLM's chat stream: the assistant's role with empty content, then a token an event
    for opening in ({"role": "assistant", "content": ""},
                    {"role": "assistant", "content": "", "refusal": None}):  # OpenAI's
        tap = Tap(Clock(), streaming=True)
        tap.feed(_chat(opening))
        for i in range(16):
            tap.feed(_chat({"content": f"t{i}"}, "length" if i == 15 else None))
        tap.feed(b"data: [DONE]\n\n")
        assert tap.usage() == (0, 16)
        assert tap.events == 17  # what the tenant is charged as it streams: 16 and [DONE]


def test_a_role_event_that_carries_text_counts() -> None:
    tap = Tap(Clock(), streaming=True)
    tap.feed(_chat({"role": "assistant", "content": "Hi"}) + _chat({"content": "!"}))
    tap.feed(b"data: [DONE]\n\n")
    assert tap.usage() == (0, 2)
