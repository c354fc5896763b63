"""The emulator behind a real socket, spoken to by the real openai client and raw HTTP; and
`kneegate engine` as a user starts it."""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest
from helpers.uvicorn_thread import serve
from prometheus_client.parser import text_string_to_metric_families

from kneegate.emulator.__main__ import count, make_app, parse_args
from kneegate.emulator.server import build_app
from kneegate.gateway.upstream.telemetry import parse_engine_metrics


def metric(url: str, name: str, **labels: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise AssertionError(f"{name} {labels} not in /metrics")


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", timeout=10, max_retries=0)


def test_streaming_completion_parses_with_the_openai_client(emulator) -> None:
    url, _ = emulator
    chunks = list(
        client(url).completions.create(
            model="cpu-tiny",
            prompt="hello world",
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == " tok1 tok2 tok3 tok4 tok5"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert chunks[-1].usage.prompt_tokens == 3  # ceil(11 bytes / 4)
    assert chunks[0].id.startswith("cmpl-") and chunks[0].object == "text_completion"


def test_non_streaming_completion_with_token_ids(emulator) -> None:
    url, _ = emulator
    r = client(url).completions.create(model="cpu-tiny", prompt=[1, 2, 3, 4], max_tokens=3)
    assert r.choices[0].text == " tok1 tok2 tok3" and r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (4, 3)


def test_chat_streaming_and_not(emulator) -> None:
    url, _ = emulator
    messages = [{"role": "user", "content": "abcdefgh"}]
    chunks = list(
        client(url).chat.completions.create(
            model="cpu-tiny",
            messages=messages,
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        == " tok1 tok2 tok3 tok4"
    )
    assert chunks[-1].usage.prompt_tokens == 3 + 4 + 2  # priming + per-message + ceil(8/4)
    assert chunks[0].id.startswith("chatcmpl-")
    r = client(url).chat.completions.create(model="cpu-tiny", messages=messages, max_tokens=2)
    assert r.choices[0].message.content == " tok1 tok2" and r.usage.completion_tokens == 2


def test_sse_wire_format_is_vllms(emulator) -> None:
    url, _ = emulator
    body = {
        "model": "cpu-tiny",
        "prompt": "x",
        "max_tokens": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    raw = httpx.post(f"{url}/v1/completions", json=body, timeout=10).text
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert all(e.startswith("data: {") for e in events[:-2])
    assert '"choices":[]' in events[-3] and '"usage"' in events[-3]


def test_models_health_version(emulator) -> None:
    url, _ = emulator
    models = httpx.get(f"{url}/v1/models").json()
    assert models["data"][0]["id"] == "cpu-tiny" and models["data"][0]["max_model_len"] == 2048
    assert httpx.get(f"{url}/health").status_code == 200
    assert "version" in httpx.get(f"{url}/version").json()


def test_tokenize_answers_vllms_shape_with_as_many_ids_as_the_prompt_counts(emulator) -> None:
    """vLLM's POST /tokenize, as vllm-router's cache-aware policy asks every engine: the ids
    number what the completion's usage counts, and a conversation's next turn begins with
    its last turn's ids (the router matches those prefixes)."""
    url, _ = emulator
    turn1 = [{"role": "system", "content": "be brief " * 30}, {"role": "user", "content": "hi"}]
    turn2 = [*turn1, {"role": "assistant", "content": "hello there"},
             {"role": "user", "content": "and then?"}]
    t1 = httpx.post(f"{url}/tokenize", json={"model": "cpu-tiny", "messages": turn1}).json()
    t2 = httpx.post(f"{url}/tokenize", json={"messages": turn2}).json()
    assert set(t1) == {"count", "max_model_len", "tokens", "token_strs"}
    assert t1["max_model_len"] == 2048 and t1["count"] == len(t1["tokens"])
    usage = client(url).chat.completions.create(model="cpu-tiny", messages=turn1,  # type: ignore[arg-type]
                                                max_tokens=1).usage
    assert usage is not None and t1["count"] == usage.prompt_tokens
    opening = 3  # the assistant turn the template opens ends turn 1's ids, not turn 2's
    assert t2["tokens"][: t1["count"] - opening] == t1["tokens"][:-opening]
    assert t2["tokens"][t1["count"] - opening] != t1["tokens"][-opening]
    assert all(0 <= t < 2**31 for t in t2["tokens"])
    no_opening = httpx.post(f"{url}/tokenize", json={"messages": turn1,
                                                     "add_generation_prompt": False}).json()
    assert no_opening["tokens"] == t1["tokens"][:-opening]
    text = httpx.post(f"{url}/tokenize", json={"prompt": "abcdefghi"}).json()
    assert text["count"] == 3 and text["tokens"][0] != text["tokens"][1]
    assert httpx.post(f"{url}/tokenize", json={"prompt": [7, 8, 9]}).json()["tokens"] == [7, 8, 9]
    other = httpx.post(f"{url}/tokenize", json={"model": "gpt-9", "prompt": "hi"})
    assert other.status_code == 404 and "does not exist" in other.json()["error"]["message"]
    empty = httpx.post(f"{url}/tokenize", json={"model": "cpu-tiny"})
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "prompt"


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        (b"{not json", 400, "JSON"),
        (b'{"model": "cpu-tiny"}', 400, "prompt"),
        (b'{"prompt": "hi", "max_tokens": 0}', 400, "at least 1"),
        (b'{"prompt": "hi", "max_tokens": 5000}', 400, "maximum context length is 2048"),
        (b'{"model": "gpt-9", "prompt": "hi"}', 404, "does not exist"),
    ],
)
def test_errors_have_vllms_shape(emulator, body: bytes, status: int, needle: str) -> None:
    url, _ = emulator
    r = httpx.post(
        f"{url}/v1/completions", content=body, headers={"content-type": "application/json"}
    )
    assert r.status_code == status
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    assert needle in err["message"]


def test_metrics_parse_and_count(emulator) -> None:
    url, _ = emulator
    before = metric(url, "vllm:generation_tokens_total")
    client(url).completions.create(model="cpu-tiny", prompt="hi", max_tokens=7)
    assert metric(url, "vllm:generation_tokens_total") == before + 7
    assert metric(url, "vllm:time_to_first_token_seconds_count", engine="0") >= 1
    assert (
        metric(url, "vllm:request_success_total", finished_reason="length", model_name="cpu-tiny")
        >= 1
    )
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:num_preemptions_total",
        "vllm:prompt_tokens_total",
        "vllm:inter_token_latency_seconds_count",
        "vllm:e2e_request_latency_seconds_count",
        "vllm:request_queue_time_seconds_count",
    ):
        metric(url, name)


def test_metrics_tell_the_kv_cache_size_as_vllm_does(emulator) -> None:
    url, app = emulator
    text = httpx.get(f"{url}/metrics", timeout=5).text
    stats = parse_engine_metrics(text, at=0.0)  # the gateway's reader
    profile = app.state.emulator.profile
    assert stats is not None
    assert stats.kv_capacity_tokens == profile.num_blocks * profile.engine.block_size


def test_disconnect_mid_stream_aborts_within_one_second(emulator) -> None:
    url, _ = emulator
    aborts = metric(url, "vllm:request_success_total", finished_reason="abort")
    body = {"model": "cpu-tiny", "prompt": "x" * 400, "max_tokens": 1500, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=10) as r:
        chunks = r.iter_raw()  # keep it: a dropped iterator closes the connection
        assert next(chunks).startswith(b"data: ")  # the first token is out: it is running
        assert metric(url, "vllm:num_requests_running") == 1
        assert metric(url, "vllm:kv_cache_usage_perc") > 0
    deadline = time.monotonic() + 1.0
    while metric(url, "vllm:request_success_total", finished_reason="abort") == aborts:
        assert time.monotonic() < deadline, "no abort within 1 s of the disconnect"
    assert metric(url, "vllm:num_requests_running") == 0
    assert metric(url, "vllm:kv_cache_usage_perc") == 0.0


def test_admin_slowdown_sets_the_capacity_knob(emulator) -> None:
    url, app = emulator
    r = httpx.post(f"{url}/admin/slowdown", json={"factor": 2.0})
    assert r.json() == {"slowdown": 2.0} and app.state.emulator.core.slowdown == 2.0
    assert httpx.post(f"{url}/admin/slowdown", json={"factor": 0}).status_code == 400
    httpx.post(f"{url}/admin/slowdown", json={"factor": 1.0})


# -- vLLM >= 0.32's admission valve: --max-num-queued-reqs / --max-num-queued-tokens ------

BUSY = (
    "The engine is currently busy and cannot accept new requests. "
    "Please try again later or on a different instance."
)
BACKLOG = (
    "The engine has reached its prefill token backlog limit. "
    "Please try again later or on a different instance."
)


def refused(url: str) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/completions", json={"model": "cpu-tiny", "prompt": "hi", "max_tokens": 2}
    )


def test_full_request_cap_answers_vllms_503_and_counts_it() -> None:
    with serve(build_app("cpu-tiny", max_num_queued_reqs=1)) as url:
        reasons = ("max_num_queued_reqs", "max_num_queued_tokens")
        assert [metric(url, "vllm:admission_rejections_total", reason=r) for r in reasons] == [0, 0]
        body = {"model": "cpu-tiny", "prompt": "x" * 400, "max_tokens": 1500, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=10) as r:
            chunks = r.iter_raw()  # keep it: a dropped iterator closes the connection
            assert next(chunks).startswith(b"data: ")  # the one slot is taken
            for _ in range(2):
                answer = refused(url)
                assert answer.status_code == 503 and "retry-after" not in answer.headers
                assert answer.json() == {
                    "error": {
                        "message": BUSY,
                        "type": "Service Unavailable",
                        "param": None,
                        "code": 503,
                    }
                }
            assert metric(url, "vllm:num_requests_running") == 1  # never entered the engine
            assert metric(url, "vllm:num_requests_waiting") == 0
        rejections = [metric(url, "vllm:admission_rejections_total", reason=r) for r in reasons]
        assert rejections == [2, 0]
        assert metric(url, "vllm:request_success_total", finished_reason="length") == 0


def test_full_token_cap_answers_vllms_backlog_503() -> None:
    with serve(build_app("cpu-tiny", max_num_queued_tokens=0)) as url:  # 0 >= 0: all refused
        answer = refused(url)
        assert answer.status_code == 503 and answer.json()["error"]["message"] == BACKLOG
        assert metric(url, "vllm:admission_rejections_total", reason="max_num_queued_tokens") == 1
        assert metric(url, "vllm:admission_rejections_total", reason="max_num_queued_reqs") == 0


def test_cli_takes_both_flags_as_vllm_spells_them() -> None:
    args = parse_args(["--max-num-queued-reqs", "64", "--max-num-queued-tokens", "2.5k"])
    engine = make_app(args).state.emulator.profile.engine
    assert (engine.max_num_queued_reqs, engine.max_num_queued_tokens) == (64, 2500)
    engine = make_app(parse_args([])).state.emulator.profile.engine
    assert (engine.max_num_queued_reqs, engine.max_num_queued_tokens) == (None, None)
    assert [count(t) for t in ("0", "1280", "32k", "1K", "1m")] == [0, 1280, 32000, 1024, 10**6]
    for bad in ("-1", "abc", "1.5K", "1.5", "k", ""):
        with pytest.raises(SystemExit):
            parse_args(["--max-num-queued-tokens", bad])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _line(proc: subprocess.Popen[bytes], prefix: str, timeout: float = 30.0) -> str:
    """The child's first line on stderr that starts with `prefix`, within `timeout`."""
    assert proc.stderr is not None
    deadline, buf = time.monotonic() + timeout, b""
    while True:
        for line in buf.decode().splitlines(keepends=True):
            if line.startswith(prefix) and line.endswith("\n"):
                return line.strip()
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([proc.stderr], [], [], left)[0]:
            break
        chunk = os.read(proc.stderr.fileno(), 65536)
        if not chunk:
            break  # it exited
        buf += chunk
    raise AssertionError(f"no line starting {prefix!r} within {timeout}s: {buf!r}")


def test_kneegate_engine_says_where_it_listens_once_it_does() -> None:
    port = _free_port()
    with subprocess.Popen([sys.executable, "-m", "kneegate", "engine", "--port", str(port)],
                          stderr=subprocess.PIPE) as proc:
        try:
            url = f"http://127.0.0.1:{port}"
            _line(proc, f"kneegate engine: the cpu-tiny emulator listening on {url} ")
            assert httpx.get(url + "/health", timeout=5).status_code == 200  # listening: no wait
        finally:
            proc.send_signal(signal.SIGINT)
            proc.communicate(timeout=20)
    assert proc.returncode == 0


def test_kneegate_engine_on_a_port_in_use_is_one_line() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "kneegate", "engine", "--port", str(port)],
                             capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr == (f"kneegate: port {port} on 127.0.0.1 is in use; choose another with "
                          "--port\n")
